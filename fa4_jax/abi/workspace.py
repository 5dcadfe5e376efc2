"""The geometry of the backward's fp32 workspaces, shared by the backward kernels, the FFI
handler's generated header (aot/codegen.py), the compiler's fake arguments (aot/compile.py) and
`ffi.backward_call`, which allocates them as results of the call.

A module of its own, importing nothing: the run time reads it, and the kernels' build-cache key
(aot/build.py hashes the modules a kernel imports) does not pull in the build driver.
"""

# The workspaces cover the query rows rounded up to this, so every query tile of up to 128 rows
# reads and writes them without bounds checks; the FFI handler mirrors it.
BWD_SEQ_PAD = 128
# The deterministic backward keeps one counter per this many (padded) query rows: the smallest
# query tile a backward kernel may use.
BWD_SEMAPHORE_ROWS = 64
# Deterministic mode may give each query block's dQ this many fp32 accumulators (the leading
# "copies" dim of the dQ workspace and of the semaphores): turn t of the block's adds goes to
# copy t mod copies as that copy's turn t div copies, and the postprocess sums the copies in
# order. The kernels compute those as turn & (copies - 1) and turn >> (copies - 1), exact for
# 1 and 2 only, so the FFI handler accepts no more.
BWD_MAX_DQ_COPIES = 2
