// scripts/launch_config.py's harness: the exported launchers linked against these stand-ins for
// the DSL runtime's entry points (libcuda_dialect_runtime_static.a, where each is a jump to the
// CUDA runtime function of the same name without the underscore) instead of the runtime, so
// that no driver is needed. Each call is written to stdout as one JSON line, and
// _cudaLaunchKernelEx writes the launch configuration instead of launching.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "dispatch.h"

namespace {
int g_smem_optin = 0;  // the device's cudaDevAttrMaxSharedMemoryPerBlockOptin (argv[1])
// Kernel handles are 1 + an index into the names asked of cudaLibraryGetKernel, so each record
// names the kernel, and a launch of a handle the library never gave out shows as "?".
std::vector<std::string> g_kernels;
int g_library = 0;

const char* kernel_name(const void* handle) {
  auto i = reinterpret_cast<uintptr_t>(handle);
  return i >= 1 && i <= g_kernels.size() ? g_kernels[i - 1].c_str() : "?";
}
}  // namespace

extern "C" {
cudaError_t _cudaLibraryLoadData(cudaLibrary_t* library, const void* code, cudaJitOption*, void**,
                                 unsigned, cudaLibraryOption*, void**, unsigned) {
  uint32_t magic;
  std::memcpy(&magic, code, sizeof magic);
  std::printf("{\"call\": \"cudaLibraryLoadData\", \"magic\": \"%08x\"}\n", magic);
  *library = reinterpret_cast<cudaLibrary_t>(&g_library);
  return cudaSuccess;
}

cudaError_t _cudaLibraryGetKernel(cudaKernel_t* kernel, cudaLibrary_t, const char* name) {
  g_kernels.push_back(name);
  std::printf("{\"call\": \"cudaLibraryGetKernel\", \"kernel\": \"%s\"}\n", name);
  *kernel = reinterpret_cast<cudaKernel_t>(uintptr_t(g_kernels.size()));
  return cudaSuccess;
}

cudaError_t _cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t _cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  std::printf("{\"call\": \"cudaDeviceGetAttribute\", \"attr\": %d, \"device\": %d}\n", int(attr), device);
  *value = g_smem_optin;
  // Any other question is one the harness has no answer to: fail, so the run shows it.
  return attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? cudaSuccess : cudaErrorInvalidValue;
}

// The driver's cuKernelGetAttribute (CUresult, CUfunction_attribute), with a runtime device.
int _cuKernelGetAttribute(int* value, int attr, void* kernel, int device) {
  std::printf("{\"call\": \"cuKernelGetAttribute\", \"kernel\": \"%s\", \"attr\": %d, \"device\": %d}\n",
              kernel_name(kernel), attr, device);
  *value = 0;  // CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES (1): the kernels declare no static shared memory
  return attr == 1 ? 0 : 1;
}

cudaError_t _cudaKernelSetAttributeForDevice(cudaKernel_t kernel, cudaFuncAttribute attr, int value,
                                             int device) {
  std::printf("{\"call\": \"cudaKernelSetAttributeForDevice\", \"kernel\": \"%s\", \"attr\": %d, "
              "\"value\": %d, \"device\": %d}\n", kernel_name(kernel), int(attr), value, device);
  return cudaSuccess;
}

cudaError_t _cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  std::printf("{\"call\": \"cudaFuncSetAttribute\", \"kernel\": \"%s\", \"attr\": %d, \"value\": %d}\n",
              kernel_name(func), int(attr), value);
  return cudaSuccess;
}

cudaError_t _cudaLaunchKernelEx(const cudaLaunchConfig_t* c, const void* func, void**) {
  std::printf("{\"call\": \"cudaLaunchKernelEx\", \"kernel\": \"%s\", \"grid\": [%u, %u, %u], "
              "\"block\": [%u, %u, %u], \"smem\": %zu, \"attrs\": [",
              kernel_name(func), c->gridDim.x, c->gridDim.y, c->gridDim.z, c->blockDim.x,
              c->blockDim.y, c->blockDim.z, c->dynamicSmemBytes);
  for (unsigned i = 0; i < c->numAttrs; ++i) {
    const cudaLaunchAttribute& a = c->attrs[i];
    // Dimensions are three words; every other attribute the launchers set is one int, and the
    // bytes after it are not theirs to fill.
    if (a.id == cudaLaunchAttributeClusterDimension || a.id == cudaLaunchAttributePreferredClusterDimension)
      std::printf("%s[%d, [%u, %u, %u]]", i ? ", " : "", int(a.id), a.val.clusterDim.x,
                  a.val.clusterDim.y, a.val.clusterDim.z);
    else
      std::printf("%s[%d, %d]", i ? ", " : "", int(a.id), a.val.cooperative);
  }
  std::printf("]}\n");
  return cudaSuccess;
}

// Called by the exported headers' inline code directly, not through the runtime archive.
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t) { return "(stub)"; }
const char* cudaGetErrorString(cudaError_t) { return "(stub)"; }
cudaError_t cudaLibraryUnload(cudaLibrary_t) { return cudaSuccess; }
}

// argv: the device's opt-in shared memory per block, then one "b,sq,sk,h,hk" per call: every
// variant of the table is loaded, then called once per shape, with null device pointers (the
// host launcher reads none: it only encodes them into TMA descriptors and kernel arguments).
int main(int argc, char** argv) {
  g_smem_optin = std::atoi(argv[1]);
  for (int v = 0; v < kFa4VariantCount; ++v) {
    const Fa4Variant& variant = kFa4Variants[v];
    std::printf("{\"variant\": \"%s\"}\n", variant.name);
    std::printf("{\"loaded\": %d}\n", int(variant.load()));
    for (int i = 2; i < argc; ++i) {
      Fa4Args a;
      if (std::sscanf(argv[i], "%d,%d,%d,%d,%d", &a.b, &a.seqlen_q, &a.seqlen_k, &a.heads, &a.heads_k) != 5)
        return 2;
      // The backward's workspace dims for one dQ copy, and an H100's multiprocessors (which
      // ffi/backward.cc asks the device for).
      a.seqlen_q_pad = (a.seqlen_q + kFa4BwdSeqPad - 1) / kFa4BwdSeqPad * kFa4BwdSeqPad;
      a.semaphore_blocks = a.seqlen_q_pad / kFa4BwdSemaphoreRows;
      a.num_sms = 132;
      std::printf("{\"shape\": [%d, %d, %d, %d, %d]}\n", a.b, a.seqlen_q, a.seqlen_k, a.heads, a.heads_k);
      std::printf("{\"returned\": %d}\n", int(variant.launch(a, nullptr)));
    }
  }
  return 0;
}
