"""The Blackwell forward's static plan: tile table, warp roles, TMEM map, barriers and
pipelines, as plain Python (no DSL).

The kernel (fwd.py) sizes itself from these tables, and the tests check them without a GPU:
tests/test_sm100_plan.py the register budgets against the CTA's register pool, the TMEM map
against the 512 columns and the shared memory; tests/test_sm100_protocol.py the protocol, as the
kernel's own role methods issue it (kernels/common/recording.py), searched exhaustively
(kernels/common/protocol_model.py) with these pipelines' arrival counts and landings.

A CTA computes tile after tile of the LPT order (kernels/common/tile_scheduler.py; persistent
without a mask, one tile per CTA under one: `scheduler_kind`), its pipelines running on from one
tile into the next. A tile is `q_stages` 128-row query tiles ("stages") of one (head, batch)
against the same key blocks. Per key block j (visited from the highest to the lowest), the MMA
warp issues S_i = Q_i·K_jᵀ into TMEM for every stage; softmax warp group i reads S_i, writes P_i
(16-bit) over the second half of S_i's own columns, and hands the MMA warp P_i; the MMA warp
then issues O_i += P_i·V_j with P_i read from TMEM. The correction warp group rescales O_i in
TMEM when softmax i moved its row maximum (FA4's conditional rescaling), and at the end divides
by the row sums, stages O_i in Q_i's shared memory for a TMA store and writes LSE; once the store
has read it, Q_i's buffer is free for the next tile's Q_i.

TMEM holds two S tiles (`S_BUFFERS`). With two stages (d <= 192) each stage has one, and the two
softmax warp groups ping-pong. With one (d256, whose 256-column O leaves room for no second O)
one softmax warp group alternates between them: the MMA warp issues the S GEMM two blocks ahead
(S_{j+2} right after P·V_j), so that the tensor core computes the next block's S while softmax
reads this one's, and O's rescale waits for the previous P·V on a pipeline of its own (PV0).
A CTA pair (TileConfig.cta_pair) runs the same protocol in two CTAs with one MMA warp issuing
for both; each pipeline says on which CTA's barrier its arrivals land (`Pipeline.full_at`).
"""
from __future__ import annotations

import dataclasses
import enum

from fa4_jax.kernels.common import registers
from fa4_jax.kernels.sm100 import hardware

# Query rows of one tcgen05 MMA (cta_group 1, M = 128): one TMEM lane per row.
ROWS_PER_STAGE = 128
# Query tiles per CTA where TMEM holds two O tiles: the two softmax warp groups ping-pong between
# them, so that one's exponentials overlap the other's GEMMs on the tensor core.
Q_STAGES = 2
# S tiles in TMEM: one per query tile with two, one query tile's S double-buffered with one.
S_BUFFERS = 2
THREADS_PER_WARP = 32
WARPS_PER_GROUP = 4


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One head dim's static kernel shape. The defaults are the shipped values most head dims
    share; TILE_CONFIGS says where and why an entry differs."""

    # Keys per block: S_i is 128 x tile_n fp32 in TMEM, one column per key.
    tile_n: int = 128
    # Depth of the K/V ring (K_j and V_j take one stage each, in that order).
    kv_stages: int = 4
    # FA4's conditional rescaling threshold (log2 units): the row maximum moves, and O is
    # rescaled, only when a block's maximum outgrows it by more than 2^8.
    rescale_threshold: float = 8.0
    # Share of each row's exponentials on the FMA pipes (kernels/common/exp2.py, as packed
    # FFMA2 pairs). A row's 128 exponentials on MUFU (16 per clock) take 1032 cycles per block,
    # level with d128's two GEMMs on the tensor core (1024): an eighth on the polynomial puts
    # MUFU under it, FA4 upstream's own split (benchmarks/sm100_prediction.py; not measured).
    # More would pay where the GEMMs are shorter (d64, d96), but three eighths spilled inside the
    # masked loops and a quarter inside d128's unmasked one.
    exp2_poly_share: float = 0.125
    # A CTA pair: a cluster of two CTAs whose MMAs (tcgen05's cta_group 2, issued by the first
    # CTA's MMA warp) cover both CTAs' rows, 256 per stage. Each CTA keeps its own 128 rows of Q,
    # S, P and O but only half of each K block (its keys) and V block (its dv columns), so an
    # SM reads and loads half the K/V bytes per score. Calls without a mask and without ragged
    # lengths only (PAIR_TILE_CONFIGS, the sm100 menu's routes).
    cta_pair: bool = False
    # Query tiles per CTA: two, or one where O is too wide for two O tiles in TMEM (dv 256).
    q_stages: int = Q_STAGES

    @property
    def ctas(self) -> int:
        """CTAs per MMA: 2 for a pair."""
        return 2 if self.cta_pair else 1

    @property
    def s_lookahead(self) -> int:
        """Key blocks whose S GEMMs the MMA warp issues before the first P·V: one per stage's S
        buffer with two stages, both buffers of the one stage with one."""
        return S_BUFFERS // self.q_stages

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        """Q's stages plus the K/V ring (one buffer per stage sized for the wider of K, V;
        a pair's CTA holds half of each block)."""
        q = self.q_stages * ROWS_PER_STAGE * head_dim
        kv = self.kv_stages * self.tile_n * max(head_dim, head_dim_v) // self.ctas
        return elem_bytes * (q + kv)


