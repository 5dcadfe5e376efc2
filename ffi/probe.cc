// The C API of the probe process (`python -m fa4_jax.runtime.probe`, fa4_jax/runtime/probe/): it runs variants
// on a GPU without JAX, through this library's own CUDA runtime (linked statically, its symbols
// hidden, so the process cannot reach it otherwise) and its variant table.
//
// Every function returns a cudaError_t value (0 = success), or one of the negative codes below;
// Fa4ProbeErrorName/String name them all. Loading (Fa4ProbeLoad) and running (Fa4ProbeLaunch,
// Fa4ProbeSynchronize) are separate calls, so the caller tells a module that does not load (the
// context is intact) from a kernel that faults (the context is lost).
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>

#include <cuda_runtime.h>

#include "dispatch.h"

namespace {

constexpr int kUnknownVariant = -1;  // no variant of that name in the library
constexpr int kLauncherFailed = -2;  // the exported launcher returned nonzero, CUDA reported nothing

const Fa4Variant* Named(const char* name) {
  for (int i = 0; i < kFa4VariantCount; ++i)
    if (std::strcmp(kFa4Variants[i].name, name) == 0) return &kFa4Variants[i];
  return nullptr;
}

std::string JsonString(const char* text) {
  std::string out = "\"";
  for (const char* c = text; *c; ++c) {
    if (*c == '"' || *c == '\\') out += '\\';
    if (static_cast<unsigned char>(*c) >= 0x20) out += *c;
  }
  return out + "\"";
}

// Fa4Args' field types, as the layout names them.
constexpr const char* Kind(void**) { return "pointer"; }
constexpr const char* Kind(int32_t*) { return "int32"; }
constexpr const char* Kind(float*) { return "float32"; }

}  // namespace

// Fa4Args' byte layout as JSON, {"size": N, "fields": [[name, offset, size, type], ...]} in
// declaration order: fa4_jax.runtime.probe.device checks its ctypes mirror against it on load.
FA4_EXPORT const char* Fa4ArgsLayout() {
  static const std::string layout = [] {
    std::string fields;
#define FA4_FIELD(f)                                                                          \
  fields += std::string(fields.empty() ? "" : ", ") + "[\"" #f "\", " +                      \
            std::to_string(offsetof(Fa4Args, f)) + ", " + std::to_string(sizeof(Fa4Args::f)) + \
            ", \"" + Kind(static_cast<decltype(Fa4Args::f)*>(nullptr)) + "\"]";
    FA4_FIELD(q) FA4_FIELD(k) FA4_FIELD(v) FA4_FIELD(out) FA4_FIELD(lse)
    FA4_FIELD(seq_used_q) FA4_FIELD(seq_used_k)
    FA4_FIELD(q_segment_ids) FA4_FIELD(kv_segment_ids) FA4_FIELD(row_spans) FA4_FIELD(key_spans)
    FA4_FIELD(mask_bits)
    FA4_FIELD(d_out) FA4_FIELD(d_lse) FA4_FIELD(dq) FA4_FIELD(dk) FA4_FIELD(dv)
    FA4_FIELD(dq_accum) FA4_FIELD(dpsum) FA4_FIELD(lse_log2) FA4_FIELD(semaphore)
    FA4_FIELD(b) FA4_FIELD(seqlen_q) FA4_FIELD(seqlen_k) FA4_FIELD(heads) FA4_FIELD(heads_k)
    FA4_FIELD(b_lengths) FA4_FIELD(b_segments) FA4_FIELD(q_chunks) FA4_FIELD(k_chunks)
    FA4_FIELD(b_mask) FA4_FIELD(k_words) FA4_FIELD(b_dlse)
    FA4_FIELD(seqlen_q_pad) FA4_FIELD(semaphore_blocks) FA4_FIELD(dq_copies)
    FA4_FIELD(softmax_scale) FA4_FIELD(softcap) FA4_FIELD(window_left) FA4_FIELD(window_right)
    FA4_FIELD(top_left) FA4_FIELD(deterministic) FA4_FIELD(num_sms)
#undef FA4_FIELD
    return "{\"size\": " + std::to_string(sizeof(Fa4Args)) + ", \"fields\": [" + fields + "]}";
  }();
  return layout.c_str();
}

