"""The probes' reference in numpy: attention and its gradients with fa4_jax's semantics, exact
(float64, `ref`) and as the JAX reference computes it in the input dtype (`lowp`), the rule's
two yardsticks (fa4_jax.core.numerics).

Semantics (fa4_jax.fallbacks.reference, README's API): scores = q·kᵀ · scale, then softcap c·tanh(s/c);
query head i reads kv head i // (heads_q / heads_kv); in batch entry b only rows i < q_len[b] and
keys j < kv_len[b] exist, and the causal and window masks align to the entry's bottom-right
corner (offset kv_len − q_len) or, top_left, to its top-left (offset 0); `extra` (segment ids,
a mask array) hides more pairs. A row that sees no key has out 0, lse −inf (natural log) and no
gradient; what the padding holds, NaN included, is never read.

The low-precision twin rounds where `fa4_jax.fallbacks.reference.dense_attention` in that dtype rounds:
each matmul's fp32-accumulated result, the scale, each step of the softcap and the
probabilities fed to P·V; the softmax statistics stay fp32. Its gradients round where JAX's VJP
of that function does: each matmul's result, and the scores' cotangent as it re-enters the
dtype. Arrays are numpy; bfloat16 is ml_dtypes'.

Shapes: q [b, sq, hq, d], k [b, sk, hk, d], v [b, sk, hk, dv], d_out [b, sq, hq, dv], d_lse
[b, hq, sq] or None; out [b, sq, hq, dv], lse [b, hq, sq], dq, dk, dv like q, k, v (float64 or
float32 arrays).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from fa4_jax.core.params import AttentionParams


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One problem's arrays (q, k, v, d_out in the input dtype, d_lse float32 or None), its
    valid lengths (int [b] each) and the pairs it hides beyond the masks (bool [b, sq, sk] or
    None)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d_out: np.ndarray
    d_lse: np.ndarray | None
    q_len: np.ndarray
    kv_len: np.ndarray
    extra: np.ndarray | None = None


def visible(inputs: Inputs, params: AttentionParams) -> np.ndarray:
    """Bool [b, sq, sk]: which (row, key) pairs take part in the softmax (the rules and lengths by
    fa4_jax.core.visibility's one definition, on numpy arrays)."""
    q_len, kv_len = (np.asarray(x)[:, None, None] for x in (inputs.q_len, inputs.kv_len))
    seen = params.rules.band(np.arange(inputs.q.shape[1]), np.arange(inputs.k.shape[1]), q_len, kv_len)
    return seen if inputs.extra is None else seen & inputs.extra


class _Precision:
    """Exact (lowp None: float64, nothing rounded) or the twin in `lowp` (float32 arithmetic,
    rounded to lowp where the JAX reference rounds)."""

    def __init__(self, lowp=None):
        self.lowp = lowp
        self.work = np.float64 if lowp is None else np.float32

    def round(self, x):
        return x if self.lowp is None else x.astype(self.lowp).astype(np.float32)

    def scalar(self, x):
        return self.round(np.asarray(x, self.work))

    def matmul(self, a, b):
        """a @ b accumulated in the working precision, the result rounded. Contiguous operands:
        numpy's matmul of a transposed view is many times slower."""
        return self.round(np.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b)))


