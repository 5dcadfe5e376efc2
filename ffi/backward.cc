// The XLA FFI handler of FlashAttention's backward: one Instantiate/Execute pair, bound once per
// binding as the forward's is (forward.cc).
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv], out [b, sq, h, dv],
//           d_out [b, sq, h, dv] (one dtype, bf16 or f16), lse [b, h, sq] f32, d_lse [b, h, sq]
//           f32 or [0, h, sq] (lse not differentiated: the preprocess reads no d_lse),
//           seq_used_q s32 [b], seq_used_k s32 [b] (as for the forward: rows past seq_used_q
//           get dq 0, keys past seq_used_k get dk = dv = 0; both [0] for a dense batch), then the
//           forward's optional operands
//   results dq [b, sq, h, d], dk [b, sk, hk, d], dv [b, sk, hk, dv] (q's dtype), then the
//           workspaces (fa4_jax/aot/compile.py): dq_accum f32 [copies, b, h, sq_pad, d],
//           dpsum f32 [b, h, sq_pad], lse_log2 f32 [b, h, sq_pad],
//           semaphore s32 [copies, b, h, m_blocks]; copies (dQ accumulators per query block,
//           1 or 2) is the caller's choice, read off dq_accum
//   attrs   the forward's, and deterministic bool
//
// The workspaces are results so that XLA owns all memory: nothing is allocated here, and
// nothing is launched but the variant's kernels, which own the workspaces (the preprocess zeroes
// dq_accum unless the first adds store instead, and the semaphores). The kernels also get the
// device's SM count (deterministic mode's order depends on it).
#include <string>
#include <utility>

#include "common.h"