// The CUDA version the installed driver supports (cudaDriverGetVersion, e.g. 12080), or -1.
// Creates no context.
FA4_EXPORT int Fa4CudaDriverVersion() {
  int version = 0;
  return cudaDriverGetVersion(&version) == cudaSuccess ? version : -1;
}

// Makes device `ordinal` current and creates its context; writes into `info` (a buffer of
// `info_size` bytes) a JSON object: name, major, minor (compute capability), sms, driver and
// runtime (CUDA versions), free_bytes and total_bytes (memory), pci_bus_id, compute_mode.
FA4_EXPORT int Fa4ProbeOpenDevice(int ordinal, char* info, int info_size) {
  if (cudaError_t e = cudaSetDevice(ordinal); e != cudaSuccess) return e;
  if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) return e;  // the context, now
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, ordinal); e != cudaSuccess) return e;
  int major = 0, minor = 0, sms = 0, mode = 0, driver = 0, runtime = 0;
  size_t free_bytes = 0, total_bytes = 0;
  char bus_id[32] = "";
  for (cudaError_t e : {cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal),
                        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal),
                        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal),
                        cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, ordinal),
                        cudaDriverGetVersion(&driver), cudaRuntimeGetVersion(&runtime),
                        cudaMemGetInfo(&free_bytes, &total_bytes),
                        cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal)})
    if (e != cudaSuccess) return e;
  const std::string json =
      "{\"name\": " + JsonString(prop.name) + ", \"major\": " + std::to_string(major) +
      ", \"minor\": " + std::to_string(minor) + ", \"sms\": " + std::to_string(sms) +
      ", \"driver\": " + std::to_string(driver) + ", \"runtime\": " + std::to_string(runtime) +
      ", \"free_bytes\": " + std::to_string(free_bytes) +
      ", \"total_bytes\": " + std::to_string(total_bytes) +
      ", \"pci_bus_id\": " + JsonString(bus_id) + ", \"compute_mode\": " + std::to_string(mode) + "}";
  std::snprintf(info, info_size, "%s", json.c_str());
  return cudaSuccess;
}

FA4_EXPORT int Fa4ProbeMalloc(size_t bytes, void** ptr) { return cudaMalloc(ptr, bytes); }

FA4_EXPORT int Fa4ProbeFree(void* ptr) { return cudaFree(ptr); }

FA4_EXPORT int Fa4ProbeCopyToDevice(void* device, const void* host, size_t bytes) {
  return cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice);
}

FA4_EXPORT int Fa4ProbeCopyToHost(void* host, const void* device, size_t bytes) {
  return cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost);
}

FA4_EXPORT int Fa4ProbeMemset(void* device, int byte, size_t bytes) {
  return cudaMemset(device, byte, bytes);
}

// Loads `variant`'s module (the table's load(): once per process, later calls return the first
// result).
FA4_EXPORT int Fa4ProbeLoad(const char* variant) {
  const Fa4Variant* v = Named(variant);
  return v == nullptr ? kUnknownVariant : v->load();
}

// Launches `variant` with `args` on `stream` (nullptr: the default stream), as the handlers do,
// without waiting for it. A launcher's own nonzero return is written to *launcher_code.
FA4_EXPORT int Fa4ProbeLaunch(const char* variant, const Fa4Args* args, void* stream,
                              int* launcher_code) {
  const Fa4Variant* v = Named(variant);
  if (v == nullptr) return kUnknownVariant;
  *launcher_code = v->launch(*args, static_cast<cudaStream_t>(stream));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return *launcher_code == 0 ? cudaSuccess : kLauncherFailed;
}

// Waits for everything launched; a kernel's fault surfaces here.
FA4_EXPORT int Fa4ProbeSynchronize() { return cudaDeviceSynchronize(); }

FA4_EXPORT const char* Fa4ProbeErrorName(int code) {
  if (code == kUnknownVariant) return "fa4UnknownVariant";
  if (code == kLauncherFailed) return "fa4LauncherFailed";
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

FA4_EXPORT const char* Fa4ProbeErrorString(int code) {
  if (code == kUnknownVariant) return "the library has no variant of that name";
  if (code == kLauncherFailed) return "the variant's launcher failed without a CUDA error";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
