// The uniform interface to the compiled variants and their routing rules. The tables themselves
// are generated from the menu (fa4_jax/aot/codegen.py -> build/aot/dispatch.cc).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

// The library's C entry points for Python (ctypes) and tools; the static archives' symbols stay
// hidden (the link's --exclude-libs).
#define FA4_EXPORT extern "C" __attribute__((visibility("default")))

enum class Fa4Kind { kFwd, kBwd };
enum class Fa4Dtype { kBF16, kF16 };

// One launch of either kind: device pointers, the dynamic dims and the kernel's runtime scalars.
// A kind reads the fields of its tensors in fa4_jax/aot/compile.py (TENSORS, SCALARS); the rest
// stay unset.
struct Fa4Args {
  // forward and backward inputs; the forward writes out and lse
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  // int32 [b_lengths] each: the valid query rows and keys of every batch entry of a ragged
  // batch (b_lengths = b), or nothing (b_lengths = 0: a dense batch, the buffers' lengths)
  void* seq_used_q = nullptr;
  void* seq_used_k = nullptr;
  // int32: segment ids [b_segments, seqlen_q] and [b_segments, seqlen_k], and their span tables
  // [b_segments, q_chunks, 4] and [b_segments, k_chunks, 4] (fa4_jax/abi/segment_layout.py); read by
  // the segments variants, b_segments = 0 (nothing) for the others
  void* q_segment_ids = nullptr;
  void* kv_segment_ids = nullptr;
  void* row_spans = nullptr;
  void* key_spans = nullptr;
  // int32 [b_mask, seqlen_q, k_words]: a boolean mask, 32 keys to a word (fa4_jax/runtime/mask_bits.py);
  // read by the mask_array variants, b_mask = 0 (nothing) for the others
  void* mask_bits = nullptr;
  // backward only
  void* d_out = nullptr;
  void* d_lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dq_accum = nullptr;
  void* dpsum = nullptr;
  void* lse_log2 = nullptr;
  void* semaphore = nullptr;
  int32_t b = 0, seqlen_q = 0, seqlen_k = 0, heads = 0, heads_k = 0, b_lengths = 0;
  int32_t b_segments = 0, q_chunks = 0, k_chunks = 0;
  int32_t b_mask = 0, k_words = 0;
  // backward: d_lse's leading dim, b, or 0 when lse is not differentiated (d_lse is empty)
  int32_t b_dlse = 0;
  int32_t seqlen_q_pad = 0, semaphore_blocks = 0, dq_copies = 1;  // backward workspaces, see compile.py
  float softmax_scale = 1.0f, softcap = 0.0f;
  int32_t window_left = 0, window_right = 0;
  int32_t top_left = 0;  // 1: masks aligned to the top-left corner (offset 0)
  int32_t deterministic = 0;
  int32_t num_sms = 0;  // backward: the device's multiprocessors (see compile.py)
};

struct Fa4Variant {
  const char* name;  // = fa4_jax.abi.routing.Variant.name
  Fa4Kind kind;
  const char* arch;  // "sm_90a", "sm_100f"
  Fa4Dtype dtype;
  int head_dim, head_dim_v;
  const char* mask;  // "none", "causal", "local"
  bool softcap;
  const char* tuning;  // "default", or a tuned variant's name (the arch menu's TUNINGS)
  bool segments;  // reads segment ids (calls with 4 or 5 optional operands: common.h)
  bool mask_array;  // also reads a boolean mask's bits (calls with 5)
  // Loads the module onto every visible device, once per process; later calls return the result.
  cudaError_t (*load)();
  // The exported launcher's return code (0 = launched).
  int32_t (*launch)(const Fa4Args& args, cudaStream_t stream);
};

// fa4_jax.abi.routing.Route: calls of (kind, arch, mask, head_dim) meeting every condition run the
// `tuning` variant of their problem class, if compiled. 0 means no condition; softcap is -1
// (either), 0 or 1; mask_array: calls with a boolean mask's bits, or calls without.
struct Fa4Route {
  Fa4Kind kind;
  const char* arch;
  const char* mask;
  int head_dim;
  const char* tuning;
  int min_rows, max_rows, max_len;
  bool dense;
  int diagonal_block, tail_tile_n, tail_keys;
  int softcap;
  bool mask_array;
};

extern const Fa4Variant kFa4Variants[];
extern const int kFa4VariantCount;
extern const Fa4Route kFa4Routes[];
extern const int kFa4RouteCount;
// Backward workspace geometry (fa4_jax/kernels/bwd_workspace.py).
extern const int kFa4BwdSeqPad;
extern const int kFa4BwdSemaphoreRows;
extern const int kFa4BwdMaxDqCopies;
// Positions per entry of the segment span tables (fa4_jax/abi/segment_layout.py).
extern const int kFa4SpanChunk;
// The archs whose kernels no GPU of the arch had run when the library was built (the manifest's
// unverified_arches): the handlers run them only once verified (gate.h).
extern const char* const kFa4UnverifiedArches[];
extern const int kFa4UnverifiedArchCount;
