"""Which output tiles a CTA computes, and in what order: FA4's longest-processing-time-first order.

A tile is (m_block, head, batch): `tile_m` query rows of one head of one sequence. Three kinds:

- "linear": one CTA per tile, grid (m_blocks, heads, batch), the tile read off blockIdx. The
  hardware hands out CTAs in blockIdx order, so tiles start in m-block order.
- "lpt_grid": one CTA per tile in the LPT order below, the grid in the order's own shape,
  (section heads, m-blocks, sections): the hardware hands out CTAs x fastest, then y, then z,
  so blockIdx is the position in the order and a tile starts after one division (batch and
  head of a (batch, head) pair). One tile per CTA, so the hardware's dispatch balances the
  load dynamically; the order only decides which tiles go first. A last, partial section
  leaves some CTAs of its x range without a tile; they exit at once.
- "lpt": persistent. Grid = min(tiles, num_sms); CTA c computes tiles c, c + grid, c + 2·grid, ...
  of the LPT order, so its pipelines, barriers and register setup carry from tile to tile.
  The SM count is static (132, the H200's and H100 SXM's): an ahead-of-time kernel cannot query
  the device, and the FFI signature has no slot for it. On a GPU with fewer SMs it is still
  correct, only with a short second wave of CTAs. With `cluster_size` 2 (a Blackwell CTA pair,
  whose MMAs span both CTAs' rows) the unit is the cluster: num_sms / 2 clusters, cluster c
  taking tiles c, c + clusters, ... and both its CTAs computing each (tile_m counts both CTAs'
  rows).

The LPT order (shared by "lpt" and "lpt_grid"): (batch, head) pairs are cut into L2 sections of
as many heads as keep their K and V (seqlen_k · (d + dv) bytes per KV head) within `l2_bytes`.
Within a section the tiles go m-block by m-block, all of the section's heads at each m-block, so
the CTAs that run at the same time read the same few K/V heads and each is fetched from HBM about
once. With a causal or window mask the m-blocks go from the last to the first: the bottom rows of
a causal mask see the most key blocks, so the heaviest tiles start first and the light ones fill
the tail. Sections go in order; the first sections' heavy tiles are not delayed by later ones.

Producer and consumer warps each call `tile(i)` for i in range(`tile_count()`) and so walk the
same sequence without talking to each other: the schedule is a pure function of blockIdx.
"""
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32

SCHEDULERS = ("linear", "lpt", "lpt_grid")

