"""The contract between the build and the run time: variant names and routing rules, the
operand layouts the kernels read, the FFI target names. Plain Python, no JAX."""
