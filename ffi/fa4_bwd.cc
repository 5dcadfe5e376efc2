// XLA FFI handler for the custom call target `fa4_bwd_v1`: FlashAttention backward.
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv], out [b, sq, h, dv],
//           d_out [b, sq, h, dv] (one dtype, bf16 or f16), lse [b, h, sq] f32, d_lse [b, h, sq]
//           f32 or [0, h, sq] (lse not differentiated: the preprocess reads no d_lse),
//           seq_used_q s32 [b], seq_used_k s32 [b] (as for fa4_fwd_v1: rows past seq_used_q get
//           dq 0, keys past seq_used_k get dk = dv = 0; both [0] for a dense batch)
//   results dq [b, sq, h, d], dk [b, sk, hk, d], dv [b, sk, hk, dv] (q's dtype), then the
//           workspaces (fa4_jax/aot/compile.py): dq_accum f32 [copies, b, h, sq_pad, d],
//           dpsum f32 [b, h, sq_pad], lse_log2 f32 [b, h, sq_pad],
//           semaphore s32 [copies, b, h, m_blocks]; copies (dQ accumulators per query block,
//           1 or 2) is the caller's choice, read off dq_accum
//   attrs   those of fa4_fwd_v1, and deterministic bool
//
// The workspaces are results so that XLA owns all memory: nothing is allocated here, and
// nothing is launched but the variant's kernels, which own the workspaces (the preprocess zeroes
// dq_accum unless the deterministic adds store their first turn instead, and the semaphores in
// deterministic mode). The kernels also get the device's SM count (deterministic mode's order
// depends on it).
#include <cstring>
#include <string>
#include <string_view>

#include "common.h"

