#include "common.h"

#include "gate.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace fa4 {

ffi::Error Errors::Invalid(const std::string& msg) const {
  return ffi::Error::InvalidArgument(std::string(handler_) + ": " + msg);
}

ffi::Error Errors::Internal(const std::string& msg) const {
  return ffi::Error::Internal(std::string(handler_) + ": " + msg);
}

ffi::Error Errors::Refused(const std::string& msg) const {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string(handler_) + ": " + msg);
}

ffi::Error Errors::Cuda(cudaError_t e) const { return Internal(cudaGetErrorString(e)); }

// Helpers return ffi::Error and write results through pointers: ErrorOr's converting
// constructors differ between jaxlib versions, and we build against the oldest we support.

namespace {

#ifdef FA4_JAX_TUNING_TARGETS
constexpr bool kTakesTuning = true;
#else
constexpr bool kTakesTuning = false;
#endif

// Whether a handler of `kind` under `binding` reads the attribute `name`.
bool Reads(Fa4Kind kind, int32_t binding, std::string_view name) {
  for (const char* problem :
       {"softmax_scale", "causal", "window_left", "window_right", "softcap", "top_left"})
    if (name == problem) return true;
  return (name == "deterministic" && kind == Fa4Kind::kBwd) ||
         (name == "optional_operands" && binding == kNamedByCall) ||
         (name == "tuning" && kTakesTuning);
}

template <typename T>
ffi::Error Read(const Errors& err, const ffi::Dictionary& dict, const char* name, T* value) {
  if (!dict.contains(name)) return err.Invalid(std::string("missing attribute ") + name);
  ffi::ErrorOr<T> read = dict.get<T>(name);
  if (!read.has_value())
    return err.Invalid(std::string("attribute ") + name + ": " + read.error().message());
  *value = *read;
  return ffi::Error::Success();
}

ffi::Error CheckAttrs(const Errors& err, const Attrs& a) {
  if (a.window_left < -1 || a.window_right < -1)
    return err.Invalid("window_left/window_right must be >= 0, or -1 for unbounded");
  if (!(a.softcap >= 0.0f)) return err.Invalid("softcap must be >= 0 (0 = none)");
  if (a.optional_operands != 0 && a.optional_operands != kSegmentOperands &&
      a.optional_operands != kMaskOperands)
    return err.Invalid("optional_operands must be 0, " + std::to_string(kSegmentOperands) +
                       " (segment ids and span tables) or " + std::to_string(kMaskOperands) +
                       " (and mask bits); got " + std::to_string(a.optional_operands));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error ReadAttrs(const Errors& err, Fa4Kind kind, int32_t binding, const ffi::Dictionary& dict,
                     Attrs* a) {
  for (std::string_view name : dict)
    if (!Reads(kind, binding, name))
      return err.Invalid(
          "unexpected attribute " + std::string(name) +
          (name == "tuning" ? " (a development library's: this one routes calls itself)" : ""));
  *a = Attrs{};
  a->optional_operands = binding;
  for (ffi::Error e : {Read(err, dict, "softmax_scale", &a->softmax_scale),
                       Read(err, dict, "causal", &a->causal),
                       Read(err, dict, "window_left", &a->window_left),
                       Read(err, dict, "window_right", &a->window_right),
                       Read(err, dict, "softcap", &a->softcap),
                       Read(err, dict, "top_left", &a->top_left),
                       kind == Fa4Kind::kBwd ? Read(err, dict, "deterministic", &a->deterministic)
                                             : ffi::Error::Success(),
                       binding == kNamedByCall
                           ? Read(err, dict, "optional_operands", &a->optional_operands)
                           : ffi::Error::Success(),
                       dict.contains("tuning") ? Read(err, dict, "tuning", &a->tuning)
                                               : ffi::Error::Success()})
    if (e.failure()) return e;
  return CheckAttrs(err, *a);
}

const char* SelectMask(const Attrs& a) {
  if (a.window_left >= 0 || a.window_right >= 0) return "local";
  return a.causal ? "causal" : "none";
}

ffi::Error DeviceArch(const Errors& err, int ordinal, std::string* arch) {
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
  if (e != cudaSuccess) return err.Cuda(e);
  // fa4_jax.abi.routing.arch_name's rule: Blackwell's 10.x (B200, B300) share the sm_100f family's
  // cubins; other archs name their arch-specific target.
  *arch = major == 10 ? std::string("sm_100f")
                      : "sm_" + std::to_string(major) + std::to_string(minor) + (major >= 9 ? "a" : "");
  return ffi::Error::Success();
}

namespace {

// The arch shared by every visible device, or "" when they differ. The instantiate stage has no
// device (XLA runs it when it builds the thunk), and Module_Load loads onto every visible device.
ffi::Error VisibleArch(const Errors& err, std::string* common) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return err.Cuda(e);
  common->clear();
  for (int i = 0; i < count; ++i) {
    std::string arch;
    if (ffi::Error failed = DeviceArch(err, i, &arch); failed.failure()) return failed;
    if (i > 0 && arch != *common) {
      common->clear();
      break;
    }
    *common = arch;
  }
  return ffi::Error::Success();
}

// The variant of p's problem class and this tuning, if compiled.
const Fa4Variant* Lookup(const Problem& p, std::string_view tuning) {
  for (int i = 0; i < kFa4VariantCount; ++i) {
    const Fa4Variant& v = kFa4Variants[i];
    if (v.kind == p.kind && p.arch == v.arch && v.dtype == p.dtype && v.head_dim == p.head_dim &&
        v.head_dim_v == p.head_dim_v && std::strcmp(v.mask, p.mask) == 0 &&
        v.softcap == p.softcap && tuning == v.tuning && v.segments == p.segments &&
        v.mask_array == p.mask_array)
      return &v;
  }
  return nullptr;
}

// fa4_jax.abi.routing.Route.fits.
bool Fits(const Fa4Route& r, const Problem& p) {
  if (r.kind != p.kind || p.arch != r.arch || std::strcmp(r.mask, p.mask) != 0 ||
      r.head_dim != p.head_dim)
    return false;
  if (r.softcap >= 0 && (r.softcap == 1) != p.softcap) return false;
  if (r.mask_array != p.mask_array) return false;
  if (r.min_rows && p.seqlen_q < r.min_rows) return false;
  if (r.max_rows && p.seqlen_q > r.max_rows) return false;
  if (r.max_len && std::max(p.seqlen_q, p.seqlen_k) > r.max_len) return false;
  if (r.dense && p.ragged) return false;
  if (r.diagonal_block) {  // fa4_jax.abi.routing.diagonal_on_blocks
    const int64_t offset = p.top_left ? 0 : p.seqlen_k - p.seqlen_q, block = r.diagonal_block;
    if (offset % block != 0) return false;
    const int64_t q_blocks = (p.seqlen_q + block - 1) / block, k_blocks = (p.seqlen_k + block - 1) / block;
    if (q_blocks + offset / block > k_blocks) return false;
  }
  if (r.tail_tile_n) {
    const int64_t last_block_keys = p.seqlen_k - (p.seqlen_k - 1) / r.tail_tile_n * r.tail_tile_n;
    if (p.seqlen_k <= r.tail_tile_n || last_block_keys > r.tail_keys) return false;
  }
  return true;
}

ffi::Error Load(const Errors& err, const Fa4Variant& v) {
  cudaError_t e = v.load();
  if (e != cudaSuccess)
    return err.Internal(std::string("loading ") + v.name + " failed: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error LoadCandidates(const Errors& err, Fa4Kind kind, const Attrs& a) {
  std::string arch;
  if (ffi::Error failed = VisibleArch(err, &arch); failed.failure()) return failed;
  if (arch.empty()) return ffi::Error::Success();
  const char* mask = SelectMask(a);
  const bool softcap = a.softcap > 0.0f, segments = a.optional_operands >= kSegmentOperands,
             mask_array = a.optional_operands == kMaskOperands;
  for (int i = 0; i < kFa4VariantCount; ++i) {
    const Fa4Variant& v = kFa4Variants[i];
    if (v.kind == kind && arch == v.arch && std::strcmp(mask, v.mask) == 0 && v.softcap == softcap &&
        v.segments == segments && v.mask_array == mask_array && Refusal(v).empty())
      if (ffi::Error failed = Load(err, v); failed.failure()) return failed;
  }
  return ffi::Error::Success();
}

}  // namespace

const Fa4Variant* Choose(const Problem& p, std::string_view tuning) {
  if (!tuning.empty()) return Lookup(p, tuning);
  for (int i = 0; i < kFa4RouteCount; ++i)
    if (Fits(kFa4Routes[i], p))
      if (const Fa4Variant* v = Lookup(p, kFa4Routes[i].tuning)) return v;
  return Lookup(p, "default");
}

std::string VariantName(const Problem& p, std::string_view tuning) {
  std::string a = p.arch;
  a.erase(std::remove(a.begin(), a.end(), '_'), a.end());
  const std::string mask = p.mask;
  if (tuning.empty()) tuning = "default";
  return std::string(p.kind == Fa4Kind::kFwd ? "fwd_" : "bwd_") + a +
         (p.dtype == Fa4Dtype::kBF16 ? "_bf16" : "_fp16") + "_d" + std::to_string(p.head_dim) +
         "_dv" + std::to_string(p.head_dim_v) + (mask == "none" ? "" : "_" + mask) +
         (p.softcap ? "_softcap" : "") + (p.mask_array ? "_boolmask" : p.segments ? "_segments" : "") +
         (tuning == "default" ? "" : "_t" + std::string(tuning));
}

ffi::Error Instantiate(const Errors& err, Fa4Kind kind, int32_t binding,
                       const ffi::Dictionary& dict) {
  Attrs a;
  if (ffi::Error failed = ReadAttrs(err, kind, binding, dict, &a); failed.failure()) return failed;
  return LoadCandidates(err, kind, a);
}

ffi::Error FindLoaded(const Errors& err, const Problem& p, std::string_view tuning,
                      const Fa4Variant** variant) {
  *variant = Choose(p, tuning);
  if (*variant == nullptr)
    return err.Invalid("no compiled variant " + VariantName(p, tuning) +
                       " (see fa4_jax/_lib/manifest.json for the menu)");
  if (const std::string refusal = Refusal(**variant); !refusal.empty()) return err.Refused(refusal);
  // A no-op after instantiate loaded it: always, unless the visible devices mix archs or the
  // variant was verified after instantiate.
  return Load(err, **variant);
}

ffi::Error IoDtype(const Errors& err, ffi::DataType t, Fa4Dtype* dtype) {
  switch (t) {
    case ffi::DataType::BF16: *dtype = Fa4Dtype::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *dtype = Fa4Dtype::kF16; return ffi::Error::Success();
    default: return err.Invalid("q must be bfloat16 or float16");
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error ExpectShape(const Errors& err, const char* what, ffi::Span<const int64_t> got,
                       std::initializer_list<int64_t> want) {
  if (got.size() == want.size() && std::equal(want.begin(), want.end(), got.begin()))
    return ffi::Error::Success();
  std::string w = "[";
  for (int64_t x : want) w += (w.size() > 1 ? ", " : "") + std::to_string(x);
  return err.Invalid(std::string(what) + " has shape " + Shape(got) + ", expected " + w + "]");
}

ffi::Error CheckQkv(const Errors& err, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    Fa4Dtype* dtype, Fa4Args* args) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return err.Invalid("q, k, v must have rank 4 [batch, seq, heads, head_dim]; got " +
                       Shape(qd) + ", " + Shape(kd) + ", " + Shape(vd));
  if (ffi::Error failed = IoDtype(err, q.element_type(), dtype); failed.failure()) return failed;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return err.Invalid("q, k and v must have the same dtype");
  const int64_t b = qd[0], sq = qd[1], h = qd[2], d = qd[3], sk = kd[1], hk = kd[2], dv = vd[3];
  if (ffi::Error e = ExpectShape(err, "k", kd, {b, sk, hk, d}); e.failure()) return e;
  if (ffi::Error e = ExpectShape(err, "v", vd, {b, sk, hk, dv}); e.failure()) return e;
  if (hk == 0 || h % hk != 0)
    return err.Invalid("heads of q (" + std::to_string(h) +
                       ") must be a multiple of heads of k/v (" + std::to_string(hk) + ")");
  // Backward workspaces pad seqlen_q by up to kFa4BwdSeqPad rows; keep that in range too.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max() - 1024;
  if (b > kMax || sq > kMax || sk > kMax || h > kMax)
    return err.Invalid("batch, sequence lengths and heads must fit in int32");
  args->q = q.untyped_data();
  args->k = k.untyped_data();
  args->v = v.untyped_data();
  args->b = static_cast<int32_t>(b);
  args->seqlen_q = static_cast<int32_t>(sq);
  args->seqlen_k = static_cast<int32_t>(sk);
  args->heads = static_cast<int32_t>(h);
  args->heads_k = static_cast<int32_t>(hk);
  return ffi::Error::Success();
}

ffi::Error CheckSeqUsed(const Errors& err, ffi::Buffer<ffi::S32> seq_used_q,
                        ffi::Buffer<ffi::S32> seq_used_k, Fa4Args* args) {
  // Dense calls pass both empty; a length operand of any other size must hold all b entries.
  const bool dense = seq_used_q.element_count() == 0 && seq_used_k.element_count() == 0;
  const int64_t b = dense ? 0 : args->b;
  if (ffi::Error e = ExpectShape(err, "seq_used_q", seq_used_q.dimensions(), {b}); e.failure())
    return e;
  if (ffi::Error e = ExpectShape(err, "seq_used_k", seq_used_k.dimensions(), {b}); e.failure())
    return e;
  args->b_lengths = static_cast<int32_t>(b);
  args->seq_used_q = seq_used_q.untyped_data();
  args->seq_used_k = seq_used_k.untyped_data();
  return ffi::Error::Success();
}

ffi::Error CheckOptionalOperands(const Errors& err, const ffi::RemainingArgs& operands,
                                 const Attrs& a, Fa4Args* args) {
  const int64_t b = args->b, sq = args->seqlen_q, sk = args->seqlen_k, chunk = kFa4SpanChunk;
  const int64_t q_chunks = (sq + chunk - 1) / chunk, k_chunks = (sk + chunk - 1) / chunk,
                k_words = (sk + 31) / 32;
  struct Operand {
    const char* name;
    std::initializer_list<int64_t> want;
    void** data;
  };
  const Operand expected[kMaskOperands] = {
      {"q_segment_ids", {b, sq}, &args->q_segment_ids},
      {"kv_segment_ids", {b, sk}, &args->kv_segment_ids},
      {"row_spans", {b, q_chunks, 4}, &args->row_spans},
      {"key_spans", {b, k_chunks, 4}, &args->key_spans},
      {"mask_bits", {b, sq, k_words}, &args->mask_bits}};
  const int32_t count = a.optional_operands;
  if (operands.size() != static_cast<size_t>(count)) {
    std::string names;
    for (int32_t i = 0; i < count; ++i) names += (i ? ", " : "") + std::string(expected[i].name);
    return err.Invalid(std::to_string(operands.size()) +
                       " operands after seq_used_k, expected optional_operands = " +
                       std::to_string(count) + (count ? " (" + names + ")" : ""));
  }
  for (int32_t i = 0; i < count; ++i) {
    const Operand& o = expected[i];
    ffi::ErrorOr<ffi::AnyBuffer> buffer = operands.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return err.Invalid(std::string(o.name) + ": " + buffer.error().message());
    if (buffer->element_type() != ffi::DataType::S32)
      return err.Invalid(std::string(o.name) + " must be int32");
    if (ffi::Error e = ExpectShape(err, o.name, buffer->dimensions(), o.want); e.failure()) return e;
    *o.data = buffer->untyped_data();
  }
  if (count >= kSegmentOperands) {
    args->b_segments = static_cast<int32_t>(b);
    args->q_chunks = static_cast<int32_t>(q_chunks);
    args->k_chunks = static_cast<int32_t>(k_chunks);
  }
  if (count == kMaskOperands) {
    args->b_mask = static_cast<int32_t>(b);
    args->k_words = static_cast<int32_t>(k_words);
  }
  return ffi::Error::Success();
}

void KernelWindow(const Attrs& a, Fa4Args* args) {
  args->window_left = args->window_right = 0;
  args->top_left = a.top_left ? 1 : 0;
  if (std::strcmp(SelectMask(a), "local") != 0) return;
  const int32_t unbounded = std::max(args->seqlen_q, args->seqlen_k);
  args->window_left = a.window_left < 0 ? unbounded : std::min(a.window_left, unbounded);
  args->window_right =
      a.causal ? 0 : (a.window_right < 0 ? unbounded : std::min(a.window_right, unbounded));
}

ffi::Error Launch(const Errors& err, const Fa4Variant& variant, const Fa4Args& args,
                  cudaStream_t stream) {
  int32_t ret = variant.launch(args, stream);
  if (ret != 0)
    return err.Internal(std::string(variant.name) + " launcher returned " + std::to_string(ret));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return err.Internal(std::string(variant.name) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace fa4

// For tests and tools on any machine (no GPU needed): the name of the variant a call would run,
// or "" when none is compiled. kind 0 = fwd, 1 = bwd; dtype 0 = bf16, 1 = fp16.
FA4_EXPORT const char* Fa4ChooseVariant(
    int kind, const char* arch, int dtype, int head_dim, int head_dim_v, const char* mask,
    int softcap, int64_t seqlen_q, int64_t seqlen_k, int ragged, int top_left, int segments,
    int mask_array) {
  const fa4::Problem p{kind == 0 ? Fa4Kind::kFwd : Fa4Kind::kBwd,
                       arch,
                       dtype == 0 ? Fa4Dtype::kBF16 : Fa4Dtype::kF16,
                       head_dim,
                       head_dim_v,
                       mask,
                       softcap != 0,
                       seqlen_q,
                       seqlen_k,
                       ragged != 0,
                       top_left != 0,
                       segments != 0,
                       mask_array != 0};
  const Fa4Variant* v = fa4::Choose(p);
  return v == nullptr ? "" : v->name;
}
