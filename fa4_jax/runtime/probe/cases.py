"""A probe problem's arrays and reference, built once and shared by every variant that runs it.

The variants of one problem class (dtype, head dims, mask, softcap, segments, mask array: all
its tunings, forward and backward) that run the same problem share its inputs, its segment
operands and its reference (`case`, cached per problem). Inputs come from a fixed seed per
problem, so a verdict can be reproduced.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
import zlib

import ml_dtypes
import numpy as np

from fa4_jax.abi import routing
from fa4_jax.core.params import AttentionParams
from fa4_jax.runtime.probe import problems, reference
from fa4_jax.runtime.probe.problems import Problem

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


@dataclasses.dataclass(frozen=True)
class ProblemClass:
    """What a variant's inputs and reference depend on (not its kind nor its tuning)."""

    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str
    softcap: bool
    segments: bool
    mask_array: bool

    @classmethod
    def of(cls, variant: routing.Variant) -> "ProblemClass":
        return cls(variant.dtype, variant.head_dim, variant.head_dim_v, variant.mask, variant.softcap,
                   variant.segments, variant.mask_array)

    @property
    def numpy_dtype(self):
        return DTYPES[self.dtype]

    @property
    def factor(self) -> int:
        """The rule's factor: 3 with softcap, else 2 (docs/design.md)."""
        return 3 if self.softcap else 2

    @property
    def params(self) -> AttentionParams:
        """The call's semantics (a mask array's kernels see its rules folded into its bits: their
        problem class has no mask of its own)."""
        window = problems.WINDOW if self.mask == "local" else (None, None)
        return AttentionParams(softmax_scale=1 / math.sqrt(self.head_dim), causal=self.mask == "causal",
                               window_left=window[0], window_right=window[1],
                               softcap=problems.SOFTCAP if self.softcap else None)


def in_probe_order(variants) -> list[routing.Variant]:
    """`variants` with each problem class's variants together (they share cases): its forward
    ones, the default first, then its backward ones."""
    return sorted(variants, key=lambda v: (dataclasses.astuple(ProblemClass.of(v)), v.kind != "fwd",
                                           v.tuning != "default", v.tuning))


