"""A batch entry's valid length: a ragged batch's, or the buffer's when the call passes none.

A call on a dense batch passes empty length tensors ([0] int32, `fa4_jax.runtime.ffi`). XLA then runs
nothing to build them: full lengths were a broadcast kernel ahead of every call, 0.3-4.5 µs of
the stream at 1k-4k tokens (docs/perf-log.md, "dense calls pass no lengths"). And the kernels
read nothing: a forward tile's first K load no longer waits for a global load of its entry's
length.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def entry_length(lengths: cute.Tensor, batch: Int32, buffer_length: Int32) -> Int32:
    """lengths[batch] clamped to buffer_length, or buffer_length when `lengths` is empty."""
    length = buffer_length
    if lengths.shape[0] > 0:
        length = cutlass.min(lengths[batch], buffer_length)
    return length
