// XLA FFI handler for the custom call target `fa4_fwd_v1`: FlashAttention forward.
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]   (bf16 or f16, all the same),
//           seq_used_q s32 [b], seq_used_k s32 [b]: each batch entry's valid query rows and keys
//           of a ragged batch (rows past seq_used_q get out 0, lse -inf); both [0] for a dense
//           batch, whose lengths are the buffers' (the kernels then read none)
//   results out [b, sq, h, dv] (q's dtype), lse [b, h, sq] (f32)
//   attrs   softmax_scale f32, causal bool, window_left/window_right i32 (-1 = unbounded),
//           softcap f32 (0 = none), tuning string ("default")
//
// The variant is chosen with the rule of fa4_jax/aot/variants.py (`select`); keep them in step.
// Modules load in the instantiate stage, outside the execute path, because XLA may capture
// execute into a CUDA graph, where loading a module is illegal. The handler is not declared
// command-buffer compatible: nothing tests it under graph capture yet.
#include <string_view>

#include "common.h"

namespace fa4 {
namespace {

const Errors kErr("fa4_fwd_v1");

ffi::Error Instantiate(float softmax_scale, bool causal, int32_t window_left,
                       int32_t window_right, float softcap, std::string_view tuning) {
  return LoadCandidates(kErr, Fa4Kind::kFwd,
                        {softmax_scale, causal, window_left, window_right, softcap, tuning});
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                   ffi::Buffer<ffi::S32> seq_used_k, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale, bool causal,
                   int32_t window_left, int32_t window_right, float softcap,
                   std::string_view tuning) {
  const Attrs a{softmax_scale, causal, window_left, window_right, softcap, tuning};
  if (ffi::Error e = CheckAttrs(kErr, a); e.failure()) return e;
  Fa4Args args;
  Fa4Dtype dtype;
  if (ffi::Error e = CheckQkv(kErr, q, k, v, &dtype, &args); e.failure()) return e;
  if (ffi::Error e = CheckSeqUsed(kErr, seq_used_q, seq_used_k, &args); e.failure()) return e;
  if (out->element_type() != q.element_type())
    return kErr.Invalid("out must have q's dtype");
  const int64_t b = args.b, sq = args.seqlen_q, h = args.heads, d = q.dimensions()[3],
                dv = v.dimensions()[3];
  if (ffi::Error e = ExpectShape(kErr, "out", out->dimensions(), {b, sq, h, dv}); e.failure())
    return e;
  if (ffi::Error e = ExpectShape(kErr, "lse", lse->dimensions(), {b, h, sq}); e.failure())
    return e;
  const Fa4Variant* variant;
  if (ffi::Error e = FindLoaded(kErr, Fa4Kind::kFwd, device, dtype, d, dv, a, &variant);
      e.failure())
    return e;
  if (b == 0 || sq == 0 || h == 0) return ffi::Error::Success();  // nothing to write

  args.out = out->untyped_data();
  args.lse = lse->untyped_data();
  args.softmax_scale = softmax_scale;
  args.softcap = softcap;
  KernelWindow(a, &args);
  return Launch(kErr, *variant, args, stream);
}

}  // namespace
}  // namespace fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdInstantiate, fa4::Instantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdExecute, fa4::Execute,
                              fa4::BindAttrs(xla::ffi::Ffi::Bind()
                                                 .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                 .Ctx<xla::ffi::DeviceOrdinal>()
                                                 .Arg<xla::ffi::AnyBuffer>()  // q
                                                 .Arg<xla::ffi::AnyBuffer>()  // k
                                                 .Arg<xla::ffi::AnyBuffer>()  // v
                                                 .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_used_q
                                                 .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_used_k
                                                 .Ret<xla::ffi::AnyBuffer>()  // out
                                                 .Ret<xla::ffi::Buffer<xla::ffi::F32>>()));  // lse