def segment_ids(seqlen_q: int, seqlen_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(query ids [1, sq], kv ids [1, sk]) int32: the probes' documents, then padding that
    matches nothing (-1 for queries, -2 for keys)."""
    ids = []
    for side, (length, no_match) in enumerate(((seqlen_q, -1), (seqlen_k, -2))):
        side_ids = np.full((1, length), no_match, np.int32)
        counts = [document[side] for document in problems.DOCUMENTS]
        side_ids[0, :sum(counts)] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        ids.append(side_ids)
    return tuple(ids)


def mask_array(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """The mask probe's bool [1, sq, sk]: the documents, and every fifth key shown to every row
    (so that no key block is one run of a tile's keys)."""
    q_ids, kv_ids = segment_ids(seqlen_q, seqlen_k)
    return (q_ids[:, :, None] == kv_ids[:, None, :]) | (np.arange(seqlen_k) % 5 == 0)


class Case:
    """One problem of one problem class: its inputs (`reference.Inputs`, NaN in a ragged batch's
    padding), the segment operands its kernels read (or None), and its reference, exact and low
    precision. Each is computed on first use, once, whichever thread asks first (the others wait
    for it)."""

    def __init__(self, problem_class: ProblemClass, problem: Problem):
        self.problem_class = problem_class
        self.problem = problem
        self.params = problem_class.params
        self._lock = threading.RLock()

    def _once(self, name: str, compute):
        with self._lock:
            if name not in self.__dict__:
                self.__dict__[name] = compute()
            return self.__dict__[name]

    @property
    def inputs(self) -> reference.Inputs:
        return self._once("_inputs", lambda: _inputs(self.problem_class, self.problem))

    @property
    def operands(self):
        return self._once("_operands", lambda: _segment_operands(self.problem_class, self.problem))

    def _passes(self) -> tuple[reference.Forward, reference.Forward]:
        """(exact, low-precision) forward passes."""
        return self._once("_forward_passes", lambda: (
            reference.forward(self.inputs, self.params),
            reference.forward(self.inputs, self.params, self.problem_class.numpy_dtype)))

    def forward(self):
        """((out, lse) exact, (out, lse) low precision)."""
        return tuple(p.results() for p in self._passes())

    def backward(self):
        """((dq, dk, dv) exact, (dq, dk, dv) low precision)."""
        return self._once("_gradients", lambda: tuple(
            reference.gradients(p, self.inputs, self.params) for p in self._passes()))


_cases: dict = {}
_cases_lock = threading.Lock()
# Cases kept: enough for the problems of the variants being prepared ahead and judged.
_KEPT_CASES = 32


def case(problem_class: ProblemClass, problem: Problem) -> Case:
    """The shared case of a problem (deterministic mode runs the same one); the most recently
    used are kept."""
    key = (problem_class, problem.inputs_key)
    with _cases_lock:
        found = _cases.pop(key, None) or Case(problem_class, problem.inputs_key)
        _cases[key] = found  # the most recent last
        while len(_cases) > _KEPT_CASES:
            del _cases[next(iter(_cases))]
        return found


def _seed(problem_class: ProblemClass, problem: Problem) -> int:
    return zlib.crc32(repr((problem_class, problem)).encode())


def _inputs(problem_class: ProblemClass, problem: Problem) -> reference.Inputs:
    rng = np.random.default_rng(_seed(problem_class, problem))
    b, sq, sk = problem.batch, problem.seqlen_q, problem.seqlen_k
    h, hk, d, dv = problems.HEADS_Q, problems.HEADS_KV, problem_class.head_dim, problem_class.head_dim_v
    dtype = problem_class.numpy_dtype

    def normal(shape):
        return rng.standard_normal(shape, np.float32).astype(dtype)

    q, k, v, d_out = normal((b, sq, h, d)), normal((b, sk, hk, d)), normal((b, sk, hk, dv)), normal((b, sq, h, dv))
    d_lse = rng.standard_normal((b, h, sq), np.float32) if problem.d_lse else None
    q_len, kv_len = np.full(b, sq), np.full(b, sk)
    if problem.lengths is not None:
        q_len, kv_len = (np.array(side) for side in zip(*problem.lengths))
        # What a ragged batch's padding holds reaches the kernels unzeroed (fa4_jax.runtime.dispatch).
        for x, lengths in ((q, q_len), (d_out, q_len), (k, kv_len), (v, kv_len)):
            x[np.arange(x.shape[1])[None, :] >= lengths[:, None]] = np.nan
    extra = None
    if problem_class.mask_array:
        extra = mask_array(sq, sk)
    elif problem_class.segments:
        q_ids, kv_ids = segment_ids(sq, sk)
        extra = q_ids[:, :, None] == kv_ids[:, None, :]
    return reference.Inputs(q, k, v, d_out, d_lse, q_len, kv_len, extra)


_jax_lock = threading.Lock()


def _segment_operands(problem_class: ProblemClass, problem: Problem):
    """The segments kernels' operands (ids and span tables, fa4_jax.runtime.segments), or the mask-array
    kernels' (those and the bits, fa4_jax.runtime.mask_bits), as the dispatch builds them for a dense
    call; None for the other variants. numpy int32 arrays."""
    if not problem_class.segments:
        return None
    with _jax_lock:
        return _operands_of_shape(problem_class.mask_array, problem_class.params, problem.seqlen_q,
                                  problem.seqlen_k)


@functools.lru_cache(maxsize=None)
def _operands_of_shape(masked: bool, params: AttentionParams, seqlen_q: int, seqlen_k: int):
    import jax.numpy as jnp

    from fa4_jax.runtime import mask_bits, segments

    if masked:
        folded = AttentionParams(softmax_scale=params.softmax_scale)  # the rules live in the bits
        operands = mask_bits.operands(jnp.asarray(mask_array(seqlen_q, seqlen_k)), folded, None,
                                      seqlen_q, seqlen_k, batch=1)
    else:
        operands = segments.operands(tuple(jnp.asarray(ids) for ids in segment_ids(seqlen_q, seqlen_k)))
    return tuple(np.asarray(x, np.int32) for x in operands)
