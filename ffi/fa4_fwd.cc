// XLA FFI handler for the custom call target `fa4_fwd_v1`: FlashAttention forward.
//
//   inputs  q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]   (bf16 or f16, all the same)
//   results out [b, sq, h, dv] (q's dtype), lse [b, h, sq] (f32)
//   attrs   softmax_scale f32, causal bool, window_left/window_right i32 (-1 = unbounded),
//           softcap f32 (0 = none)
//
// The variant is chosen with the rule of fa4_jax/aot/variants.py (`select`); keep them in step.
// Modules load in the instantiate stage, outside the execute path, because XLA may capture
// execute into a CUDA graph, where loading a module is illegal. The handler is not declared
// command-buffer compatible: nothing tests it under graph capture yet.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include <cuda_runtime.h>

#include "dispatch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr const char* kTarget = "fa4_fwd_v1";

struct Attrs {
  float softmax_scale;
  bool causal;
  int32_t window_left, window_right;
  float softcap;
};

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + msg);
}

// Mirrors variants.mask_kind: a window bound on either side makes the call "local".
const char* SelectMask(const Attrs& a) {
  if (a.window_left >= 0 || a.window_right >= 0) return "local";
  return a.causal ? "causal" : "none";
}

// Helpers return ffi::Error and write results through pointers: ErrorOr's converting
// constructors differ between jaxlib versions, and we build against the oldest we support.

ffi::Error CudaError(cudaError_t e) {
  return ffi::Error::Internal(std::string(kTarget) + ": " + cudaGetErrorString(e));
}

// "sm_90a" for an H100/H200: the arch the variants were compiled for.
ffi::Error DeviceArch(int ordinal, std::string* arch) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
  if (e != cudaSuccess) return CudaError(e);
  *arch = "sm_" + std::to_string(major) + std::to_string(minor) + (major >= 9 ? "a" : "");
  return ffi::Error::Success();
}

// Mirrors variants.Variant.name, to name a variant missing from the menu.
std::string VariantName(const std::string& arch, Fa4Dtype dtype, int64_t d, int64_t dv,
                        const std::string& mask, bool softcap) {
  std::string a = arch;
  a.erase(std::remove(a.begin(), a.end(), '_'), a.end());
  return "fwd_" + a + (dtype == Fa4Dtype::kBF16 ? "_bf16" : "_fp16") + "_d" + std::to_string(d) +
         "_dv" + std::to_string(dv) + (mask == "none" ? "" : "_" + mask) +
         (softcap ? "_softcap" : "");
}

const Fa4FwdVariant* Find(const std::string& arch, Fa4Dtype dtype, int64_t d, int64_t dv,
                          const char* mask, bool softcap) {
  for (int i = 0; i < kFa4FwdVariantCount; ++i) {
    const Fa4FwdVariant& v = kFa4FwdVariants[i];
    if (arch == v.arch && dtype == v.dtype && d == v.head_dim && dv == v.head_dim_v &&
        std::strcmp(mask, v.mask) == 0 && softcap == v.softcap)
      return &v;
  }
  return nullptr;
}

ffi::Error Load(const Fa4FwdVariant& v) {
  cudaError_t e = v.load();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string(kTarget) + ": loading " + v.name + " failed: " +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error CheckAttrs(const Attrs& a) {
  if (a.window_left < -1 || a.window_right < -1)
    return Invalid("window_left/window_right must be >= 0, or -1 for unbounded");
  if (!(a.softcap >= 0.0f)) return Invalid("softcap must be >= 0 (0 = none)");
  return ffi::Error::Success();
}

// The arch shared by every visible device, or "" when they differ. The instantiate stage has no
// device (XLA runs it when it builds the thunk), and Module_Load loads onto every visible device.
ffi::Error VisibleArch(std::string* common) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return CudaError(e);
  common->clear();
  for (int i = 0; i < count; ++i) {
    std::string arch;
    if (ffi::Error err = DeviceArch(i, &arch); err.failure()) return err;
    if (i > 0 && arch != *common) {
      common->clear();
      break;
    }
    *common = arch;
  }
  return ffi::Error::Success();
}

