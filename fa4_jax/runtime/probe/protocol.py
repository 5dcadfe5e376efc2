"""What the probe process and its parent say to each other, one line each on the child's stdout:

    FA4_PROBE DEVICE {"name": ..., "major": 9, ...}     the device it opened (or {"error": ...})
    FA4_PROBE START <variant>                           before it touches the variant
    FA4_PROBE RESULT {"variant": ..., "verdict": ...}   after

and the verdicts:

    pass          every problem within the numerics rule
    wrong         a result outside it (the worst error and bound in `details`)
    hang          (the parent's) the variant started and did not finish within the timeout
    fault         a CUDA error at launch or while it ran (the child then exits: its context is
                  lost), or the child died while running it
    load-error    its module does not load on this GPU
    inconclusive  not a property of the kernel (no device, out of memory, exclusive compute
                  mode, no probe problem for it): not kept, the next process tries again

The job (the parent's, one JSON line on the child's stdin): {"library": path, "device": ordinal,
"variants": [names]}.
"""
from __future__ import annotations

import dataclasses
import json

DEVICE = "FA4_PROBE DEVICE "
START = "FA4_PROBE START "
RESULT = "FA4_PROBE RESULT "

VERDICTS = ("pass", "wrong", "hang", "fault", "load-error", "inconclusive")
# The verdicts that hold for the library, GPU and driver they were reached on.
KEPT = ("pass", "wrong", "hang", "fault", "load-error")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One variant judged: its verdict, why (None for a pass), how long it took, and what the
    verdict rests on (problems run, the worst error against its bound)."""

    variant: str
    verdict: str
    reason: str | None = None
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"not a verdict: {self.verdict!r} (one of {VERDICTS})")

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def kept(self) -> bool:
        return self.verdict in KEPT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Verdict":
        return cls(**json.loads(text))

    def line(self) -> str:
        """One line of a report: `PASS  name  (3 problems, 0.42 s)`."""
        shown = {"pass": "PASS", "wrong": "FAIL"}.get(self.verdict, self.verdict.upper())
        return f"{shown:12s} {self.variant}  ({self.seconds:.2f} s)" + (f": {self.reason}" if self.reason else "")