# sm_90a SMs of an H100 SXM / H200; the persistent grid. See the module docstring.
SM90_NUM_SMS = 132
# The share of L2 (50 MB on H100/H200) that one section's K and V may fill; FlashAttention-3's
# experimentally chosen figure for its head swizzle.
L2_SECTION_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TileScheduler:
    kind: str
    tile_m: int
    # Visit m-blocks from the last to the first (causal/local masks: heaviest first).
    reverse_m: bool
    # Bytes of one key position of K plus V: (d + dv) · element size.
    kv_bytes_per_key: int
    num_sms: int = SM90_NUM_SMS
    l2_bytes: int = L2_SECTION_BYTES
    # CTAs per cluster that compute each tile together (persistent "lpt" only).
    cluster_size: int = 1

    def __post_init__(self):
        if self.kind not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.kind!r}")
        if self.cluster_size != 1 and (self.kind != "lpt" or self.num_sms % self.cluster_size):
            raise ValueError(f"clusters of {self.cluster_size} CTAs need the persistent 'lpt' kind and a "
                             f"multiple of them in num_sms={self.num_sms}, got {self.kind!r}")

    @property
    def persistent(self) -> bool:
        return self.kind == "lpt"

    def section_heads(self, seqlen_k, num_heads, num_heads_kv):
        """(batch, head) pairs per L2 section: as many KV heads' K and V (seqlen_k keys each) as
        fit `l2_bytes`, at least one, times the query heads each serves (GQA)."""
        budget_keys = self.l2_bytes // self.kv_bytes_per_key  # compile time
        kv_heads = cutlass.max(budget_keys // cutlass.max(seqlen_k, 1), 1)
        return kv_heads * (num_heads // num_heads_kv)

    def grid(self, seqlen_q, seqlen_k, num_heads, num_heads_kv, batch):
        """Host side (inside the launching @cute.jit, or on Python ints): the launch grid."""
        num_m = (seqlen_q + self.tile_m - 1) // self.tile_m
        if cutlass.const_expr(self.kind == "linear"):
            return (num_m, num_heads, batch)
        if cutlass.const_expr(self.kind == "lpt_grid"):
            pairs = num_heads * batch
            section_heads = cutlass.min(self.section_heads(seqlen_k, num_heads, num_heads_kv), pairs)
            return (section_heads, num_m, (pairs + section_heads - 1) // section_heads)
        clusters = cutlass.min(num_m * num_heads * batch, self.num_sms // self.cluster_size)
        return (clusters * self.cluster_size, 1, 1)

    @cute.jit
    def tile_count(self, seqlen_q: Int32, num_heads: Int32, batch: Int32) -> Int32:
        """How many tiles this CTA computes (none: an "lpt_grid" CTA past the last section's
        pairs)."""
        count = Int32(1)
        if cutlass.const_expr(self.kind == "lpt_grid"):
            x, _, z = cute.arch.block_idx()
            section_heads, _, _ = cute.arch.grid_dim()
            if z * section_heads + x >= num_heads * batch:
                count = Int32(0)
        if cutlass.const_expr(self.persistent):
            num_tiles = (seqlen_q + self.tile_m - 1) // self.tile_m * num_heads * batch
            first, stride = self.worker()
            count = (num_tiles - first + stride - 1) // stride
        return count

    @cute.jit
    def tile(self, i: Int32, seqlen_q: Int32, seqlen_k: Int32, num_heads: Int32, num_heads_kv: Int32,
             batch: Int32):
        """(m_block, head, batch index) of this CTA's i-th tile."""
        bx, by, bz = cute.arch.block_idx()
        m_block, head, batch_idx = bx, by, bz
        if cutlass.const_expr(self.kind == "lpt_grid"):
            section_heads, num_m, _ = cute.arch.grid_dim()
            m_block, head, batch_idx = self.grid_tile((bx, by, bz), section_heads, num_m, num_heads)
        elif cutlass.const_expr(self.persistent):
            first, stride = self.worker()
            m_block, head, batch_idx = self.decode(first + i * stride, seqlen_q, seqlen_k, num_heads,
                                                   num_heads_kv, batch)
        return m_block, head, batch_idx

    def worker(self):
        """A persistent CTA's (first position in the order, stride): its cluster's index and
        the number of clusters (read, not divided: the special registers hold them)."""
        if cutlass.const_expr(self.cluster_size == 1):
            bx, _, _ = cute.arch.block_idx()
            grid_x, _, _ = cute.arch.grid_dim()
            return bx, grid_x
        cluster, _, _ = cute.arch.cluster_idx()
        clusters, _, _ = cute.arch.cluster_dim()
        return cluster, clusters

    def grid_tile(self, block, section_heads, num_m, num_heads):
        """(m_block, head, batch index) of an "lpt_grid" CTA: block = (pair in its section,
        m-block position, section). On DSL Int32s in the kernel, Python ints in the CPU test."""
        pair_in_section, m_idx, section = block
        hb = section * section_heads + pair_in_section
        m_block = m_idx
        if cutlass.const_expr(self.reverse_m):
            m_block = num_m - 1 - m_idx
        batch_idx = hb // num_heads
        return m_block, hb - batch_idx * num_heads, batch_idx

    def decode(self, tile_idx, seqlen_q, seqlen_k, num_heads, num_heads_kv, batch):
        """(m_block, head, batch index) of position tile_idx in the LPT order.

        Straight-line integer arithmetic on non-negative values, so it runs unchanged on DSL
        Int32s inside the kernel and on Python ints in the CPU test of the order."""
        num_m = (seqlen_q + self.tile_m - 1) // self.tile_m
        section_heads = self.section_heads(seqlen_k, num_heads, num_heads_kv)
        section_tiles = section_heads * num_m
        section = tile_idx // section_tiles
        rest = tile_idx - section * section_tiles
        first_hb = section * section_heads
        # The last section may hold fewer (batch, head) pairs.
        heads_here = cutlass.min(section_heads, num_heads * batch - first_hb)
        m_idx = rest // heads_here
        hb = first_hb + rest - m_idx * heads_here
        m_block = m_idx
        if cutlass.const_expr(self.reverse_m):
            m_block = num_m - 1 - m_idx
        batch_idx = hb // num_heads
        head = hb - batch_idx * num_heads
        return m_block, head, batch_idx