# Keyed by (head_dim, head_dim_v). TMEM bounds dv: two S tiles of tile_n columns and q_stages O
# tiles of dv columns fill at most 512 (`TmemMap`); shared memory bounds the ring depth.
TILE_CONFIGS = {
    # 16 KB per K/V stage: six stages keep the tensor core fed at d64's short GEMMs.
    (64, 64): TileConfig(kv_stages=6),
    # 24 KB per stage: five fit beside Q's 48 KB.
    (96, 96): TileConfig(kv_stages=5),
    # DeepSeek's shape. TMEM holds it (two 128-column O tiles); K's 48 KB stages take the ring
    # (V's 32 KB sit at their offsets), two of them beside Q's 96 KB. Its GEMMs take 1280 cycles
    # per block, above MUFU's 1032 with every exponential there: no polynomial.
    (192, 128): TileConfig(kv_stages=2, exp2_poly_share=0.0),
    # 32 KB per stage: four fit beside Q's 64 KB (FA4 upstream's d128 runs three, with 64 KB of
    # O staging of its own; here O is staged in Q's buffers, free by the epilogue).
    (128, 128): TileConfig(kv_stages=4),
    # Gemma's. O's 256 columns and two S tiles fill TMEM: one query tile, S double-buffered.
    # A whole K or V block is 64 KB: two stages beside Q's 64 KB (a single CTA serves masked,
    # ragged and short calls; dense ones of more than 128 rows go to the pair). The GEMMs take 2048 cycles per
    # block against MUFU's 1032 with every exponential there: no polynomial.
    (256, 256): TileConfig(q_stages=1, kv_stages=2, exp2_poly_share=0.0),
}
# The CTA pair's tables (the "cta_pair" tuning), where FA4 upstream finds the pair pays: no
# mask, d128 and d192/dv128 (its GEMMs long enough that K/V's shared-memory reads, halved here,
# come close to the tensor core's time).
PAIR_TILE_CONFIGS = {
    # 16 KB per CTA and stage: six stages hold as many blocks in flight as three unpaired ones,
    # FA4 upstream's 2-CTA d128 depth.
    (128, 128): TileConfig(cta_pair=True, kv_stages=6),
    # 24 KB per stage (K's half block; V's 16 KB at its offsets): five beside Q's 96 KB.
    (192, 128): TileConfig(cta_pair=True, kv_stages=5, exp2_poly_share=0.0),
    # FA4 upstream's d256 kernel is a pair: half of K's keys and of V's columns per CTA, 32 KB
    # per stage, four beside Q's 64 KB (five would leave 1 KB for barriers and statistics).
    (256, 256): TileConfig(cta_pair=True, q_stages=1, kv_stages=4, exp2_poly_share=0.0),
}
# Barriers, alignment padding and the scale exchange come on top of TileConfig.smem_bytes.
SMEM_MARGIN = 4096


