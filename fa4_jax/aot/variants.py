"""The menu of ahead-of-time compiled forward variants, and the rule that picks one for a call.

The selection rule is mirrored in ffi/fa4_fwd.cc (`SelectMask`); change both together.
"""
from __future__ import annotations

import dataclasses
import itertools

# Every arch the build plumbing knows. sm_100a has no kernel yet, so the menu does not list it.
ARCHES = ("sm_90a", "sm_100a")
DTYPES = ("bf16", "fp16")
# (head_dim, head_dim_v); (192, 128) is DeepSeek's shape. Each needs a TILE_CONFIGS entry.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
MASKS = ("none", "causal", "local")


@dataclasses.dataclass(frozen=True)
class Variant:
    arch: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    softcap: bool

    def __post_init__(self):
        if self.arch not in ARCHES or self.dtype not in DTYPES or self.mask not in MASKS:
            raise ValueError(f"not a valid variant: {self!r}")

    @property
    def name(self) -> str:
        """A C identifier: the export name, function prefix and dispatch key of this variant."""
        arch = self.arch.replace("_", "")
        mask = "" if self.mask == "none" else f"_{self.mask}"
        softcap = "_softcap" if self.softcap else ""
        return f"fwd_{arch}_{self.dtype}_d{self.head_dim}_dv{self.head_dim_v}{mask}{softcap}"

    def to_json(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self)}


MENU: tuple[Variant, ...] = tuple(
    Variant("sm_90a", dtype, d, dv, mask, softcap)
    for dtype, (d, dv), mask, softcap in itertools.product(DTYPES, HEAD_DIMS, MASKS, (False, True))
)


def mask_kind(causal: bool, window_left: int | None, window_right: int | None) -> str:
    """A window bound on either side makes the call "local" (causal folds into its right bound)."""
    if window_left is not None or window_right is not None:
        return "local"
    return "causal" if causal else "none"


def select(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window_left: int | None,
           window_right: int | None, softcap: bool, arch: str = "sm_90a") -> Variant:
    """The variant that serves a call; it may be absent from MENU (callers check membership)."""
    return Variant(arch, dtype, head_dim, head_dim_v, mask_kind(causal, window_left, window_right),
                   bool(softcap))
