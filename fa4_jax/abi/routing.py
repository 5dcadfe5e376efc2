"""Which compiled kernel serves a call: variant names, and the routing rules evaluated on a call.

Each arch folder (fa4_jax/kernels/<arch>/menu.py) declares the variants it ships and, as `Route`s,
the calls a tuned variant serves instead of the default kernel. The build writes both into the
library's manifest (fa4_jax/_lib/manifest.json) and into the C++ dispatch table, and the FFI
handler evaluates the routes on each call's shapes: the custom call's attributes describe the
problem and never name a tuning, so a `jax.export`ed program runs whatever kernel the installed
library picks for it. This module is the same rule in Python, read from the manifest, for
`fa4_jax.runtime.dispatch.forward_plan` and the tests (which check it against the handler's).

Pure Python: imported at run time and by the build, it imports nothing from the package.
"""
from __future__ import annotations

import dataclasses

DTYPES = ("bf16", "fp16")
MASKS = ("none", "causal", "local")
KINDS = ("fwd", "bwd")


def arch_name(major: int, minor: int) -> str:
    """The arch whose variants serve a GPU of compute capability major.minor: the sm_100f family
    for 10.x (B200/GB200 and B300/GB300 run one family-portable cubin), else the arch-specific
    sm_<major><minor>a (sm_90a). ffi/common.cc's DeviceArch is the same rule."""
    if major == 10:
        return "sm_100f"
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def name_prefix(kind: str, arch: str) -> str:
    """How the name of every variant of one kind and arch begins ("fwd_sm90a_")."""
    return f"{kind}_{arch.replace('_', '')}_"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: a (kind, arch) kernel class built for one problem class and tuning.

    `tuning` names a set of kernel settings: "default" is what most calls run; the arch's menu
    names the others (its TUNINGS, reached through its ROUTES), and benchmarks/ablations.py its
    experiments, built into a development library of their own. `segments`: the kernel reads
    segment ids (a row sees only the keys of its own id) and skips the key blocks that share
    none with a tile; the custom calls that pass segment ids run these. `mask_array`: a
    segments kernel that also reads a boolean mask's bits (the calls that pass them too).
    """

    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    softcap: bool
    kind: str = "fwd"
    tuning: str = "default"
    segments: bool = False
    mask_array: bool = False

    def __post_init__(self):
        if self.mask_array and not self.segments:
            raise ValueError(f"a mask_array variant is a segments variant: {self!r}")
        if (self.dtype not in DTYPES or self.mask not in MASKS or self.kind not in KINDS
                or not self.tuning.isidentifier() or not self.arch.startswith("sm_")):
            raise ValueError(f"not a valid variant: {self!r}")

    @property
    def name(self) -> str:
        """A C identifier: the export name, function prefix and dispatch key of this variant."""
        mask = "" if self.mask == "none" else f"_{self.mask}"
        softcap = "_softcap" if self.softcap else ""
        segments = "_boolmask" if self.mask_array else "_segments" if self.segments else ""
        tuning = "" if self.tuning == "default" else f"_t{self.tuning}"
        return (f"{name_prefix(self.kind, self.arch)}{self.dtype}_d{self.head_dim}_dv{self.head_dim_v}"
                f"{mask}{softcap}{segments}{tuning}")

    def to_json(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Route:
    """Calls of `kind`, `mask` and `head_dim` that meet every condition run the `tuning`
    variant of their problem class (when the library holds it) instead of the default.

    Conditions (0 / None: none):
      min_rows, max_rows: seqlen_q, as the kernel sees it (GQA-packed rows), at least / at most
        this;
      max_len: max(seqlen_q, seqlen_k) at most this;
      dense: not a ragged batch (the narrowed blocks below assume one length for every entry);
      diagonal_block: the diagonal runs along blocks of this many rows and keys, within the
        keys: its offset (seqlen_k − seqlen_q, or 0 when top-left) is a multiple of the block,
        so each query tile's highest visited key block is the one the diagonal crosses
        (`diagonal_on_blocks`);
      tail_tile_n, tail_keys: more than one tail_tile_n-key block, and at most tail_keys keys
        in the last;
      softcap: only calls with (True) or without (False) softcap;
      mask_array: calls with a boolean mask's bits (True: the custom calls that pass them,
        whose variants the route's tuning then names) or without (False).
    """

    tuning: str
    mask: str
    head_dim: int
    kind: str = "fwd"
    min_rows: int = 0
    max_rows: int = 0
    max_len: int = 0
    dense: bool = False
    diagonal_block: int = 0
    tail_tile_n: int = 0
    tail_keys: int = 0
    softcap: bool | None = None
    mask_array: bool = False

    def fits(self, call: "Call") -> bool:
        if (call.kind, call.mask, call.head_dim) != (self.kind, self.mask, self.head_dim):
            return False
        if call.mask_array != self.mask_array:
            return False
        if self.softcap is not None and call.softcap != self.softcap:
            return False
        if self.min_rows and call.seqlen_q < self.min_rows:
            return False
        if self.max_rows and call.seqlen_q > self.max_rows:
            return False
        if self.max_len and max(call.seqlen_q, call.seqlen_k) > self.max_len:
            return False
        if self.dense and call.ragged:
            return False
        if self.diagonal_block and not diagonal_on_blocks(call, self.diagonal_block):
            return False
        if self.tail_tile_n:
            last_block_keys = call.seqlen_k - (call.seqlen_k - 1) // self.tail_tile_n * self.tail_tile_n
            if call.seqlen_k <= self.tail_tile_n or last_block_keys > self.tail_keys:
                return False
        return True

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Call:
    """A kernel call as the FFI handler sees it: the problem class and the buffers' shapes."""

    kind: str
    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    softcap: bool
    seqlen_q: int
    seqlen_k: int
    ragged: bool = False
    top_left: bool = False
    segments: bool = False
    mask_array: bool = False

    @property
    def diagonal_offset(self) -> int:
        return 0 if self.top_left else self.seqlen_k - self.seqlen_q

    def variant(self, tuning: str = "default") -> Variant:
        return Variant(self.arch, self.dtype, self.head_dim, self.head_dim_v, self.mask, self.softcap,
                       self.kind, tuning, self.segments, self.mask_array)


