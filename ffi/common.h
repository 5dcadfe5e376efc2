// What the forward and backward FFI handlers share: attribute checks, the routing rule that picks
// a variant, module loading, device arch, shape checks and the launch.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include <cuda_runtime.h>

#include "dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace fa4 {

namespace ffi = xla::ffi;

// The static attributes both custom calls take: they describe the problem, never a kernel's
// tuning (window bounds: -1 = unbounded; softcap 0 = none; top_left: the masks' alignment).
struct Attrs {
  float softmax_scale;
  bool causal;
  int32_t window_left, window_right;
  float softcap;
  bool top_left;
};

// Binds the attributes of `Attrs` (all but `deterministic`, which only the backward takes), in
// that order, after whatever `binding` already holds. XLA matches attributes by name, so both
// handlers and both stages share this one list.
template <typename Binding>
auto BindAttrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<float>("softmax_scale")
      .template Attr<bool>("causal")
      .template Attr<int32_t>("window_left")
      .template Attr<int32_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("top_left");
}

// Errors name the custom call target they come from.
class Errors {
 public:
  explicit Errors(const char* target) : target_(target) {}
  ffi::Error Invalid(const std::string& msg) const;
  ffi::Error Internal(const std::string& msg) const;
  // A variant the first-use gate refuses (gate.h): the call is valid, this process may not run it.
  ffi::Error Refused(const std::string& msg) const;
  ffi::Error Cuda(cudaError_t e) const;

 private:
  const char* target_;
};

ffi::Error CheckAttrs(const Errors& err, const Attrs& a);

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
  bool segments;  // a call of the segments targets: segment ids and span tables present
  bool mask_array;  // a call of the masked targets: a boolean mask's bits too
};

// The variant serving `p`: the one of `tuning` when given (the development library's targets),
// else the first route that fits and is compiled, else the default (fa4_jax.abi.routing.choose).
// nullptr when none is compiled.
const Fa4Variant* Choose(const Problem& p, std::string_view tuning = {});

// Mirrors fa4_jax.abi.routing.Variant.name, to name a variant missing from the menu.
std::string VariantName(const Problem& p, std::string_view tuning);

// Loads every variant of `kind` (with segment ids or without, with mask bits or without) this
// call site can select (its dtype, head dims and shapes are not known at instantiate time) and
// the first-use gate lets run (gate.h): one it refuses may be unchecked, and loading is its first
// touch of the GPU. Does nothing when the visible devices mix archs; execute loads then.
ffi::Error LoadCandidates(const Errors& err, Fa4Kind kind, bool segments, bool mask_array,
                          const Attrs& a);

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

// The window bounds the "local" kernels take: an unbounded side becomes max(sq, sk), which
// covers every key while keeping the kernels' index arithmetic far from int32 overflow (so
// wider windows are clamped to it too: the same keys are visible). Causal is a right bound of 0.
void KernelWindow(const Attrs& a, Fa4Args* args);

// The segment operands of the segments targets: ids int32 [b, sq] and [b, sk], span tables
// int32 [b, ceil(sq / 64), 4] and [b, ceil(sk / 64), 4] (fa4_jax/abi/segment_layout.py); and the
// masked targets' mask bits, int32 [b, sq, ceil(sk / 32)] (fa4_jax/runtime/mask_bits.py), or nullptr.
struct SegmentBuffers {
  ffi::Buffer<ffi::S32> q_ids, kv_ids, row_spans, key_spans;
  const ffi::Buffer<ffi::S32>* mask_bits = nullptr;
};

// Checks the segment operands against the shapes CheckQkv filled in and fills args' pointers
// and dims.
ffi::Error CheckSegments(const Errors& err, const SegmentBuffers& s, Fa4Args* args);

// Binds the four segment operands, in SegmentBuffers' order, after whatever `binding` holds.
template <typename Binding>
auto BindSegments(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()   // q_segment_ids
      .template Arg<ffi::Buffer<ffi::S32>>()   // kv_segment_ids
      .template Arg<ffi::Buffer<ffi::S32>>()   // row_spans
      .template Arg<ffi::Buffer<ffi::S32>>();  // key_spans
}

// Binds the masked targets' operands: the four segment operands, then the mask bits.
template <typename Binding>
auto BindMasked(Binding&& binding) {
  return BindSegments(std::forward<Binding>(binding)).template Arg<ffi::Buffer<ffi::S32>>();
}

ffi::Error Launch(const Errors& err, const Fa4Variant& variant, const Fa4Args& args,
                  cudaStream_t stream);

}  // namespace fa4