@dataclasses.dataclass
class Forward:
    """One forward pass in one precision, by kv head with the g = hq / hk query heads of its
    group stacked as rows: probabilities [b, hk, g·sq, sk] (`probs` unrounded, `probs_used` as
    P·V reads them), tanh of the capped scores (or None), out [b, hk, g·sq, dv], lse
    [b, hk, g·sq], and the zero-padded operands q [b, hk, g·sq, d], k [b, hk, sk, d],
    v [b, hk, sk, dv] in the working dtype."""

    precision: _Precision
    seqlen_q: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: np.ndarray
    tanh: np.ndarray | None
    probs: np.ndarray
    probs_used: np.ndarray
    out: np.ndarray
    lse: np.ndarray

    def results(self) -> tuple[np.ndarray, np.ndarray]:
        """(out [b, sq, hq, dv], lse [b, hq, sq])."""
        b, hk, rows, _ = self.out.shape
        return _heads_last(self.out, self.seqlen_q), self.lse.reshape(b, hk * rows // self.seqlen_q, self.seqlen_q)


def _zero_padding(x, lengths, work):
    """x [b, s, h, d] in `work`, rows past each entry's length zeroed (NaN there is never read)."""
    if (np.asarray(lengths) >= x.shape[1]).all():
        return x.astype(work)
    rows = np.arange(x.shape[1])[None, :, None, None] < np.asarray(lengths)[:, None, None, None]
    return np.where(rows, x.astype(work), 0)


def _group_rows(x, heads_kv):
    """[b, s, hq, d] -> [b, hk, g·s, d]: each kv head's query heads stacked as rows."""
    b, s, hq, d = x.shape
    grouped = x.reshape(b, s, heads_kv, hq // heads_kv, d).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(grouped).reshape(b, heads_kv, -1, d)


def _heads_last(x, seqlen):
    """The inverse of `_group_rows`: [b, hk, g·s, d] -> [b, s, hq, d]."""
    b, hk, rows, d = x.shape
    return x.reshape(b, hk, rows // seqlen, seqlen, d).transpose(0, 3, 1, 2, 4).reshape(b, seqlen, -1, d)


def _by_kv_head(x):
    """[b, s, hk, d] -> [b, hk, s, d]."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _per_query_head(x, groups, seen):
    """x [b, hk, g·sq, sk] as [b, hk, g, sq, sk], beside seen [b, sq, sk] as [b, 1, 1, sq, sk]."""
    b, hk, rows, sk = x.shape
    return x.reshape(b, hk, groups, rows // groups, sk), seen[:, None, None]


def forward(inputs: Inputs, params: AttentionParams, lowp=None) -> Forward:
    """The forward pass, exact (lowp None) or as the JAX reference computes it in `lowp`."""
    p = _Precision(lowp)
    b, sq, hq, _ = inputs.q.shape
    heads_kv = inputs.k.shape[2]
    q = _group_rows(_zero_padding(inputs.q, inputs.q_len, p.work), heads_kv)
    k = _by_kv_head(_zero_padding(inputs.k, inputs.kv_len, p.work))
    v = _by_kv_head(_zero_padding(inputs.v, inputs.kv_len, p.work))
    scale = p.scalar(params.softmax_scale)
    scores = p.round(p.matmul(q, k.swapaxes(-1, -2)) * scale)
    tanh = None
    if params.softcap is not None:
        cap = p.scalar(params.softcap)
        tanh = p.round(np.tanh(p.round(scores / cap)))
        scores = p.round(cap * tanh)
    by_head, seen = _per_query_head(scores, hq // heads_kv, visible(inputs, params))
    scores = np.where(seen, by_head, -np.inf).reshape(scores.shape)
    live = np.broadcast_to(seen, by_head.shape).reshape(scores.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        row_max = scores.max(axis=-1, keepdims=True)
        shift = np.where(np.isfinite(row_max), row_max, 0)
        total = np.exp(scores - shift).sum(axis=-1, keepdims=True)
        lse = np.where(total > 0, shift + np.log(total), -np.inf)
        probs = np.where(live & (total > 0), np.exp(scores - lse), 0).astype(p.work)
    probs_used = p.round(probs)
    out = p.matmul(probs_used, v)
    return Forward(p, sq, q, k, v, scale, tanh, probs, probs_used, out, lse[..., 0])


def gradients(fwd: Forward, inputs: Inputs, params: AttentionParams):
    """(dq, dk, dv) of `fwd`'s pass for the cotangents inputs.d_out (and inputs.d_lse of lse,
    when not None), in `fwd`'s precision. The query heads of a group add into their kv head's
    dk and dv within one matmul, rounded once."""
    p = fwd.precision
    heads_kv = inputs.k.shape[2]
    d_out = _group_rows(_zero_padding(inputs.d_out, inputs.q_len, p.work), heads_kv)
    dv = p.matmul(fwd.probs_used.swapaxes(-1, -2), d_out)
    d_probs = p.matmul(d_out, fwd.v.swapaxes(-1, -2))
    row = (fwd.probs * d_probs).sum(axis=-1, keepdims=True)
    if inputs.d_lse is not None:
        b, hq, sq = inputs.d_lse.shape
        row = row - inputs.d_lse.astype(p.work).reshape(b, heads_kv, hq // heads_kv * sq, 1)
    d_scores = p.round(fwd.probs * (d_probs - row))
    if fwd.tanh is not None:
        d_scores = p.round(d_scores * p.round(1 - p.round(fwd.tanh * fwd.tanh)))
    d_scores = p.round(d_scores * fwd.scale)
    dq = _heads_last(p.matmul(d_scores, fwd.k), fwd.seqlen_q)
    dk = p.matmul(d_scores.swapaxes(-1, -2), fwd.q)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