namespace fa4 {
namespace {

ffi::Error Zero(const Errors& err, cudaStream_t stream, void* data, size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  if (cudaError_t e = cudaMemsetAsync(data, 0, bytes, stream); e != cudaSuccess)
    return err.Cuda(e);
  return ffi::Error::Success();
}

struct Buffers {
  ffi::AnyBuffer q, k, v, out, d_out;
  ffi::Buffer<ffi::F32> lse, d_lse;
  ffi::Buffer<ffi::S32> seq_used_q, seq_used_k;
  ffi::Result<ffi::AnyBuffer> dq, dk, dv;
  ffi::Result<ffi::Buffer<ffi::F32>> dq_accum, dpsum, lse_log2;
  ffi::Result<ffi::Buffer<ffi::S32>> semaphore;
};

const Errors kErr("fa4_jax backward");

// x is not const: the oldest FFI headers the library builds against give Result only a non-const
// operator->.
ffi::Error Execute(cudaStream_t stream, int32_t device, Buffers& x,
                   const ffi::RemainingArgs& optional, const Attrs& a) {
  Fa4Args args;
  Fa4Dtype dtype;
  if (ffi::Error e = CheckQkv(kErr, x.q, x.k, x.v, &dtype, &args); e.failure()) return e;
  if (ffi::Error e = CheckSeqUsed(kErr, x.seq_used_q, x.seq_used_k, &args); e.failure()) return e;
  if (ffi::Error e = CheckOptionalOperands(kErr, optional, a, &args); e.failure()) return e;
  for (const ffi::DataType t : {x.out.element_type(), x.d_out.element_type(), x.dq->element_type(),
                                x.dk->element_type(), x.dv->element_type()})
    if (t != x.q.element_type())
      return kErr.Invalid("out, d_out, dq, dk and dv must have q's dtype");
  const int64_t b = args.b, sq = args.seqlen_q, sk = args.seqlen_k, h = args.heads,
                hk = args.heads_k, d = x.q.dimensions()[3], head_dim_v = x.v.dimensions()[3];
  const int64_t sq_pad = (sq + kFa4BwdSeqPad - 1) / kFa4BwdSeqPad * kFa4BwdSeqPad;
  const int64_t m_blocks = sq_pad / kFa4BwdSemaphoreRows;
  const int64_t copies = x.dq_accum->dimensions().size() == 5 ? x.dq_accum->dimensions()[0] : 0;
  if (copies < 1 || copies > kFa4BwdMaxDqCopies)
    return kErr.Invalid("dq_accum must be [copies, b, h, sq_pad, d] with 1 <= copies <= " +
                        std::to_string(kFa4BwdMaxDqCopies));
  // d_lse is [b, h, sq], or empty when the caller does not differentiate through lse.
  const int64_t d_lse_batch =
      x.d_lse.dimensions().size() == 3 && x.d_lse.dimensions()[0] == 0 ? 0 : b;
  struct Expected {
    const char* name;
    ffi::Span<const int64_t> got;
    std::initializer_list<int64_t> want;
  };
  for (const Expected& e : {
           Expected{"out", x.out.dimensions(), {b, sq, h, head_dim_v}},
           Expected{"d_out", x.d_out.dimensions(), {b, sq, h, head_dim_v}},
           Expected{"lse", x.lse.dimensions(), {b, h, sq}},
           Expected{"d_lse", x.d_lse.dimensions(), {d_lse_batch, h, sq}},
           Expected{"dq", x.dq->dimensions(), {b, sq, h, d}},
           Expected{"dk", x.dk->dimensions(), {b, sk, hk, d}},
           Expected{"dv", x.dv->dimensions(), {b, sk, hk, head_dim_v}},
           Expected{"dq_accum", x.dq_accum->dimensions(), {copies, b, h, sq_pad, d}},
           Expected{"dpsum", x.dpsum->dimensions(), {b, h, sq_pad}},
           Expected{"lse_log2", x.lse_log2->dimensions(), {b, h, sq_pad}},
           Expected{"semaphore", x.semaphore->dimensions(), {copies, b, h, m_blocks}},
       })
    if (ffi::Error failed = ExpectShape(kErr, e.name, e.got, e.want); failed.failure()) return failed;
  Problem p{Fa4Kind::kBwd, "", dtype, d, head_dim_v, SelectMask(a), a.softcap > 0.0f, sq, sk,
            args.b_lengths > 0, a.top_left, a.optional_operands >= kSegmentOperands,
            a.optional_operands == kMaskOperands};
  if (ffi::Error e = DeviceArch(kErr, device, &p.arch); e.failure()) return e;
  const Fa4Variant* variant;
  if (ffi::Error e = FindLoaded(kErr, p, a.tuning, &variant); e.failure()) return e;
  if (b == 0 || h == 0) return ffi::Error::Success();  // nothing to write
  if (sq == 0 || sk == 0) {  // no score exists: every gradient is zero
    for (const auto& [data, bytes] : {std::pair{x.dq->untyped_data(), x.dq->size_bytes()},
                                      std::pair{x.dk->untyped_data(), x.dk->size_bytes()},
                                      std::pair{x.dv->untyped_data(), x.dv->size_bytes()}})
      if (ffi::Error e = Zero(kErr, stream, data, bytes); e.failure()) return e;
    return ffi::Error::Success();
  }

  args.out = x.out.untyped_data();
  args.d_out = x.d_out.untyped_data();
  args.lse = x.lse.untyped_data();
  args.d_lse = x.d_lse.untyped_data();
  args.b_dlse = static_cast<int32_t>(d_lse_batch);
  args.dq = x.dq->untyped_data();
  args.dk = x.dk->untyped_data();
  args.dv = x.dv->untyped_data();
  args.dq_accum = x.dq_accum->untyped_data();
  args.dpsum = x.dpsum->untyped_data();
  args.lse_log2 = x.lse_log2->untyped_data();
  args.semaphore = x.semaphore->untyped_data();
  args.seqlen_q_pad = static_cast<int32_t>(sq_pad);
  args.semaphore_blocks = static_cast<int32_t>(m_blocks);
  args.dq_copies = static_cast<int32_t>(copies);
  args.softmax_scale = a.softmax_scale;
  args.softcap = a.softcap;
  args.deterministic = a.deterministic ? 1 : 0;
  // The deterministic order rotates a chain of key blocks only if the whole chain runs at once
  // (one CTA per SM); the count is this device's, or its MIG slice's.
  if (cudaError_t e = cudaDeviceGetAttribute(&args.num_sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return kErr.Cuda(e);
  KernelWindow(a, &args);
  return Launch(kErr, *variant, args, stream);
}

template <int32_t kBinding>
ffi::Error InstantiateAs(ffi::Dictionary attrs) {
  return Instantiate(kErr, Fa4Kind::kBwd, kBinding, attrs);
}

template <int32_t kBinding>
ffi::Error ExecuteAs(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                     ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer d_out,
                     ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_lse,
                     ffi::Buffer<ffi::S32> seq_used_q, ffi::Buffer<ffi::S32> seq_used_k,
                     ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> dq,
                     ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                     ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                     ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                     ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                     ffi::Result<ffi::Buffer<ffi::S32>> semaphore, ffi::Dictionary attrs) {
  Attrs a;
  if (ffi::Error e = ReadAttrs(kErr, Fa4Kind::kBwd, kBinding, attrs, &a); e.failure()) return e;
  Buffers x{q, k, v, out, d_out, lse, d_lse, seq_used_q, seq_used_k,
            dq, dk, dv, dq_accum, dpsum, lse_log2, semaphore};
  return Execute(stream, device, x, optional, a);
}

template <typename Binding>
auto BindExecute(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()          // q
      .template Arg<ffi::AnyBuffer>()          // k
      .template Arg<ffi::AnyBuffer>()          // v
      .template Arg<ffi::AnyBuffer>()          // out
      .template Arg<ffi::AnyBuffer>()          // d_out
      .template Arg<ffi::Buffer<ffi::F32>>()   // lse
      .template Arg<ffi::Buffer<ffi::F32>>()   // d_lse
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_used_q
      .template Arg<ffi::Buffer<ffi::S32>>()   // seq_used_k
      .RemainingArgs()                         // the optional operands
      .template Ret<ffi::AnyBuffer>()          // dq
      .template Ret<ffi::AnyBuffer>()          // dk
      .template Ret<ffi::AnyBuffer>()          // dv
      .template Ret<ffi::Buffer<ffi::F32>>()   // dq_accum
      .template Ret<ffi::Buffer<ffi::F32>>()   // dpsum
      .template Ret<ffi::Buffer<ffi::F32>>()   // lse_log2
      .template Ret<ffi::Buffer<ffi::S32>>()   // semaphore
      .Attrs();
}

}  // namespace
}  // namespace fa4

// The current targets' pair, then one for each count an earlier release's target fixed.
FA4_DEFINE_HANDLERS(Fa4Bwd, fa4::kNamedByCall);
FA4_DEFINE_HANDLERS(Fa4BwdLengths, 0);
FA4_DEFINE_HANDLERS(Fa4BwdSegments, fa4::kSegmentOperands);
FA4_DEFINE_HANDLERS(Fa4BwdMasked, fa4::kMaskOperands);
