#include "gate.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>

namespace fa4 {
namespace {

// Whether the comma-separated list in environment variable `name` holds `arch` (spaces around
// an entry are ignored).
bool Listed(const char* name, std::string_view arch) {
  const char* value = std::getenv(name);
  if (value == nullptr) return false;
  std::string_view rest(value);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view entry = rest.substr(0, comma);
    while (!entry.empty() && entry.front() == ' ') entry.remove_prefix(1);
    while (!entry.empty() && entry.back() == ' ') entry.remove_suffix(1);
    if (entry == arch) return true;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return false;
}

// FA4_JAX_TRUST_UNVERIFIED set to anything but "" and "0".
bool Trusted() {
  const char* value = std::getenv("FA4_JAX_TRUST_UNVERIFIED");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

bool Unverified(std::string_view arch) {
  for (int i = 0; i < kFa4UnverifiedArchCount; ++i)
    if (arch == kFa4UnverifiedArches[i]) return true;
  return Listed("FA4_JAX_UNVERIFIED_ARCHES", arch);
}

// One flag per entry of kFa4Variants: the variant passed its first-use check on this GPU
// (value-initialised: all false).
std::atomic<bool>* VerifiedFlags() {
  static const std::unique_ptr<std::atomic<bool>[]> flags(new std::atomic<bool>[kFa4VariantCount]());
  return flags.get();
}

const Fa4Variant* Named(const char* name) {
  for (int i = 0; i < kFa4VariantCount; ++i)
    if (std::strcmp(kFa4Variants[i].name, name) == 0) return &kFa4Variants[i];
  return nullptr;
}

}  // namespace

std::string Refusal(const Fa4Variant& v) {
  const std::string name = v.name, arch = v.arch;
  if (Listed("FA4_JAX_DISABLE_ARCHES", arch))
    return name + " is switched off: its arch " + arch +
           " is listed in FA4_JAX_DISABLE_ARCHES (remove it from that variable to run it)";
  if (!Unverified(arch) || Trusted() || VerifiedFlags()[&v - kFa4Variants].load(std::memory_order_acquire))
    return "";
  return name + " has not run on " + arch +
         " hardware before and has not passed its first-use check in this process. A process "
         "that imports fa4_jax runs it once it has passed: make a fa4_jax call that uses it, or "
         "run `python -m fa4_jax verdicts check '^" + name +
         "$'` (the verdict is kept for this library, GPU and driver), then run this program "
         "again after `import fa4_jax`; or set FA4_JAX_TRUST_UNVERIFIED=1 to run it unchecked";
}

}  // namespace fa4

// Marks `variant` verified in this process (fa4_jax.runtime.gate, after its probe passed):
// 0, or 1 when the library has no variant of that name.
FA4_EXPORT int Fa4MarkVerified(const char* variant) {
  const Fa4Variant* v = fa4::Named(variant);
  if (v == nullptr) return 1;
  fa4::VerifiedFlags()[v - kFa4Variants].store(true, std::memory_order_release);
  return 0;
}

// For tests and tools on any machine: "" when the handlers would run `variant` now, else why
// not (the handlers' error text), or "unknown variant" when the library has none of that name.
// The text lives until the calling thread's next call.
FA4_EXPORT const char* Fa4VariantRefusal(const char* variant) {
  static thread_local std::string text;
  const Fa4Variant* v = fa4::Named(variant);
  text = v == nullptr ? "unknown variant" : fa4::Refusal(*v);
  return text.c_str();
}