def diagonal_on_blocks(call: Call, block: int) -> bool:
    """Whether the diagonal runs along block x block tiles and every query tile's diagonal
    block holds keys: offset a multiple of `block`, and the last query tile's diagonal block
    (ceil(seqlen_q / block) − 1 + offset / block) no later than the last key block. Aligned
    bottom-right the second follows from the first; aligned top-left, query rows past the keys'
    last block would see a whole block that is not their diagonal."""
    offset = call.diagonal_offset
    if offset % block:
        return False
    return -(-call.seqlen_q // block) + offset // block <= -(-call.seqlen_k // block)


def mask_kind(causal: bool, window_left: int | None, window_right: int | None) -> str:
    """A window bound on either side makes the call "local" (causal folds into its right bound)."""
    if window_left is not None or window_right is not None:
        return "local"
    return "causal" if causal else "none"


def choose(call: Call, routes, compiled) -> Variant:
    """The variant that serves `call`: the first route that fits it and whose variant is
    compiled (`compiled`: variant names), else the default; the handler's rule (ffi/common.cc)."""
    for route in routes:
        if route.fits(call) and call.variant(route.tuning).name in compiled:
            return call.variant(route.tuning)
    return call.variant()


def class_variants(variant: Variant, routes, compiled) -> tuple[Variant, ...]:
    """The compiled variants of `variant`'s problem class that calls reach: its default and the
    tunings its arch's routes (`routes`, in order) send calls of the class to."""
    tunings = ["default"] + [
        route.tuning for route in routes
        if (route.kind, route.mask, route.head_dim, route.mask_array) == (variant.kind, variant.mask, variant.head_dim,
                                                                          variant.mask_array)
        and route.softcap in (None, variant.softcap)]
    found = (dataclasses.replace(variant, tuning=tuning) for tuning in dict.fromkeys(tunings))
    return tuple(v for v in found if v.name in compiled)


def serving_head_dims(head_dim: int, head_dim_v: int, compiled_pairs) -> tuple[int, int] | None:
    """The compiled (head_dim, head_dim_v) that serves a call at these dims, or None: the call's
    own pair when compiled, else the pair of least work per score (D + DV) with D >= head_dim
    and DV >= head_dim_v, whose kernels run the call zero-padded on the head-dim axes (a zero
    column of q and k adds nothing to q·kᵀ; one of v gives a zero column of out, sliced off)."""
    fits = [(d + dv, d, dv) for d, dv in compiled_pairs if d >= head_dim and dv >= head_dim_v]
    return min(fits)[1:] if fits else None


def dq_copies(max_keys_by_head_dim: dict, head_dim: int, seqlen_k: int, deterministic: bool) -> int:
    """The fp32 dQ accumulators (the backward workspace's leading dim) of a backward call: two
    for deterministic calls at the head dims and key counts the arch's menu names, else one."""
    if not deterministic:
        return 1
    return 2 if seqlen_k <= max_keys_by_head_dim.get(head_dim, 0) else 1
