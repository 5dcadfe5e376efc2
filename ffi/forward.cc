// The XLA FFI handler of FlashAttention's forward: one Instantiate/Execute pair, bound once per
// binding (common.h, FA4_DEFINE_HANDLERS); fa4_jax/abi/targets.py names the targets each binds.
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]   (bf16 or f16, all the same),
//           seq_used_q s32 [b], seq_used_k s32 [b]: each batch entry's valid query rows and keys
//           of a ragged batch (rows past seq_used_q get out 0, lse -inf); both [0] for a dense
//           batch, whose lengths are the buffers' (the kernels then read none);
//           then the optional operands (common.h): none, the segment ids and their span tables
//           (the segments variants run), or those and a boolean mask's bits (the mask_array
//           variants run)
//   results out [b, sq, h, dv] (q's dtype), lse [b, h, sq] (f32)
//   attrs   softmax_scale f32, causal bool, window_left/window_right i32 (-1 = unbounded),
//           softcap f32 (0 = none), top_left bool; optional_operands i32 (0, 4 or 5) on the
//           current target, whose instantiate stage must know it; in the development library, a
//           `tuning` string naming the variant
//
// The attributes describe the problem; the variant is the routing rule's choice for the call's
// shapes (common.h, Choose), so a serialized program runs whatever the installed library tunes.
// The handler is not declared command-buffer compatible: nothing tests it under graph capture yet.
#include <utility>

#include "common.h"

namespace fa4 {
namespace {

const Errors kErr("fa4_jax forward");

template <int32_t kBinding>
ffi::Error InstantiateAs(ffi::Dictionary attrs) {
  return Instantiate(kErr, Fa4Kind::kFwd, kBinding, attrs);
}

template <int32_t kBinding>
ffi::Error ExecuteAs(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, ffi::Buffer<ffi::S32> seq_used_q,
                     ffi::Buffer<ffi::S32> seq_used_k, ffi::RemainingArgs optional,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                     ffi::Dictionary attrs) {
  Attrs a;
  if (ffi::Error e = ReadAttrs(kErr, Fa4Kind::kFwd, kBinding, attrs, &a); e.failure()) return e;
  Fa4Args args;
  Fa4Dtype dtype;
  if (ffi::Error e = CheckQkv(kErr, q, k, v, &dtype, &args); e.failure()) return e;
  if (ffi::Error e = CheckSeqUsed(kErr, seq_used_q, seq_used_k, &args); e.failure()) return e;
  if (ffi::Error e = CheckOptionalOperands(kErr, optional, a, &args); e.failure()) return e;
  if (out->element_type() != q.element_type()) return kErr.Invalid("out must have q's dtype");
  const int64_t b = args.b, sq = args.seqlen_q, h = args.heads, d = q.dimensions()[3],
                dv = v.dimensions()[3];
  if (ffi::Error e = ExpectShape(kErr, "out", out->dimensions(), {b, sq, h, dv}); e.failure())
    return e;
  if (ffi::Error e = ExpectShape(kErr, "lse", lse->dimensions(), {b, h, sq}); e.failure())
    return e;
  Problem p{Fa4Kind::kFwd, "", dtype, d, dv, SelectMask(a), a.softcap > 0.0f, sq, args.seqlen_k,
            args.b_lengths > 0, a.top_left, a.optional_operands >= kSegmentOperands,
            a.optional_operands == kMaskOperands};
  if (ffi::Error e = DeviceArch(kErr, device, &p.arch); e.failure()) return e;
  const Fa4Variant* variant;
  if (ffi::Error e = FindLoaded(kErr, p, a.tuning, &variant); e.failure()) return e;
  if (b == 0 || sq == 0 || h == 0) return ffi::Error::Success();  // nothing to write

  args.out = out->untyped_data();
  args.lse = lse->untyped_data();
  args.softmax_scale = a.softmax_scale;
  args.softcap = a.softcap;
  KernelWindow(a, &args);
  return Launch(kErr, *variant, args, stream);
}

template <typename Binding>
auto BindExecute(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_used_q
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_used_k
      .RemainingArgs()                         // the optional operands
      .template Ret<ffi::AnyBuffer>()          // out
      .template Ret<ffi::Buffer<ffi::F32>>()   // lse
      .Attrs();
}

}  // namespace
}  // namespace fa4

// The current targets' pair, then one for each count an earlier release's target fixed.
FA4_DEFINE_HANDLERS(Fa4Fwd, fa4::kNamedByCall);
FA4_DEFINE_HANDLERS(Fa4FwdLengths, 0);
FA4_DEFINE_HANDLERS(Fa4FwdSegments, fa4::kSegmentOperands);
FA4_DEFINE_HANDLERS(Fa4FwdMasked, fa4::kMaskOperands);
