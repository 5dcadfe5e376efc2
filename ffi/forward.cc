// XLA FFI handler for the custom call target `fa4_jax_fwd_v2`: FlashAttention forward.
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]   (bf16 or f16, all the same),
//           seq_used_q s32 [b], seq_used_k s32 [b]: each batch entry's valid query rows and keys
//           of a ragged batch (rows past seq_used_q get out 0, lse -inf); both [0] for a dense
//           batch, whose lengths are the buffers' (the kernels then read none)
//   results out [b, sq, h, dv] (q's dtype), lse [b, h, sq] (f32)
//   attrs   softmax_scale f32, causal bool, window_left/window_right i32 (-1 = unbounded),
//           softcap f32 (0 = none), top_left bool
//
// The attributes describe the problem; the variant is the routing rule's choice for the call's
// shapes (common.h, Choose), so a serialized program runs whatever the installed library tunes.
// Modules load in the instantiate stage, outside the execute path, because XLA may capture
// execute into a CUDA graph, where loading a module is illegal. The handler is not declared
// command-buffer compatible: nothing tests it under graph capture yet.
//
// `fa4_jax_fwd_segments_v1` is the same call with four more inputs after seq_used_k: segment
// ids q_segment_ids s32 [b, sq] and kv_segment_ids s32 [b, sk] (a row sees only keys of its own
// id) and their span tables row_spans s32 [b, ceil(sq / 64), 4], key_spans s32
// [b, ceil(sk / 64), 4] (fa4_jax/abi/segment_layout.py); it runs the segments variants.
// `fa4_jax_fwd_masked_v1` adds a boolean mask after those four, mask_bits s32
// [b, sq, ceil(sk / 32)] (bit k % 32 of word k // 32 of row q: q sees k; fa4_jax/runtime/mask_bits.py),
// whose span tables they are; it runs the mask_array variants.
//
// Built with FA4_JAX_TUNING_TARGETS (the benchmarks' development library), it also defines
// `fa4_jax_dev_fwd_v2`, the same call with a `tuning` string attribute naming the variant.
#include <string_view>

#include "common.h"

namespace fa4 {
namespace {

ffi::Error Instantiate(const Errors& err, const Attrs& a, bool segments = false,
                       bool mask_array = false) {
  return LoadCandidates(err, Fa4Kind::kFwd, segments, mask_array, a);
}

// segments: the segments target's operands, nullptr for the others.
ffi::Error Execute(const Errors& err, std::string_view tuning, cudaStream_t stream, int32_t device,
                   ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> seq_used_q, ffi::Buffer<ffi::S32> seq_used_k,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   const Attrs& a, const SegmentBuffers* segments = nullptr) {
  if (ffi::Error e = CheckAttrs(err, a); e.failure()) return e;
  Fa4Args args;
  Fa4Dtype dtype;
  if (ffi::Error e = CheckQkv(err, q, k, v, &dtype, &args); e.failure()) return e;
  if (ffi::Error e = CheckSeqUsed(err, seq_used_q, seq_used_k, &args); e.failure()) return e;
  if (segments != nullptr)
    if (ffi::Error e = CheckSegments(err, *segments, &args); e.failure()) return e;
  if (out->element_type() != q.element_type()) return err.Invalid("out must have q's dtype");
  const int64_t b = args.b, sq = args.seqlen_q, h = args.heads, d = q.dimensions()[3],
                dv = v.dimensions()[3];
  if (ffi::Error e = ExpectShape(err, "out", out->dimensions(), {b, sq, h, dv}); e.failure())
    return e;
  if (ffi::Error e = ExpectShape(err, "lse", lse->dimensions(), {b, h, sq}); e.failure())
    return e;
  Problem p{Fa4Kind::kFwd, "", dtype, d, dv, SelectMask(a), a.softcap > 0.0f, sq, args.seqlen_k,
            args.b_lengths > 0, a.top_left, segments != nullptr,
            segments != nullptr && segments->mask_bits != nullptr};
  if (ffi::Error e = DeviceArch(err, device, &p.arch); e.failure()) return e;
  const Fa4Variant* variant;
  if (ffi::Error e = FindLoaded(err, p, tuning, &variant); e.failure()) return e;
  if (b == 0 || sq == 0 || h == 0) return ffi::Error::Success();  // nothing to write

  args.out = out->untyped_data();
  args.lse = lse->untyped_data();
  args.softmax_scale = a.softmax_scale;
  args.softcap = a.softcap;
  KernelWindow(a, &args);
  return Launch(err, *variant, args, stream);
}

const Errors kErr("fa4_jax_fwd_v2");

ffi::Error StableInstantiate(float softmax_scale, bool causal, int32_t window_left,
                             int32_t window_right, float softcap, bool top_left) {
  return Instantiate(kErr, {softmax_scale, causal, window_left, window_right, softcap, top_left});
}

ffi::Error StableExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                         ffi::Buffer<ffi::S32> seq_used_k, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale, bool causal,
                         int32_t window_left, int32_t window_right, float softcap, bool top_left) {
  return Execute(kErr, {}, stream, device, q, k, v, seq_used_q, seq_used_k, out, lse,
                 {softmax_scale, causal, window_left, window_right, softcap, top_left});
}

const Errors kSegmentsErr("fa4_jax_fwd_segments_v1");

ffi::Error SegmentsInstantiate(float softmax_scale, bool causal, int32_t window_left,
                               int32_t window_right, float softcap, bool top_left) {
  return Instantiate(kSegmentsErr, {softmax_scale, causal, window_left, window_right, softcap, top_left},
                     /*segments=*/true);
}

ffi::Error SegmentsExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                           ffi::Buffer<ffi::S32> seq_used_k, ffi::Buffer<ffi::S32> q_segment_ids,
                           ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> row_spans,
                           ffi::Buffer<ffi::S32> key_spans, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale, bool causal,
                           int32_t window_left, int32_t window_right, float softcap, bool top_left) {
  const SegmentBuffers segments{q_segment_ids, kv_segment_ids, row_spans, key_spans};
  return Execute(kSegmentsErr, {}, stream, device, q, k, v, seq_used_q, seq_used_k, out, lse,
                 {softmax_scale, causal, window_left, window_right, softcap, top_left}, &segments);
}

