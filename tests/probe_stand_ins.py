"""Stand-ins for the GPU side of the probes (fa4_jax.runtime.probe), for CPU tests.

`StandInDevice` plays `fa4_jax.runtime.probe.device.Device`: its "kernels" compute what a variant should
from the launch alone (the Fa4Args scalars and operands of `calls.KernelCall`, as a kernel sees
them), in float64, and return it in the results' dtypes; `flaw` makes them wrong in one way.
So a judge that passes them checks the launch's operands and scalars as much as the comparison.

`fake_child.py` beside this file plays the probe process.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from fa4_jax.aot import menu
from fa4_jax.core.params import AttentionParams
from fa4_jax.runtime.probe import reference

FAKE_CHILD = [sys.executable, os.path.join(os.path.dirname(__file__), "fake_child.py")]
_VARIANTS = {v.name: v for v in menu.MENU}


def _unpack_bits(words: np.ndarray, seqlen_k: int) -> np.ndarray:
    """int32 [b, sq, W] -> bool [b, sq, seqlen_k] (fa4_jax.runtime.mask_bits' packing)."""
    bits = (words.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :seqlen_k].astype(bool)


def kernel_inputs(variant, call, flaw: str | None = None):
    """(reference.Inputs, AttentionParams) as `variant`'s kernel reads `call`."""
    x, s = call.inputs, call.scalars
    b, seqlen_q, seqlen_k = s["b"], s["seqlen_q"], s["seqlen_k"]
    ragged = s["b_lengths"] > 0 and flaw != "ignores lengths"
    q_len = x["seq_used_q"] if ragged else np.full(b, seqlen_q)
    kv_len = x["seq_used_k"] if ragged else np.full(b, seqlen_k)
    extra = None
    if s.get("b_mask", 0):
        extra = _unpack_bits(x["mask_bits"], seqlen_k)
    elif s.get("b_segments", 0) and flaw != "ignores segments":
        extra = x["q_segment_ids"][:, :, None] == x["kv_segment_ids"][:, None, :]
    window = {"none": {}, "causal": {"causal": True},
              "local": {"window_left": s["window_left"], "window_right": s["window_right"]}}[variant.mask]
    softcap = s["softcap"] or None
    params = AttentionParams(softmax_scale=s["softmax_scale"], softcap=None if flaw == "ignores softcap" else softcap,
                             top_left=bool(s["top_left"]), **window)
    d_lse = x.get("d_lse") if s.get("b_dlse", 0) else None
    inputs = reference.Inputs(x["q"], x["k"], x["v"], x.get("d_out"), d_lse, q_len, kv_len, extra)
    return inputs, params


class StandInDevice:
    """flaw: None (correct), "ignores lengths" (reads a ragged batch's NaN padding),
    "ignores softcap", "ignores segments", "skips a row" (leaves one row unwritten: NaN),
    "lse in log2", "slightly off" (out or dq scaled by 1.03)."""

    def __init__(self, flaw: str | None = None):
        self.flaw = flaw
        self.loaded, self.runs = [], []

    def load(self, name: str) -> None:
        self.loaded.append(name)

    def run(self, name: str, call) -> dict:
        variant = _VARIANTS[name]
        self.runs.append((name, call))
        inputs, params = kernel_inputs(variant, call, self.flaw)
        fwd = reference.forward(inputs, params)
        if variant.kind == "fwd":
            out, lse = fwd.results()
            results = {"out": out, "lse": lse / np.log(2) if self.flaw == "lse in log2" else lse}
        else:
            results = dict(zip(("dq", "dk", "dv"), reference.gradients(fwd, inputs, params)))
        first = "out" if variant.kind == "fwd" else "dq"
        if self.flaw == "slightly off":
            results[first] = results[first] * 1.03
        if self.flaw == "skips a row":
            results[first] = results[first].copy()
            results[first][0, -1] = np.nan
        return {k: np.asarray(results[k]).astype(dtype) for k, (_, dtype) in call.results.items()}
