// The uniform interface to the compiled forward variants. The table itself is generated from the
// variant menu (fa4_jax/aot/codegen.py -> build/aot/dispatch.cc).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

enum class Fa4Dtype { kBF16, kF16 };

// One launch: device pointers, the dynamic dims, and the kernel's runtime scalars.
struct Fa4FwdArgs {
  void* q;
  void* k;
  void* v;
  void* out;
  void* lse;
  int32_t b, seqlen_q, seqlen_k, heads, heads_k;
  float softmax_scale, softcap;
  int32_t window_left, window_right;
};

struct Fa4FwdVariant {
  const char* name;  // = fa4_jax.aot.variants.Variant.name
  const char* arch;  // "sm_90a", "sm_100a"
  Fa4Dtype dtype;
  int head_dim, head_dim_v;
  const char* mask;  // "none", "causal", "local"
  bool softcap;
  // Loads the module onto every visible device, once per process; later calls return the result.
  cudaError_t (*load)();
  // The exported launcher's return code (0 = launched).
  int32_t (*launch)(const Fa4FwdArgs& args, cudaStream_t stream);
};

extern const Fa4FwdVariant kFa4FwdVariants[];
extern const int kFa4FwdVariantCount;
