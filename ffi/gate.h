// The first-use gate: which compiled variants the handlers may run.
//
// A variant of an arch whose kernels no GPU of that arch has run before (the library's
// unverified archs, kFa4UnverifiedArches, plus those in FA4_JAX_UNVERIFIED_ARCHES) runs only
// after fa4_jax has checked it on this GPU (a probe in a child process, fa4_jax.runtime.gate)
// and marked it verified in this process (Fa4MarkVerified), or when FA4_JAX_TRUST_UNVERIFIED is
// set. FA4_JAX_DISABLE_ARCHES switches archs off entirely. The environment is read on every
// decision (getenv), so a change made at run time (Python's os.environ) takes effect at once.
#pragma once

#include <string>

#include "dispatch.h"

namespace fa4 {

// "" when the handlers may run `v`; else why not, naming the variant and the way out.
std::string Refusal(const Fa4Variant& v);

}  // namespace fa4