namespace fa4 {
namespace {

const Errors kErr("fa4_bwd_v1");

ffi::Error Instantiate(float softmax_scale, bool causal, int32_t window_left,
                       int32_t window_right, float softcap, std::string_view tuning,
                       bool deterministic) {
  return LoadCandidates(kErr, Fa4Kind::kBwd,
                        {softmax_scale, causal, window_left, window_right, softcap, tuning});
}

ffi::Error Zero(cudaStream_t stream, void* data, size_t bytes) {
  if (bytes == 0) return ffi::Error::Success();
  if (cudaError_t e = cudaMemsetAsync(data, 0, bytes, stream); e != cudaSuccess)
    return kErr.Cuda(e);
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer d_out,
                   ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_lse,
                   ffi::Buffer<ffi::S32> seq_used_q, ffi::Buffer<ffi::S32> seq_used_k,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                   ffi::Result<ffi::Buffer<ffi::F32>> dpsum,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                   ffi::Result<ffi::Buffer<ffi::S32>> semaphore, float softmax_scale,
                   bool causal, int32_t window_left, int32_t window_right, float softcap,
                   std::string_view tuning, bool deterministic) {
  const Attrs a{softmax_scale, causal, window_left, window_right, softcap, tuning};
  if (ffi::Error e = CheckAttrs(kErr, a); e.failure()) return e;
  Fa4Args args;
  Fa4Dtype dtype;
  if (ffi::Error e = CheckQkv(kErr, q, k, v, &dtype, &args); e.failure()) return e;
  if (ffi::Error e = CheckSeqUsed(kErr, seq_used_q, seq_used_k, &args); e.failure()) return e;
  for (const ffi::DataType t : {out.element_type(), d_out.element_type(), dq->element_type(),
                                dk->element_type(), dv->element_type()})
    if (t != q.element_type())
      return kErr.Invalid("out, d_out, dq, dk and dv must have q's dtype");
  const int64_t b = args.b, sq = args.seqlen_q, sk = args.seqlen_k, h = args.heads,
                hk = args.heads_k, d = q.dimensions()[3], head_dim_v = v.dimensions()[3];
  const int64_t sq_pad = (sq + kFa4BwdSeqPad - 1) / kFa4BwdSeqPad * kFa4BwdSeqPad;
  const int64_t m_blocks = sq_pad / kFa4BwdSemaphoreRows;
  const int64_t copies = dq_accum->dimensions().size() == 5 ? dq_accum->dimensions()[0] : 0;
  if (copies < 1 || copies > kFa4BwdMaxDqCopies)
    return kErr.Invalid("dq_accum must be [copies, b, h, sq_pad, d] with 1 <= copies <= " +
                        std::to_string(kFa4BwdMaxDqCopies));
  // d_lse is [b, h, sq], or empty when the caller does not differentiate through lse.
  const int64_t d_lse_batch =
      d_lse.dimensions().size() == 3 && d_lse.dimensions()[0] == 0 ? 0 : b;
  struct Expected {
    const char* name;
    ffi::Span<const int64_t> got;
    std::initializer_list<int64_t> want;
  };
  for (const Expected& x : {
           Expected{"out", out.dimensions(), {b, sq, h, head_dim_v}},
           Expected{"d_out", d_out.dimensions(), {b, sq, h, head_dim_v}},
           Expected{"lse", lse.dimensions(), {b, h, sq}},
           Expected{"d_lse", d_lse.dimensions(), {d_lse_batch, h, sq}},
           Expected{"dq", dq->dimensions(), {b, sq, h, d}},
           Expected{"dk", dk->dimensions(), {b, sk, hk, d}},
           Expected{"dv", dv->dimensions(), {b, sk, hk, head_dim_v}},
           Expected{"dq_accum", dq_accum->dimensions(), {copies, b, h, sq_pad, d}},
           Expected{"dpsum", dpsum->dimensions(), {b, h, sq_pad}},
           Expected{"lse_log2", lse_log2->dimensions(), {b, h, sq_pad}},
           Expected{"semaphore", semaphore->dimensions(), {copies, b, h, m_blocks}},
       })
    if (ffi::Error e = ExpectShape(kErr, x.name, x.got, x.want); e.failure()) return e;
  const Fa4Variant* variant;
  if (ffi::Error e = FindLoaded(kErr, Fa4Kind::kBwd, device, dtype, d, head_dim_v, a, &variant);
      e.failure())
    return e;
  if (b == 0 || h == 0) return ffi::Error::Success();  // nothing to write
  if (sq == 0 || sk == 0) {  // no score exists: every gradient is zero
    for (const auto& [data, bytes] : {std::pair{dq->untyped_data(), dq->size_bytes()},
                                      std::pair{dk->untyped_data(), dk->size_bytes()},
                                      std::pair{dv->untyped_data(), dv->size_bytes()}})
      if (ffi::Error e = Zero(stream, data, bytes); e.failure()) return e;
    return ffi::Error::Success();
  }

  args.out = out.untyped_data();
  args.d_out = d_out.untyped_data();
  args.lse = lse.untyped_data();
  args.d_lse = d_lse.untyped_data();
  args.b_dlse = static_cast<int32_t>(d_lse_batch);
  args.dq = dq->untyped_data();
  args.dk = dk->untyped_data();
  args.dv = dv->untyped_data();
  args.dq_accum = dq_accum->untyped_data();
  args.dpsum = dpsum->untyped_data();
  args.lse_log2 = lse_log2->untyped_data();
  args.semaphore = semaphore->untyped_data();
  args.seqlen_q_pad = static_cast<int32_t>(sq_pad);
  args.semaphore_blocks = static_cast<int32_t>(m_blocks);
  args.dq_copies = static_cast<int32_t>(copies);
  args.softmax_scale = softmax_scale;
  args.softcap = softcap;
  args.deterministic = deterministic ? 1 : 0;
  // The deterministic order rotates a chain of key blocks only if the whole chain runs at once
  // (one CTA per SM); the count is this device's, or its MIG slice's.
  if (cudaError_t e = cudaDeviceGetAttribute(&args.num_sms, cudaDevAttrMultiProcessorCount, device);
      e != cudaSuccess)
    return kErr.Cuda(e);
  KernelWindow(a, &args);
  return Launch(kErr, *variant, args, stream);
}

}  // namespace
}  // namespace fa4

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4BwdInstantiate, fa4::Instantiate,
                              fa4::BindAttrs(xla::ffi::Ffi::BindInstantiate())
                                  .Attr<bool>("deterministic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4BwdExecute, fa4::Execute,
                              fa4::BindAttrs(xla::ffi::Ffi::Bind()
                                                 .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                                 .Ctx<xla::ffi::DeviceOrdinal>()
                                                 .Arg<xla::ffi::AnyBuffer>()  // q
                                                 .Arg<xla::ffi::AnyBuffer>()  // k
                                                 .Arg<xla::ffi::AnyBuffer>()  // v
                                                 .Arg<xla::ffi::AnyBuffer>()  // out
                                                 .Arg<xla::ffi::AnyBuffer>()  // d_out
                                                 .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // lse
                                                 .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // d_lse
                                                 .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_used_q
                                                 .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // seq_used_k
                                                 .Ret<xla::ffi::AnyBuffer>()  // dq
                                                 .Ret<xla::ffi::AnyBuffer>()  // dk
                                                 .Ret<xla::ffi::AnyBuffer>()  // dv
                                                 .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dq_accum
                                                 .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dpsum
                                                 .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // lse_log2
                                                 .Ret<xla::ffi::Buffer<xla::ffi::S32>>())  // semaphore
                                  .Attr<bool>("deterministic"));
