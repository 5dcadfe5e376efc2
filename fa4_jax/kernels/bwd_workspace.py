"""The geometry of the backward's fp32 workspaces, shared by the backward kernel, the FFI
handler's generated header (aot/codegen.py), the compiler's fake arguments (aot/compile.py) and
`ffi.backward`, which allocates them as results of the call.

A module of its own, importing nothing, so that the kernel's build-cache key (aot/build.py hashes
the modules a kernel imports) does not pull in the build driver.
"""

# The workspaces cover the query rows rounded up to this, so every query tile of up to 128 rows
# reads and writes them without bounds checks; the FFI handler mirrors it.
BWD_SEQ_PAD = 128
# The deterministic backward keeps one counter per this many (padded) query rows: the smallest
# query tile a backward kernel may use.
BWD_SEMAPHORE_ROWS = 64
