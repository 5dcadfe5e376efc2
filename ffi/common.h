// What the forward and backward FFI handlers share: their bindings and attributes, the routing
// rule that picks a variant, module loading, device arch, shape checks and the launch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include <cuda_runtime.h>

#include "dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace fa4 {

namespace ffi = xla::ffi;

// The operands a call passes after seq_used_k, counted (fa4_jax/abi/targets.py,
// OPTIONAL_OPERANDS): none; the segment operands, ids q_segment_ids s32 [b, sq] and
// kv_segment_ids s32 [b, sk] (a row sees only keys of its own id) and their span tables
// row_spans s32 [b, ceil(sq / 64), 4] and key_spans s32 [b, ceil(sk / 64), 4]
// (fa4_jax/abi/segment_layout.py), which the segments variants read; or those and mask_bits s32
// [b, sq, ceil(sk / 32)] (bit k % 32 of word k / 32 of row q: q sees k;
// fa4_jax/runtime/mask_bits.py), whose span tables they are, which the mask_array variants read.
constexpr int32_t kSegmentOperands = 4;
constexpr int32_t kMaskOperands = 5;

// A handler pair's binding: how it learns the count of optional operands, which its instantiate
// stage must know (it loads the variants that read them) but sees attributes only. A current
// target's call names it in the `optional_operands` attribute; an earlier release's target took
// one count, which its pair fixes (its calls carry no such attribute).
constexpr int32_t kNamedByCall = -1;

// A call's attributes: the problem's (window bounds: -1 = unbounded; softcap 0 = none; top_left:
// the masks' alignment), never a kernel's tuning, so that a serialized call runs whatever variant
// the installed library routes it to; but the development library (built with
// FA4_JAX_TUNING_TARGETS: benchmarks/ablations.py) takes `tuning`, the variant to run.
struct Attrs {
  float softmax_scale;
  bool causal;
  int32_t window_left, window_right;
  float softcap;
  bool top_left;
  bool deterministic;  // the backward's
  int32_t optional_operands;  // 0, kSegmentOperands or kMaskOperands
  std::string_view tuning;  // empty: the routing rule chooses
};

// Errors name the handler they come from.
class Errors {
 public:
  explicit Errors(const char* handler) : handler_(handler) {}
  ffi::Error Invalid(const std::string& msg) const;
  ffi::Error Internal(const std::string& msg) const;
  // A variant the first-use gate refuses (gate.h): the call is valid, this process may not run it.
  ffi::Error Refused(const std::string& msg) const;
  ffi::Error Cuda(cudaError_t e) const;

 private:
  const char* handler_;
};

// Reads and checks a call's attributes of `kind` under `binding` (kNamedByCall, or a fixed count
// of optional operands). An attribute the handler does not read is an error: a misspelt one
// would otherwise change nothing, silently.
ffi::Error ReadAttrs(const Errors& err, Fa4Kind kind, int32_t binding, const ffi::Dictionary& dict,
                     Attrs* a);

// Mirrors fa4_jax.abi.routing.mask_kind: a window bound on either side makes the call "local".
const char* SelectMask(const Attrs& a);

// A call's problem class and shapes, as fa4_jax.abi.routing.Call.
struct Problem {
  Fa4Kind kind;
  std::string arch;
  Fa4Dtype dtype;
  int64_t head_dim, head_dim_v;
  const char* mask;
  bool softcap;
  int64_t seqlen_q, seqlen_k;
  bool ragged;
  bool top_left;
  bool segments;  // segment ids and span tables passed
  bool mask_array;  // a boolean mask's bits too
};

// The variant serving `p`: the one of `tuning` when given (the development library's calls),
// else the first route that fits and is compiled, else the default (fa4_jax.abi.routing.choose).
// nullptr when none is compiled.
const Fa4Variant* Choose(const Problem& p, std::string_view tuning = {});

// Mirrors fa4_jax.abi.routing.Variant.name, to name a variant missing from the menu.
std::string VariantName(const Problem& p, std::string_view tuning);

// The instantiate stage of either kind's handler (XLA runs it when it builds the call's thunk,
// outside the execute path, which it may capture into a CUDA graph, where loading a module is
// illegal). Loads every variant of `kind` that reads the call's optional operands and that this
// call site can select (its dtype, head dims and shapes are not known yet) and the first-use
// gate lets run (gate.h): one it refuses may be unchecked, and loading is its first touch of
// the GPU. Loads nothing when the visible devices mix archs; execute loads then.
ffi::Error Instantiate(const Errors& err, Fa4Kind kind, int32_t binding, const ffi::Dictionary& dict);

// The arch of `device`, as the variants name it ("sm_90a").
ffi::Error DeviceArch(const Errors& err, int ordinal, std::string* arch);

// The variant serving a call, loaded; an error naming the missing variant, or the first-use
// gate's refusal (gate.h), otherwise.
ffi::Error FindLoaded(const Errors& err, const Problem& p, std::string_view tuning,
                      const Fa4Variant** variant);

ffi::Error IoDtype(const Errors& err, ffi::DataType t, Fa4Dtype* dtype);
std::string Shape(ffi::Span<const int64_t> dims);
ffi::Error ExpectShape(const Errors& err, const char* what, ffi::Span<const int64_t> got,
                       std::initializer_list<int64_t> want);

// Checks q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv] (rank, one dtype, GQA ratio, int32
// range) and fills args' pointers and dims.
ffi::Error CheckQkv(const Errors& err, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    Fa4Dtype* dtype, Fa4Args* args);

// Checks seq_used_q and seq_used_k, int32 [b] each (every batch entry's valid query rows and
// keys; the kernels clamp them to sq and sk) or [0] each (a dense batch: no lengths to read),
// after CheckQkv, and fills args' pointers and b_lengths.
ffi::Error CheckSeqUsed(const Errors& err, ffi::Buffer<ffi::S32> seq_used_q,
                        ffi::Buffer<ffi::S32> seq_used_k, Fa4Args* args);

// Checks the optional operands (the operands after seq_used_k) against the count the call's
// attributes give and the shapes CheckQkv filled in, and fills args' pointers and dims.
ffi::Error CheckOptionalOperands(const Errors& err, const ffi::RemainingArgs& operands,
                                 const Attrs& a, Fa4Args* args);

// The window bounds the "local" kernels take: an unbounded side becomes max(sq, sk), which
// covers every key while keeping the kernels' index arithmetic far from int32 overflow (so
// wider windows are clamped to it too: the same keys are visible). Causal is a right bound of 0.
void KernelWindow(const Attrs& a, Fa4Args* args);

ffi::Error Launch(const Errors& err, const Fa4Variant& variant, const Fa4Args& args,
                  cudaStream_t stream);

}  // namespace fa4

// Defines the library's handler pair `<prefix>Instantiate` and `<prefix>Execute` of one binding
// (kNamedByCall, or an earlier target's count of optional operands): the symbols that
// fa4_jax/abi/targets.py binds target names to. For forward.cc and backward.cc, which define
// the InstantiateAs, ExecuteAs and BindExecute of their kind.
#define FA4_DEFINE_HANDLERS(prefix, binding)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##Instantiate, fa4::InstantiateAs<binding>,  \
                                xla::ffi::Ffi::BindInstantiate().Attrs());         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(prefix##Execute, fa4::ExecuteAs<binding>,          \
                                fa4::BindExecute(xla::ffi::Ffi::Bind()))