// Loads every variant this call site can select; its dtype and head dims are not known yet.
// Binding no arguments keeps this stage independent of whether XLA passes placeholder buffers.
ffi::Error Instantiate(float softmax_scale, bool causal, int32_t window_left,
                       int32_t window_right, float softcap) {
  Attrs a{softmax_scale, causal, window_left, window_right, softcap};
  if (ffi::Error err = CheckAttrs(a); err.failure()) return err;
  std::string arch;
  if (ffi::Error err = VisibleArch(&arch); err.failure()) return err;
  // Mixed archs: loading would fail on some device; execute then loads the one variant it needs.
  if (arch.empty()) return ffi::Error::Success();
  const char* mask = SelectMask(a);
  for (int i = 0; i < kFa4FwdVariantCount; ++i) {
    const Fa4FwdVariant& v = kFa4FwdVariants[i];
    if (arch == v.arch && std::strcmp(mask, v.mask) == 0 && (softcap > 0.0f) == v.softcap)
      if (ffi::Error err = Load(v); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error IoDtype(ffi::DataType t, Fa4Dtype* dtype) {
  switch (t) {
    case ffi::DataType::BF16: *dtype = Fa4Dtype::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *dtype = Fa4Dtype::kF16; return ffi::Error::Success();
    default: return Invalid("q must be bfloat16 or float16");
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error ExpectShape(const char* what, ffi::Span<const int64_t> got,
                       std::initializer_list<int64_t> want) {
  if (got.size() == want.size() && std::equal(want.begin(), want.end(), got.begin()))
    return ffi::Error::Success();
  std::string w = "[";
  for (int64_t x : want) w += (w.size() > 1 ? ", " : "") + std::to_string(x);
  return Invalid(std::string(what) + " has shape " + Shape(got) + ", expected " + w + "]");
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse, float softmax_scale, bool causal,
                   int32_t window_left, int32_t window_right, float softcap) {
  Attrs a{softmax_scale, causal, window_left, window_right, softcap};
  if (ffi::Error err = CheckAttrs(a); err.failure()) return err;
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return Invalid("q, k, v must have rank 4 [batch, seq, heads, head_dim]; got " + Shape(qd) +
                   ", " + Shape(kd) + ", " + Shape(vd));
  Fa4Dtype dtype;
  if (ffi::Error err = IoDtype(q.element_type(), &dtype); err.failure()) return err;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      out->element_type() != q.element_type())
    return Invalid("q, k, v and out must have the same dtype");
  const int64_t b = qd[0], sq = qd[1], h = qd[2], d = qd[3], sk = kd[1], hk = kd[2], dv = vd[3];
  if (ffi::Error e = ExpectShape("k", kd, {b, sk, hk, d}); e.failure()) return e;
  if (ffi::Error e = ExpectShape("v", vd, {b, sk, hk, dv}); e.failure()) return e;
  if (ffi::Error e = ExpectShape("out", out->dimensions(), {b, sq, h, dv}); e.failure()) return e;
  if (ffi::Error e = ExpectShape("lse", lse->dimensions(), {b, h, sq}); e.failure()) return e;
  if (hk == 0 || h % hk != 0)
    return Invalid("heads of q (" + std::to_string(h) + ") must be a multiple of heads of k/v (" +
                   std::to_string(hk) + ")");
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (b > kMax || sq > kMax || sk > kMax || h > kMax)
    return Invalid("batch, sequence lengths and heads must fit in int32");

  std::string arch;
  if (ffi::Error err = DeviceArch(device, &arch); err.failure()) return err;
  const char* mask = SelectMask(a);
  const bool has_softcap = softcap > 0.0f;
  const Fa4FwdVariant* variant = Find(arch, dtype, d, dv, mask, has_softcap);
  if (variant == nullptr)
    return Invalid("no compiled variant " + VariantName(arch, dtype, d, dv, mask, has_softcap) +
                   " (see fa4_jax/_lib/variants.json for the menu)");
  // A no-op after instantiate loaded it (always, unless the visible devices mix archs).
  if (ffi::Error err = Load(*variant); err.failure()) return err;
  if (b == 0 || sq == 0 || h == 0) return ffi::Error::Success();  // nothing to write

  // "local" kernels bound both sides; an unbounded side becomes max(sq, sk), which covers every
  // key while keeping the kernel's index arithmetic far from int32 overflow (so wider windows
  // are clamped to it too: the same keys are visible). Causal is a right bound of 0.
  int32_t wl = 0, wr = 0;
  if (std::strcmp(mask, "local") == 0) {
    const int32_t unbounded = static_cast<int32_t>(std::max(sq, sk));
    wl = window_left < 0 ? unbounded : std::min(window_left, unbounded);
    wr = causal ? 0 : (window_right < 0 ? unbounded : std::min(window_right, unbounded));
  }
  Fa4FwdArgs args{q.untyped_data(),     k.untyped_data(),        v.untyped_data(),
                  out->untyped_data(),  lse->untyped_data(),     static_cast<int32_t>(b),
                  static_cast<int32_t>(sq), static_cast<int32_t>(sk), static_cast<int32_t>(h),
                  static_cast<int32_t>(hk), softmax_scale,        softcap,
                  wl,                   wr};
  int32_t ret = variant->launch(args, stream);
  if (ret != 0)
    return ffi::Error::Internal(std::string(kTarget) + ": " + variant->name +
                                " launcher returned " + std::to_string(ret));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return ffi::Error::Internal(std::string(kTarget) + ": " + variant->name + ": " +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fa4FwdExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("softmax_scale")
                                  .Attr<bool>("causal")
                                  .Attr<int32_t>("window_left")
                                  .Attr<int32_t>("window_right")
                                  .Attr<float>("softcap"));