def tile_config(head_dim: int, head_dim_v: int, tuning: dict) -> TileConfig:
    """The configuration a variant of these head dims is built with: its table's entry (the pair
    table's when the tuning asks for a CTA pair; KeyError if none) with the tuning's overrides."""
    table = PAIR_TILE_CONFIGS if tuning.get("cta_pair", False) else TILE_CONFIGS
    return dataclasses.replace(table[(head_dim, head_dim_v)], **tuning)


def scheduler_kind(mask: str) -> str:
    """The tile order (kernels/common/tile_scheduler.py) of a problem class: persistent CTAs
    ("lpt") without a mask; under a causal or window mask, whose tiles' work differs, one CTA per
    tile in LPT order ("lpt_grid"), which the hardware balances (FA4 upstream's choice, and the
    Hopper kernels' measured best)."""
    return "lpt_grid" if mask in ("causal", "local") else "lpt"


class Role(enum.Enum):
    SOFTMAX0 = "softmax0"
    SOFTMAX1 = "softmax1"
    CORRECTION = "correction"
    MMA = "mma"
    LOAD = "load"
    IDLE = "idle"


@dataclasses.dataclass(frozen=True)
class RoleAssignment:
    role: Role
    warps: tuple[int, ...]
    # setmaxnreg budget per thread (a multiple of 8): per warp group, they sum to at most the
    # CTA's register pool (kernels/common/registers.py), which `WarpRoles.check` enforces.
    registers: int


SOFTMAX_ROLES = (Role.SOFTMAX0, Role.SOFTMAX1)


