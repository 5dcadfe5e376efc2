"""First-use probes: kernels checked against the reference in a child process.

A variant of an arch no GPU of ours has run (Blackwell's) is checked on this GPU before a call
uses it, in a process of its own, so that a hang or a fault costs that process, not the caller's:

- `problems`: which small calls, at kernel level, each variant is checked on (routed to it);
- `cases`, `reference`: their inputs and the numpy reference (exact and low precision);
- `calls`, `device`: the launch, through the library's probe C API (ffi/probe.cc), no JAX on
  the GPU;
- `judge`: the comparison under the numerics rule, and the verdict;
- `child` (`python -m fa4_jax.runtime.probe`) and `protocol`: the probe process and what it prints;
- `runner`: the parent's side: starts the child pinned to the caller's GPU, times each variant
  out, restarts after a hang or a fault.

fa4_jax.runtime.gate (the gate before a call) and fa4_jax.tools.selftest (the report) run it.
"""