const Errors kMaskedErr("fa4_jax_fwd_masked_v1");

ffi::Error MaskedInstantiate(float softmax_scale, bool causal, int32_t window_left,
                             int32_t window_right, float softcap, bool top_left) {
  return Instantiate(kMaskedErr, {softmax_scale, causal, window_left, window_right, softcap, top_left},
                     /*segments=*/true, /*mask_array=*/true);
}

ffi::Error MaskedExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                         ffi::Buffer<ffi::S32> seq_used_k, ffi::Buffer<ffi::S32> q_segment_ids,
                         ffi::Buffer<ffi::S32> kv_segment_ids, ffi::Buffer<ffi::S32> row_spans,
                         ffi::Buffer<ffi::S32> key_spans, ffi::Buffer<ffi::S32> mask_bits,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                         float softmax_scale, bool causal, int32_t window_left,
                         int32_t window_right, float softcap, bool top_left) {
  const SegmentBuffers segments{q_segment_ids, kv_segment_ids, row_spans, key_spans, &mask_bits};
  return Execute(kMaskedErr, {}, stream, device, q, k, v, seq_used_q, seq_used_k, out, lse,
                 {softmax_scale, causal, window_left, window_right, softcap, top_left}, &segments);
}

#ifdef FA4_JAX_TUNING_TARGETS
const Errors kDevErr("fa4_jax_dev_fwd_v2");

ffi::Error DevInstantiate(float softmax_scale, bool causal, int32_t window_left,
                          int32_t window_right, float softcap, bool top_left,
                          std::string_view tuning) {
  return Instantiate(kDevErr, {softmax_scale, causal, window_left, window_right, softcap, top_left});
}

ffi::Error DevExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                      ffi::Buffer<ffi::S32> seq_used_k, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale, bool causal,
                      int32_t window_left, int32_t window_right, float softcap, bool top_left,
                      std::string_view tuning) {
  return Execute(kDevErr, tuning, stream, device, q, k, v, seq_used_q, seq_used_k, out, lse,
                 {softmax_scale, causal, window_left, window_right, softcap, top_left});
}
#endif

template <typename Binding>
auto BindInputs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_used_q
      .template Arg<ffi::Buffer<ffi::S32>>();  // seq_used_k
}

template <typename Binding>
auto BindResults(Binding&& binding) {
  return BindAttrs(std::forward<Binding>(binding)
                       .template Ret<ffi::AnyBuffer>()            // out
                       .template Ret<ffi::Buffer<ffi::F32>>());   // lse
}

template <typename Binding>
auto BindExecute(Binding&& binding) {
  return BindResults(BindInputs(std::forward<Binding>(binding)));
}

template <typename Binding>
auto BindSegmentsExecute(Binding&& binding) {
  return BindResults(BindSegments(BindInputs(std::forward<Binding>(binding))));
}

template <typename Binding>
auto BindMaskedExecute(Binding&& binding) {
  return BindResults(BindMasked(BindInputs(std::forward<Binding>(binding))));
}

}  // namespace
}  // namespace fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdInstantiate, fa4::StableInstantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdExecute, fa4::StableExecute,
                              fa4::BindExecute(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdSegmentsInstantiate, fa4::SegmentsInstantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdSegmentsExecute, fa4::SegmentsExecute,
                              fa4::BindSegmentsExecute(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdMaskedInstantiate, fa4::MaskedInstantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdMaskedExecute, fa4::MaskedExecute,
                              fa4::BindMaskedExecute(xla::ffi::Ffi::Bind()));
#ifdef FA4_JAX_TUNING_TARGETS
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4DevFwdInstantiate, fa4::DevInstantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<std::string_view>("tuning"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4DevFwdExecute, fa4::DevExecute,
                              fa4::BindExecute(xla::ffi::Ffi::Bind())
                                  .Attr<std::string_view>("tuning"));
#endif
