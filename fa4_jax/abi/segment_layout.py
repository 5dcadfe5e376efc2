"""The span tables that let the kernels skip key blocks which share no segment with a query tile.

A call with segment ids passes, beside the ids, two tables that `fa4_jax.runtime.segments.span_tables`
computes from them in one sort-and-search pass (O((sq + sk) log), no [sq, sk] array):

- row spans [b, ceil(sq / SPAN_CHUNK), 4]: for each chunk of SPAN_CHUNK query rows, the keys
  its rows see, as key positions;
- key spans [b, ceil(sk / SPAN_CHUNK), 4]: for each chunk of SPAN_CHUNK keys, the query rows
  that see them, as row positions.

Each entry is (LO, HI, FULL_LO, FULL_HI) over the chunk's counted positions (those below the
entry's valid length; positions past it are ignored, as the kernels clear them anyway):

- [LO, HI): the hull of every visible partner of every counted position. Partners outside it
  are invisible, so a block of the other side that lies wholly outside is skipped.
- [FULL_LO, FULL_HI): partners visible to *every* counted position: the intersection of their
  visible sets, where each set is contiguous (an id's keys form one run); empty (NO_SPAN,
  0) as soon as one counted position sees no partner or a non-contiguous set. A block of the
  other side wholly inside needs no id comparison.

A chunk with no counted position holds the identities of the kernels' reductions,
(NO_SPAN, 0, 0, NO_SPAN). A tile of tile_m = k · SPAN_CHUNK rows (every kernel tile is a
multiple of SPAN_CHUNK) reduces its chunks' entries with (min, max, max, min), so a tile's
ranges are exact for the tile, whatever the kernel's tile shape: the tables describe the
problem, not a kernel.

Pure constants, importing nothing: the kernels (build time) and the run time both read them.
"""

# Query rows (row spans) or keys (key spans) per table entry: the smallest kernel tile.
SPAN_CHUNK = 64
# Fields of one entry, in order.
LO, HI, FULL_LO, FULL_HI = range(4)
SPAN_FIELDS = 4
# "No position": above any sequence position the int32 ABI allows, far enough below 2^31 that
# the kernels' block arithmetic (adding a tile width before dividing) cannot overflow.
NO_SPAN = 1 << 30
# Rows of the widest backward query tile; every backward tile_m divides it, so a deterministic
# walk computed at this width serves any backward kernel (fa4_jax.runtime.segments.deterministic_walk).
WIDEST_BACKWARD_TILE_M = 128
# A boolean mask's bits (fa4_jax/runtime/mask_bits.py): keys per int32 word.
MASK_WORD_BITS = 32