@dataclasses.dataclass(frozen=True)
class WarpRoles:
    """A warp-role table. The TMEM lanes a warp may read are fixed by its index within its warp
    group (warp w reads lanes 32·(w % 4) to 32·(w % 4) + 31), so each softmax and correction warp
    group covers the 128 rows of a stage. The MMA, load and idle warps come last: they share
    the last warp group's budget."""

    table: tuple[RoleAssignment, ...]

    def role(self, name: Role) -> RoleAssignment:
        return next(r for r in self.table if r.role == name)

    def threads(self, *names: Role) -> int:
        return sum(len(self.role(name).warps) for name in names) * THREADS_PER_WARP

    @property
    def num_warps(self) -> int:
        return sum(len(r.warps) for r in self.table)

    @property
    def num_threads(self) -> int:
        return self.num_warps * THREADS_PER_WARP

    @property
    def launch_registers(self) -> int:
        """Registers per thread at launch, the CTA's pool over its threads: a budget above it is a
        setmaxnreg increase, below it a decrease."""
        return registers.launch_registers(self.num_threads)

    @property
    def softmax(self) -> tuple[Role, ...]:
        """The softmax roles, softmax i serving stage i."""
        return tuple(r for r in SOFTMAX_ROLES if any(a.role == r for a in self.table))

    @property
    def tmem_users(self) -> tuple[Role, ...]:
        """The roles that touch TMEM: they wait on Barrier.TMEM for its address, and arrive on it
        when done so that the MMA warp, which allocated it, may free it."""
        return (Role.MMA, *self.softmax, Role.CORRECTION)

    def budgets(self) -> tuple[int, ...]:
        """Each warp group's setmaxnreg budget, in warp-group order."""
        by_group = {}
        for r in self.table:
            for w in r.warps:
                by_group.setdefault(w // WARPS_PER_GROUP, set()).add(r.registers)
        mixed = {g: b for g, b in by_group.items() if len(b) != 1}
        if mixed:
            raise ValueError(f"warp groups {sorted(mixed)} mix setmaxnreg budgets {mixed}")
        return tuple(by_group[g].pop() for g in sorted(by_group))

    def check(self) -> None:
        """Raises if the table breaks a hardware limit (run at kernel construction)."""
        warps = sorted(w for r in self.table for w in r.warps)
        if warps != list(range(self.num_warps)) or self.num_warps % WARPS_PER_GROUP:
            raise ValueError(f"warp roles must cover whole warp groups once: {warps}")
        violation = registers.pool_violation(self.budgets(), self.launch_registers)
        if violation is not None:
            raise ValueError(violation)


# Two stages, 512 threads launched at 128 registers. Softmax takes the registers: a 128-column
# row of S in fp32 plus its P, about 190 live in its unmasked loop; at 192 an unrelated change
# elsewhere in the kernel tipped ptxas into spilling there, so it has 200, taken from the MMA,
# load and idle warps (their loops hold a few pipeline states and addresses: 32, as in FA4
# upstream's d256 kernel). The correction streams O through 16 columns at a time.
TWO_STAGE_ROLES = WarpRoles((
    RoleAssignment(Role.SOFTMAX0, (0, 1, 2, 3), 200),
    RoleAssignment(Role.SOFTMAX1, (4, 5, 6, 7), 200),
    RoleAssignment(Role.CORRECTION, (8, 9, 10, 11), 80),
    RoleAssignment(Role.MMA, (12,), 32),
    RoleAssignment(Role.LOAD, (13,), 32),
    RoleAssignment(Role.IDLE, (14, 15), 32),
))
# One stage: three warp groups launched at 168 registers, whose pool of 168 x 384 the budgets
# fill: the one softmax at the setmaxnreg ceiling (a 128-column row of S in fp32 and its P), the
# correction with the rest above the others' 48 (it streams O's 256 columns 16 at a time).
ONE_STAGE_ROLES = WarpRoles((
    RoleAssignment(Role.SOFTMAX0, (0, 1, 2, 3), 256),
    RoleAssignment(Role.CORRECTION, (4, 5, 6, 7), 200),
    RoleAssignment(Role.MMA, (8,), 48),
    RoleAssignment(Role.LOAD, (9,), 48),
    RoleAssignment(Role.IDLE, (10, 11), 48),
))


def warp_roles(config: TileConfig) -> WarpRoles:
    return ONE_STAGE_ROLES if config.q_stages == 1 else TWO_STAGE_ROLES


@dataclasses.dataclass(frozen=True)
class TmemMap:
    """Column offsets (32-bit columns; every row's lane is its query row) of one CTA's tensor
    memory: the S_BUFFERS S tiles, then O of each stage. P (16-bit, two per column) overwrites
    the second half of its S once softmax holds that S in registers, and the next S GEMM into
    those columns is issued after the P·V that reads it (one thread's MMAs run in order)."""

    tile_n: int
    head_dim_v: int
    q_stages: int = Q_STAGES

    def s(self, buffer: int) -> int:
        return buffer * self.tile_n

    def p(self, buffer: int) -> int:
        return self.s(buffer) + self.tile_n // 2

    def o(self, stage: int) -> int:
        return S_BUFFERS * self.tile_n + stage * self.head_dim_v

    @property
    def used_columns(self) -> int:
        return self.o(self.q_stages - 1) + self.head_dim_v

    @property
    def alloc_columns(self) -> int:
        """The allocation: a power of two, at least 32 columns."""
        columns = 32
        while columns < self.used_columns:
            columns *= 2
        return columns

    def regions(self) -> dict[str, tuple[int, int]]:
        """name -> [first, last + 1) columns."""
        out = {}
        for buffer in range(S_BUFFERS):
            out[f"S{buffer}"] = (self.s(buffer), self.s(buffer) + self.tile_n)
            out[f"P{buffer}"] = (self.p(buffer), self.p(buffer) + self.tile_n // 2)
        for stage in range(self.q_stages):
            out[f"O{stage}"] = (self.o(stage), self.o(stage) + self.head_dim_v)
        return out


# A CTA pair's leader: rank 0 of its cluster, whose MMA warp issues the pair's MMAs and on whose
# barriers "leader" arrivals land (Pipeline.full_at / empty_at).
LEADER = 0


class Barrier(enum.IntEnum):
    """Named barriers (0 is __syncthreads)."""

    # The MMA warp allocates TMEM and publishes its address; the softmax and correction warps
    # wait for it, and at the end tell the MMA warp they are done with it before it frees it.
    TMEM = 1
    # The correction warp group's rows of a stage's O are in shared memory (and fenced for the
    # async proxy) before one of its threads issues the stage's TMA store.
    O_STORE = 2


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One mbarrier pipeline: `full` barriers the producer arrives on, `empty` ones the
    consumers arrive on. Arrivals per phase: one per producer role on full, one per consumer
    role on empty (roles here; the kernel counts their threads, or one for TMA and
    tcgen05.commit, or `consumer_threads` where one thread of the role arrives for it).
    `releases_filled`: an empty arrival of a round gives back what that round's full phase
    delivered, so it may only come once that phase is complete."""

    name: str
    stages: int
    producer: tuple[Role, ...]
    consumers: tuple[Role, ...]
    consumer_threads: int | None = None
    releases_filled: bool = True
    # In a CTA pair, the mbarrier an arrival lands on (a wait is always on the waiter's own):
    # "own", the arriving CTA's; "leader", the first CTA's, where its MMA warp waits (both
    # CTAs' TMA loads of a pair operand complete there, and both CTAs' threads hand the MMA
    # warp their part); "both", the same barrier of each CTA (a multicast tcgen05.commit).
    full_at: str = "own"
    empty_at: str = "own"


def pipelines(config: TileConfig) -> tuple[Pipeline, ...]:
    """The forward's mbarrier pipelines; the kernel creates one of each."""
    out = [
        # full: Q_i has landed (the MMA warp waits); empty: the thread that TMA-stored O_i from
        # Q_i's buffer has seen the store read it, so the next tile's Q_i may load.
        Pipeline("Q", config.q_stages, (Role.LOAD,), (Role.CORRECTION,), consumer_threads=1, full_at="leader"),
        Pipeline("KV", config.kv_stages, (Role.LOAD,), (Role.MMA,), full_at="leader", empty_at="both"),
    ]
    for stage, softmax in enumerate(warp_roles(config).softmax):
        # full: S_i is in TMEM (a tcgen05.commit); empty: P_i is in TMEM and O_i is rescaled
        # (the correction's part of it comes before S_i of that round is full). One stage
        # per S buffer the stage owns (uses alternate between them).
        out.append(Pipeline(f"S{stage}", config.s_lookahead, (Role.MMA,), (softmax, Role.CORRECTION),
                            releases_filled=False, full_at="both", empty_at="leader"))
        # Softmax i's row scales for the correction (full), read (empty).
        out.append(Pipeline(f"STATS{stage}", 1, (softmax,), (Role.CORRECTION,)))
        if config.s_lookahead > 1:
            # full: a P_i·V before a tile's last is done, so the correction may rescale O_i (the
            # S GEMM that softmax waited for was issued before it); empty: rescaled.
            out.append(Pipeline(f"PV{stage}", 1, (Role.MMA,), (Role.CORRECTION,), full_at="both",
                                empty_at="leader"))
        # full: the last P_i·V is done, O_i is final.
        out.append(Pipeline(f"O{stage}", 1, (Role.MMA,), (Role.CORRECTION,), full_at="both"))
    return tuple(out)
