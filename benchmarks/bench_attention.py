"""Time fa4_jax.attention against its JAX peers in one process, on the same inputs, with one timer.

Peers: fa4_jax (implementation="cute"), jax.nn.dot_product_attention with implementation="cudnn"
and "xla", and the Pallas Mosaic GPU kernel (jax.experimental.pallas.ops.gpu.attention_mgpu, fp16).
fa4_jax's own rows: "fa4_jax_det" (deterministic=True; forward+backward only) and, with
--fa4-tunings A,B, "fa4_jax:A" ... (the forward kernel under a named tuning of
benchmarks/ablations.py, for ablations), and with --fa4-bwd-tunings A,B, "fa4_jax_bwd:A" and
"fa4_jax_bwd_det:A" (forward+backward only: the default forward kernel, then the backward kernel
under tuning A, default and deterministic mode; "default" names the shipped kernel through the
same path, the like-for-like baseline). Tuning rows run on the development library
(`python -m benchmarks.ablations build`; skipped without it). "upstream" is FA4 upstream's Hopper
forward and backward (flash-attn-4) exported ahead of time into a library by
scripts/upstream_peer/build.py and named by $FA4_UPSTREAM_LIB (skipped without it): upstream's
kernels under this timer, beside docs/anchors.md's torch figures for them. Only the JAX peers count
as "best peer".
Grid (docs/anchors.md): batch·seqlen = 16384 tokens, heads = 2048 / head_dim, head dims 64/128/256,
seqlen 1024/4096/16384, causal and not, forward and forward+backward. Head dim 192 runs with
value head dim 128 (DeepSeek's shape, the library's one d ≠ dv variant; HEAD_DIM_V).

Run on the H200 from the repository root (one command; it stops starting measurements after
--time-budget-s = 420 s, and `timeout` makes it write what it has and exit by 8 minutes regardless):

    timeout -k 30 450 python -m benchmarks.bench_attention --out .bench_out

and on any machine, on the CPU with tiny shapes, to test the harness itself:

    python -m benchmarks.bench_attention --dry-run

Timer (the one docs/anchors.md used for its JAX peers): a jit'd step is called `calls` times in a Python
loop, dispatches queued asynchronously and rotating between two input sets, then the last result is
blocked on; the wall time over `calls` is one sample, and the figure is the median of `repeats`
samples. The first two calls and then --warmup-s (0.3 s) of calls are warm-up and are excluded (the
GPU's clocks drop while the next peer compiles); the first call's time minus a warm call's is
reported as compile time. Dispatch is counted, so short calls (1k tokens) read a few percent low
against CUDA-event timing, exactly as in docs/anchors.md.

FLOPs: forward 2·b·h·sq·sk·(d + dv), halved when causal; forward+backward counts 3.5× the
forward.

Ceiling: before the grid, a bf16 8192³ matmul under the same timer (--ceiling-size), docs/anchors.md's
own ceiling (732 TF/s in its run), printed and kept in results.json's meta: the H200 runs
attention at its power limit, and a day's sustained clock moves every figure together.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib
import json
import os
import signal
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import anchors

MODES = ("fwd", "fwd_bwd")
# The forward+backward pass costs 3.5 forwards: the backward does 2.5 forwards' worth of matmuls.
FWD_BWD_FLOP_FACTOR = 3.5
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
INPUT_SETS = 2  # rotate between two input sets so no call finds its inputs already in L2
# Value head dim by head dim where they differ (kernels/sm90/menu.py HEAD_DIMS).
HEAD_DIM_V = {192: 128}
# Head dims scripts/upstream_peer/ exports FA4 upstream's forward and backward for (upstream's own
# tile choice).
UPSTREAM_HEAD_DIMS = (64, 128, 256)

# Defaults of the two ways to run: the docs/anchors.md grid on the H200, and tiny shapes on the CPU.
PRESETS = {
    "h200": dict(
        tokens=16384, hidden=2048, head_dims=(64, 128, 256), seqlens=(1024, 4096, 16384),
        calls=20, repeats=5, warmup_s=0.3, max_xla_seqlen=4096, fa4_implementation="cute",
        ceiling_size=8192,
    ),
    # max_xla_seqlen is below the largest seqlen so that the skip path runs too; fa4_jax uses its
    # pure-JAX reference backend because the "cute" kernels need a GPU.
    "dry_run": dict(
        tokens=512, hidden=256, head_dims=(64, 128), seqlens=(128, 256),
        calls=3, repeats=2, warmup_s=0.0, max_xla_seqlen=128, fa4_implementation="reference",
        ceiling_size=128,
    ),
}


class Skip(Exception):
    """A peer does not support this case; the message says why. Not a failure."""


class OutOfTime(Exception):
    """The time budget ran out, or the process was asked to stop (SIGTERM)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    tokens: int
    hidden: int
    dtype: str
    calls: int
    repeats: int
    max_call_s: float
    max_case_s: float
    warmup_s: float
    max_xla_seqlen: int
    fa4_implementation: str

    @property
    def matches_anchors(self) -> bool:
        """docs/anchors.md figures compare only with runs of its own shapes and dtype."""
        return (self.tokens, self.hidden, self.dtype) == (16384, 2048, "bf16")


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int

    @property
    def head_dim_v(self) -> int:
        return HEAD_DIM_V.get(self.head_dim, self.head_dim)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """q's and k's shape."""
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        """v's, the output's and its cotangent's shape."""
        return (self.batch, self.seqlen, self.heads, self.head_dim_v)

    @property
    def flops(self) -> float:
        # Q·Kᵀ costs 2·s²·d per head, P·V 2·s²·dv.
        forward = 2 * self.batch * self.heads * self.seqlen * self.seqlen * (self.head_dim + self.head_dim_v)
        if self.causal:
            forward /= 2
        return forward * (FWD_BWD_FLOP_FACTOR if self.mode == "fwd_bwd" else 1)

    def label(self) -> str:
        dims = (f"{self.head_dim}" if self.head_dim_v == self.head_dim
                else f"{self.head_dim}/{self.head_dim_v}")
        return (f"{self.mode:7s} d={dims:<7s} s={self.seqlen:<5d} "
                f"{'causal' if self.causal else 'full  '} b={self.batch} h={self.heads}")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a peer on a case: its tuning config, the attention function, its dtype."""
    config: dict
    attend: Callable
    dtype: object


# ---------------------------------------------------------------------------------------------
# Peers. Each takes (case, settings) and returns candidates; the fastest one is reported.


def _fa4_jax():
    try:
        return importlib.import_module("fa4_jax")
    except Exception as error:  # the package is being written; peers still run without it
        raise Skip(f"fa4_jax not importable: {type(error).__name__}: {error}") from None


def fa4_jax_candidates(case: Case, settings: Settings, deterministic: bool = False
                       ) -> list[Candidate]:
    attention = _fa4_jax().attention
    implementation = settings.fa4_implementation

    def attend(q, k, v):
        return attention(q, k, v, causal=case.causal, deterministic=deterministic,
                         implementation=implementation)

    config = {"implementation": implementation, "deterministic": deterministic}
    return [Candidate(config, attend, DTYPES[settings.dtype])]


def fa4_jax_deterministic_candidates(case: Case, settings: Settings) -> list[Candidate]:
    if case.mode == "fwd":
        raise Skip("deterministic mode changes the backward only")
    return fa4_jax_candidates(case, settings, deterministic=True)


def fa4_jax_tuning_candidates(tuning: str):
    """The forward kernel under a named tuning of benchmarks/ablations.py (an ablation row),
    through the development library's tuning targets."""
    def candidates(case: Case, settings: Settings) -> list[Candidate]:
        _fa4_jax()
        from fa4_jax.runtime import dispatch

        if case.mode != "fwd":
            raise Skip("tunings are forward ablations")
        library, params = _require_ablation(case, settings, "fwd", tuning, deterministic=False)

        def attend(q, k, v):
            return dispatch.forward(q, k, v, params, library=library, tuning=tuning)[0]

        return [Candidate({"tuning": tuning}, attend, DTYPES[settings.dtype])]

    return candidates


def _require_ablation(case: Case, settings: Settings, kind: str, tuning: str, deterministic: bool):
    """(the development library, the call's params), or a skip (not a failure) naming why the
    row cannot run: no library, no such variant (ablations are compiled at some head dims
    only), or a narrowed tuning that would cut this call's keys short."""
    from fa4_jax.abi import routing
    from fa4_jax.api.attention import attention_params
    from fa4_jax.runtime import device, dispatch, ffi

    from benchmarks import ablations

    try:
        library = ablations.library()
    except ffi.LibraryUnavailable as error:
        raise Skip(f"{error} (python -m benchmarks.ablations build)") from None
    dtype = DTYPES[settings.dtype]
    q = jax.ShapeDtypeStruct(case.shape, dtype)
    v = jax.ShapeDtypeStruct(case.value_shape, dtype)
    try:  # implementation="cute" refuses a call no kernel serves, naming the reason
        params = attention_params(q, q, v, causal=case.causal, deterministic=deterministic,
                                  implementation="cute")
    except ValueError as error:
        raise Skip(str(error)) from None
    arch, reason = device.device_arch()
    if reason is not None:
        raise Skip(reason)
    call = dispatch.kernel_call(q, q, v, params, kind, arch)
    if call.variant(tuning).name not in library.compiled:
        raise Skip(f"{call.variant(tuning).name} is not in {library.path}")
    reason = ablations.narrowing_mismatch(tuning, call)
    if reason is not None:
        raise Skip(reason)
    return library, params


def fa4_jax_bwd_tuning_candidates(tuning: str, deterministic: bool):
    """Forward+backward with the backward kernel under a named tuning: a custom_vjp whose forward
    is the default forward kernel and whose backward runs the tuning, both through the
    development library's tuning targets ("default" is the like-for-like baseline)."""
    def candidates(case: Case, settings: Settings) -> list[Candidate]:
        _fa4_jax()
        from fa4_jax.runtime import dispatch

        if case.mode != "fwd_bwd":
            raise Skip("backward tunings are timed forward+backward")
        library, params = _require_ablation(case, settings, "bwd", tuning, deterministic)
        copies = 1 if tuning == "det_one_copy" else None
        forward = functools.partial(dispatch.forward, params=params, library=library)
        backward = functools.partial(dispatch.backward, params=params, library=library,
                                     tuning=tuning, copies=copies)

        @jax.custom_vjp
        def attend(q, k, v):
            return forward(q, k, v)[0]

        def attend_fwd(q, k, v):
            out, lse = forward(q, k, v)
            return out, (q, k, v, out, lse)

        def attend_bwd(residuals, d_out):
            q, k, v, out, lse = residuals
            return backward(q, k, v, out, lse, d_out, None)

        attend.defvjp(attend_fwd, attend_bwd)
        config = {"tuning": tuning, "deterministic": deterministic}
        return [Candidate(config, attend, DTYPES[settings.dtype])]

    return candidates


def with_value_padded(attend: Callable) -> Callable:
    """attend for a v narrower than q and k, by zero-padding v to their head dim and slicing the
    output back: what a JAX user does for d192/dv128, since jax.nn.dot_product_attention and
    attention_mgpu take one head dim. The wasted P·V work on the zeros is not counted in the
    case's FLOPs."""
    def padded(q, k, v):
        head_dim_v = v.shape[-1]
        if head_dim_v == q.shape[-1]:
            return attend(q, k, v)
        widths = [(0, 0)] * (v.ndim - 1) + [(0, q.shape[-1] - head_dim_v)]
        return attend(q, k, jnp.pad(v, widths))[..., :head_dim_v]

    return padded


def dot_product_attention_candidates(implementation: str):
    def candidates(case: Case, settings: Settings) -> list[Candidate]:
        if implementation == "xla" and case.seqlen > settings.max_xla_seqlen:
            raise Skip(f"XLA materialises the scores: not run above seqlen "
                       f"{settings.max_xla_seqlen} (OOM or minutes, as in docs/anchors.md)")

        @with_value_padded
        def attend(q, k, v):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=case.causal, implementation=implementation)

        return [Candidate({"implementation": implementation}, attend, DTYPES[settings.dtype])]

    return candidates


def mgpu_configs(case: Case) -> list[dict]:
    """TuningConfig arguments to try, from the shapes JAX's own tests run for this kernel.

    At head dim 256 only 64-wide blocks fit in shared memory; the backward runs two compute
    warpgroups up to head dim 128 and one above. Configs that exceed shared memory fail at
    compile time and the next one is used.
    """
    forward_blocks = [(64, 128), (64, 64)] if case.head_dim <= 128 else [(64, 64)]
    if case.mode == "fwd":
        return [dict(block_q=q, block_kv=kv, max_concurrent_steps=2, causal=case.causal)
                for q, kv in forward_blocks]
    block_q, block_kv = forward_blocks[0]
    compute_wgs = 2 if case.head_dim <= 128 else 1
    # (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv)
    backward_blocks = [(64, 128, 128, 64), (64, 64, 64, 64)]
    return [dict(block_q=block_q, block_kv=block_kv, max_concurrent_steps=2, causal=False,
                 compute_wgs_bwd=compute_wgs, block_q_dq=q_dq, block_kv_dq=kv_dq,
                 block_q_dkv=q_dkv, block_kv_dkv=kv_dkv)
            for q_dq, kv_dq, q_dkv, kv_dkv in backward_blocks]


def mgpu_candidates(case: Case, settings: Settings) -> list[Candidate]:
    if case.mode == "fwd_bwd" and case.causal:
        raise Skip("attention_mgpu has no causal backward")
    if jax.default_backend() not in ("gpu", "cuda"):
        raise Skip("Mosaic GPU needs an sm_90a GPU")
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    def candidate(config: dict) -> Candidate:
        tuning = attention_mgpu.TuningConfig(**config)
        # The kernel keeps its tiles in fp16 whatever the input dtype, so it is fed fp16.
        return Candidate(
            config, with_value_padded(lambda q, k, v: attention_mgpu.attention(q, k, v, tuning)),
            jnp.float16)

    return [candidate(config) for config in mgpu_configs(case)]


UPSTREAM_LIB_ENV = "FA4_UPSTREAM_LIB"


@functools.cache
def upstream_library(path: str) -> ctypes.CDLL:
    """The library, its targets registered: fa4_upstream_fwd, and fa4_upstream_bwd where the
    library has it (one built before the backward was exported has not)."""
    library = ctypes.cdll.LoadLibrary(path)
    for target, prefix in (("fa4_upstream_fwd", "UpstreamFwd"),
                           ("fa4_upstream_bwd", "UpstreamBwd")):
        if hasattr(library, f"{prefix}Execute"):
            jax.ffi.register_ffi_target(
                target,
                {"instantiate": jax.ffi.pycapsule(getattr(library, f"{prefix}Instantiate")),
                 "execute": jax.ffi.pycapsule(getattr(library, f"{prefix}Execute"))},
                platform="CUDA", api_version=1)
    return library


def upstream_forward(q, k, v, causal: bool):
    """(out, lse [b, h, sq] f32) from upstream's FlashAttentionForwardSm90."""
    batch, seqlen, heads, head_dim = q.shape
    call = jax.ffi.ffi_call(
        "fa4_upstream_fwd",
        (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype),
         jax.ShapeDtypeStruct((batch, heads, seqlen), jnp.float32)))
    return call(q, k, v, causal=causal, softmax_scale=np.float32(head_dim ** -0.5))


def _upstream_backward(library: ctypes.CDLL, q, k, v, out, lse, d_out, causal: bool):
    """(dq, dk, dv) from upstream's backward: its preprocess, FlashAttentionBackwardSm90 and dQ
    postprocess kernels. The call also returns the fp32 workspaces upstream's _flash_attn_bwd
    allocates, shaped as it does (rows: seqlen_q rounded up to upstream's tile_m, which the
    library says), so that XLA owns them; they are dropped here."""
    batch, seqlen, heads, head_dim = q.shape
    tile_m = library.UpstreamBwdTileM(head_dim, causal)
    rows = -(-seqlen // tile_m) * tile_m
    accum_head_dim = library.UpstreamBwdAccumHeadDim(head_dim, causal)
    call = jax.ffi.ffi_call(
        "fa4_upstream_bwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((batch, heads, rows * accum_head_dim), jnp.float32),  # dq_accum
         jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32),  # dpsum
         jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32)))  # lse_log2
    dq, dk, dv, *_workspaces = call(q, k, v, out, d_out, lse, causal=causal,
                                    softmax_scale=np.float32(head_dim ** -0.5))
    return dq, dk, dv


def upstream_attention(library: ctypes.CDLL, causal: bool) -> Callable:
    """attend(q, k, v) -> out through upstream's forward, differentiable through upstream's
    backward: what flash_attn.cute.flash_attn_func is under torch autograd (the forward saves
    out and lse; no gradient flows into lse)."""
    @jax.custom_vjp
    def attention(q, k, v):
        return upstream_forward(q, k, v, causal)[0]

    def attention_fwd(q, k, v):
        out, lse = upstream_forward(q, k, v, causal)
        return out, (q, k, v, out, lse)

    def attention_bwd(residuals, d_out):
        return _upstream_backward(library, *residuals, d_out, causal)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def upstream_candidates(case: Case, settings: Settings) -> list[Candidate]:
    """FA4 upstream's Hopper forward and backward (flash-attn-4), exported ahead of time by
    scripts/upstream_peer/ into a library named by $FA4_UPSTREAM_LIB: upstream's kernels under our
    timer, in our process. Not a JAX peer (a JAX user cannot call it); the column says how far
    docs/anchors.md's torch figures for it are from what our timer reads."""
    path = os.environ.get(UPSTREAM_LIB_ENV)
    if not path:
        raise Skip(f"${UPSTREAM_LIB_ENV} is not set (scripts/upstream_peer/ builds the library)")
    if case.head_dim not in UPSTREAM_HEAD_DIMS:
        raise Skip(f"the upstream library holds kernels at head dims {UPSTREAM_HEAD_DIMS}")
    if not os.path.exists(path):
        raise Skip(f"${UPSTREAM_LIB_ENV} names {path}, which does not exist "
                   "(scripts/upstream_peer/ builds the library)")
    library = upstream_library(path)
    if case.mode == "fwd_bwd" and (not hasattr(library, "UpstreamBwdExecute")
                                   or library.UpstreamBwdTileM(case.head_dim, case.causal) < 0):
        raise Skip(f"{path} holds no upstream backward at head dim {case.head_dim}"
                   f"{' causal' if case.causal else ''} (rebuild it with scripts/upstream_peer/)")
    attend = upstream_attention(library, case.causal)
    return [Candidate({"library": os.path.basename(path)}, attend, DTYPES[settings.dtype])]


PEERS = {
    "fa4_jax": fa4_jax_candidates,
    "fa4_jax_det": fa4_jax_deterministic_candidates,
    "cudnn": dot_product_attention_candidates("cudnn"),
    "xla": dot_product_attention_candidates("xla"),
    "mgpu": mgpu_candidates,
    "upstream": upstream_candidates,
}
PEER_LABELS = {"cudnn": "JAX cuDNN", "xla": "JAX XLA", "mgpu": "Pallas MGPU (fp16)",
               "fa4_jax_det": "fa4_jax (cute, deterministic)",
               "upstream": "FA4 upstream (AOT, our timer)"}
# The peers fa4_jax is measured against ("best peer"): what a JAX user has today.
JAX_PEERS = ("cudnn", "xla", "mgpu")
TUNING_PREFIX = "fa4_jax:"
BWD_TUNING_PREFIX = "fa4_jax_bwd:"
BWD_DET_TUNING_PREFIX = "fa4_jax_bwd_det:"
# The docs/anchors.md column measured with the same peer: a drift check of the machine and the timer.
ANCHOR_COLUMN = {"cudnn": "jax_cudnn", "xla": "jax_xla", "mgpu": "pallas_mgpu"}


# ---------------------------------------------------------------------------------------------
# Steps, inputs and the timer.


def peer_label(peer: str, settings: Settings) -> str:
    if peer == "fa4_jax":
        return f"fa4_jax ({settings.fa4_implementation})"
    if peer.startswith(TUNING_PREFIX):
        return f"fa4_jax (tuning {peer[len(TUNING_PREFIX):]})"
    if peer.startswith(BWD_TUNING_PREFIX):
        return f"fa4_jax (backward tuning {peer[len(BWD_TUNING_PREFIX):]})"
    if peer.startswith(BWD_DET_TUNING_PREFIX):
        return f"fa4_jax (deterministic, backward tuning {peer[len(BWD_DET_TUNING_PREFIX):]})"
    return PEER_LABELS[peer]


def peer_candidates(peer: str) -> Callable:
    if peer.startswith(TUNING_PREFIX):
        return fa4_jax_tuning_candidates(peer[len(TUNING_PREFIX):])
    if peer.startswith(BWD_TUNING_PREFIX):
        return fa4_jax_bwd_tuning_candidates(peer[len(BWD_TUNING_PREFIX):], deterministic=False)
    if peer.startswith(BWD_DET_TUNING_PREFIX):
        return fa4_jax_bwd_tuning_candidates(peer[len(BWD_DET_TUNING_PREFIX):], deterministic=True)
    return PEERS[peer]


def make_step(attend: Callable, mode: str) -> Callable:
    """A jit'd step of signature (q, k, v, do) for either mode, so the timer is mode-agnostic."""
    if mode == "fwd":
        return jax.jit(lambda q, k, v, do: attend(q, k, v))

    def loss(q, k, v, do):
        # sum(out * do) has gradient do with respect to out: a fixed random output cotangent.
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def make_input_sets(case: Case, dtype, seed: int) -> list[tuple]:
    """INPUT_SETS fresh standard-normal (q, k, v, do) sets; the same values for every dtype."""
    keys = jax.random.split(jax.random.key(seed), INPUT_SETS * 4)
    shapes = (case.shape, case.shape, case.value_shape, case.value_shape) * INPUT_SETS
    tensors = [jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(keys, shapes)]
    jax.block_until_ready(tensors)  # else the first timed call would wait for the generation
    return [tuple(tensors[4 * i:4 * i + 4]) for i in range(INPUT_SETS)]


@dataclasses.dataclass
class Timing:
    ms: float
    compile_s: float
    calls: int
    repeats: int
    samples_ms: list[float]
    note: str = ""


def seconds_of(step: Callable, inputs: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*inputs))
    return time.perf_counter() - start


def time_step(step: Callable, input_sets: list[tuple], settings: Settings) -> Timing:
    """The docs/anchors.md JAX timer: median over repeats of (wall time of `calls` dispatches) / calls."""
    first_s = seconds_of(step, input_sets[0])  # trace + compile + one run
    warm_s = seconds_of(step, input_sets[1 % len(input_sets)])
    compile_s = max(first_s - warm_s, 0.0)
    if warm_s > settings.max_call_s:
        return Timing(warm_s * 1e3, compile_s, 1, 1, [warm_s * 1e3],
                      f"one call took {warm_s:.3g} s > --max-call-s: timed once, not looped")
    # Keep the whole case under max_case_s: long calls get shorter loops, never fewer repeats.
    calls = max(1, min(settings.calls, int(settings.max_case_s / (settings.repeats * warm_s))))
    # The GPU idles while the next peer compiles and its clocks may drop; a 1k case's whole
    # timing (5 × 20 calls of ~0.3 ms) is shorter than a ramp back, the suspected cause of two
    # identical kernels reading 9% apart (docs/perf-log.md, separate_o). Keep it busy first.
    warm_until = time.perf_counter() + settings.warmup_s
    i = 0
    while time.perf_counter() < warm_until:
        result = step(*input_sets[i % len(input_sets)])
        i += 1
        if i % calls == 0:
            jax.block_until_ready(result)
    if i:
        jax.block_until_ready(result)  # else the first sample would time warm-up calls too
    samples_ms = []
    for _ in range(settings.repeats):
        start = time.perf_counter()
        for i in range(calls):
            result = step(*input_sets[i % len(input_sets)])
        jax.block_until_ready(result)  # one stream: the last result done means all are done
        samples_ms.append((time.perf_counter() - start) / calls * 1e3)
    note = f"loop shortened to {calls} calls by --max-case-s" if calls < settings.calls else ""
    return Timing(statistics.median(samples_ms), compile_s, calls, settings.repeats, samples_ms,
                  note)


def matmul_ceiling(size: int, settings: Settings) -> dict:
    """docs/anchors.md's ceiling, a jit'd size³ matmul in the run's dtype, under the same timer.
    The H200 runs attention at its power limit, and its sustained clock has differed between
    days (docs/anchors.md: 732 TF/s for this matmul in its run, 790 on others); this says which kind
    of day a run had, against anchors.MATMUL_TFLOPS."""
    dtype = DTYPES[settings.dtype]
    keys = jax.random.split(jax.random.key(0), 2 * INPUT_SETS)
    input_sets = [tuple(jax.random.normal(key, (size, size), dtype) for key in keys[i::INPUT_SETS])
                  for i in range(INPUT_SETS)]
    timing = time_step(jax.jit(jnp.matmul), input_sets, settings)
    return dict(size=size, ms=timing.ms, tflops=2 * size**3 / (timing.ms * 1e-3) / 1e12,
                anchors_tflops=anchors.MATMUL_TFLOPS)


def format_ceiling(ceiling: dict) -> str:
    return (f"ceiling: bf16 {ceiling['size']}³ matmul {ceiling['tflops']:.0f} TF/s "
            f"(docs/anchors.md's run: {ceiling['anchors_tflops']:.0f}; ratio "
            f"{ceiling['tflops'] / ceiling['anchors_tflops']:.3f})")


# ---------------------------------------------------------------------------------------------
# Running the grid.


def cases_in_priority_order(settings: Settings, modes, head_dims, seqlens, causals) -> list[Case]:
    """Seqlen >= 4k first (docs/anchors.md's priority), ascending, so a cut-short run keeps those rows,
    and so a slow peer's time at 4k predicts its time at 16k before it is run."""
    def priority(seqlen):
        return (seqlen < 4096, seqlen)

    return [
        Case(mode, d, s, c, batch=max(1, settings.tokens // s), heads=settings.hidden // d)
        for s in sorted(seqlens, key=priority) for d in head_dims for c in causals for mode in modes
    ]


def record(case: Case, peer: str, status: str, **fields) -> dict:
    return dict(mode=case.mode, head_dim=case.head_dim, head_dim_v=case.head_dim_v,
                seqlen=case.seqlen, causal=case.causal, batch=case.batch, heads=case.heads,
                flops=case.flops, peer=peer, status=status, **fields)


def measure_candidates(case: Case, candidates: list[Candidate], input_sets_of: Callable,
                       settings: Settings) -> tuple[Candidate, Timing, list[dict]]:
    """Time every candidate; return the fastest and a log of all (a failed config is not fatal)."""
    best, tried = None, []
    for candidate in candidates:
        try:
            step = make_step(candidate.attend, case.mode)
            timing = time_step(step, input_sets_of(candidate.dtype), settings)
        except OutOfTime:
            raise
        except Exception as error:
            tried.append(dict(config=candidate.config, error=short_error(error)))
            continue
        tried.append(dict(config=candidate.config, ms=timing.ms))
        if best is None or timing.ms < best[1].ms:
            best = (candidate, timing)
    if best is None:
        raise RuntimeError("; ".join(t["error"] for t in tried))
    return best[0], best[1], tried


def short_error(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def predicted_call_s(last_call_s: dict, case: Case, peer: str) -> float | None:
    """A call's time extrapolated from this peer's last smaller seqlen (FLOPs grow with seqlen)."""
    previous = last_call_s.get((peer, case.mode, case.head_dim, case.causal))
    if previous is None or previous[0] >= case.seqlen:
        return None
    seqlen, call_s = previous
    return call_s * case.seqlen / seqlen


def measure(case: Case, peer: str, input_sets_of: Callable, settings: Settings,
            last_call_s: dict) -> dict:
    """One peer on one case, as a result record; never raises except OutOfTime."""
    predicted = predicted_call_s(last_call_s, case, peer)
    if predicted is not None and predicted > settings.max_call_s:
        return record(case, peer, "skipped",
                      note=f"predicted {predicted:.3g} s per call > --max-call-s")
    try:
        candidates = peer_candidates(peer)(case, settings)
        candidate, timing, tried = measure_candidates(case, candidates, input_sets_of, settings)
    except OutOfTime:
        raise
    except Skip as reason:
        return record(case, peer, "skipped", note=str(reason))
    except Exception as error:
        return record(case, peer, "failed", note=short_error(error))
    last_call_s[(peer, case.mode, case.head_dim, case.causal)] = (case.seqlen, timing.ms / 1e3)
    anchor_tflops = (anchors.anchor(case.mode, case.head_dim, case.seqlen, case.causal,
                                    ANCHOR_COLUMN[peer])
                     if settings.matches_anchors and peer in ANCHOR_COLUMN else None)
    return record(case, peer, "ok", ms=timing.ms, tflops=case.flops / timing.ms / 1e9,
                  anchor_tflops=anchor_tflops,
                  compile_s=timing.compile_s, calls=timing.calls, repeats=timing.repeats,
                  samples_ms=timing.samples_ms, dtype=jnp.dtype(candidate.dtype).name,
                  config=candidate.config, candidates=tried if len(tried) > 1 else None,
                  note=timing.note)


def input_cache(case: Case, seed: int) -> Callable:
    """Input sets of a case by dtype, made on first use and shared by all its peers."""
    cache = {}

    def input_sets_of(dtype) -> list[tuple]:
        name = jnp.dtype(dtype).name
        if name not in cache:
            cache[name] = make_input_sets(case, dtype, seed)
        return cache[name]

    return input_sets_of


def run_grid(cases: list[Case], peers: list[str], settings: Settings, deadline: float,
             results: list[dict], save: Callable[[], None]) -> None:
    """Measure every (case, peer) into `results`; raises OutOfTime at the deadline or SIGTERM."""
    last_call_s = {}
    for seed, case in enumerate(cases):
        input_sets_of = input_cache(case, seed)
        for peer in peers:
            if time.monotonic() > deadline:
                raise OutOfTime("time budget spent")
            result = measure(case, peer, input_sets_of, settings, last_call_s)
            print_progress(case, result)
            results.append(result)
            save()


def not_run(cases: list[Case], peers: list[str], results: list[dict], reason: str) -> list[dict]:
    done = {(r["mode"], r["head_dim"], r["seqlen"], r["causal"], r["peer"]) for r in results}
    return [record(c, p, "not_run", note=reason) for c in cases for p in peers
            if (c.mode, c.head_dim, c.seqlen, c.causal, p) not in done]


def print_progress(case: Case, result: dict) -> None:
    if result["status"] == "ok":
        anchor = result["anchor_tflops"]
        what = (f"{result['ms']:9.3f} ms {result['tflops']:6.1f} TF/s "
                f"{'' if anchor is None else f'(ANCHORS {anchor:.0f}) '}"
                f"compile {result['compile_s']:.1f} s {result['note']}")
    else:
        what = f"{result['status']}: {result['note']}"
    print(f"{case.label()}  {result['peer']:8s} {what}", flush=True)


# ---------------------------------------------------------------------------------------------
# Reporting: table, JSON, plots.


def result_index(results: list[dict]) -> dict:
    return {(r["mode"], r["head_dim"], r["seqlen"], r["causal"], r["peer"]): r for r in results}


def row_comparison(by_key: dict, row: tuple, peers: list[str], settings: Settings) -> dict:
    """fa4_jax against the best peer measured here, and against the bar of docs/design.md: the best
    of those and of docs/anchors.md's figures for peers outside JAX (FA4 upstream, torch)."""
    tflops = {p: by_key[(*row, p)]["tflops"] for p in peers
              if (*row, p) in by_key and by_key[(*row, p)]["status"] == "ok"}
    best_here = max((v for p, v in tflops.items() if p in JAX_PEERS), default=None)
    outside = anchors.best_non_jax_anchor(*row) if settings.matches_anchors else None
    bar = max((v for v in (best_here, outside) if v is not None), default=None)
    fa4 = tflops.get("fa4_jax")
    return dict(tflops=tflops, best_here=best_here, bar=bar,
                vs_best=fa4 / best_here if fa4 and best_here else None,
                vs_bar=fa4 / bar if fa4 and bar else None,
                upstream=anchors.anchor(*row, "fa4_upstream") if settings.matches_anchors else None)


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def format_table(results: list[dict], peers: list[str], settings: Settings) -> str:
    by_key = result_index(results)
    rows = sorted({(r["mode"], r["head_dim"], r["seqlen"], r["causal"]) for r in results},
                  key=lambda row: (MODES.index(row[0]), row[1], row[3], row[2]))
    peer_header = "".join(f" | {p + ' ms':>11} {'TF/s':>5}" for p in peers)
    header = (f"{'mode':7} | {'d':>3} | {'seqlen':>6} | {'causal':6}{peer_header}"
              f" | {'best TF':>7} | {'fa4/best':>8} | {'bar TF':>6} | {'fa4/bar':>7} | {'FA4 up':>6}")
    lines = [header, "-" * len(header)]
    for row in rows:
        cmp = row_comparison(by_key, row, peers, settings)
        cells = ""
        for p in peers:
            r = by_key.get((*row, p))
            ok = r is not None and r["status"] == "ok"
            cells += (f" | {fmt(r['ms'] if ok else None, '11.3f'):>11}"
                      f" {fmt(r['tflops'] if ok else None, '5.3g'):>5}")
        lines.append(
            f"{row[0]:7} | {row[1]:3d} | {row[2]:6d} | {'yes' if row[3] else 'no':6}{cells}"
            f" | {fmt(cmp['best_here'], '7.3g'):>7} | {fmt(cmp['vs_best'], '8.2f'):>8}"
            f" | {fmt(cmp['bar'], '6.3g'):>6} | {fmt(cmp['vs_bar'], '7.2f'):>7}"
            f" | {fmt(cmp['upstream'], '6.0f'):>6}")
    return "\n".join(lines + format_notes(results) + format_compile_times(results, peers))


def format_notes(results: list[dict]) -> list[str]:
    """Why cells are empty or special, each distinct (peer, note) once with a count."""
    counts = {}
    for r in results:
        if r.get("note"):
            key = (r["peer"], r["status"], r["note"])
            counts[key] = counts.get(key, 0) + 1
    return [""] + [f"  {peer} {status} ×{n}: {note}"
                   for (peer, status, note), n in sorted(counts.items())] if counts else []


def format_compile_times(results: list[dict], peers: list[str]) -> list[str]:
    """Compile time per peer, reported apart from the timings (first call minus a warm call)."""
    lines = []
    for peer in peers:
        times = [r["compile_s"] for r in results if r["peer"] == peer and r["status"] == "ok"]
        if times:
            lines.append(f"  {peer}: median {statistics.median(times):.1f} s, "
                         f"max {max(times):.1f} s over {len(times)} cases")
    return ["", "compile (first call - warm call):"] + lines if lines else []


def write_json(path: str, payload: dict) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(temporary, path)  # a kill mid-write never leaves a truncated file


def plot(results: list[dict], peers: list[str], settings: Settings, out_dir: str) -> list[str]:
    """One PNG per mode: TFLOP/s against seqlen, a panel per (causal, head dim), a line per peer,
    and FA4 upstream's docs/anchors.md figures dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in results if r["status"] == "ok"]
    # One colour per peer across every panel: matplotlib's cycle restarts per panel, so a peer
    # absent from one (Pallas MGPU has no causal backward) handed its colour to the next peer
    # there, under the absent peer's legend entry.
    colors = {peer: f"C{k % 10}" for k, peer in enumerate(peers)}
    for mode in sorted({r["mode"] for r in results}, key=MODES.index):
        head_dims = sorted({r["head_dim"] for r in results if r["mode"] == mode})
        causals = sorted({r["causal"] for r in results if r["mode"] == mode})
        seqlens = sorted({r["seqlen"] for r in results if r["mode"] == mode})
        fig, axes = plt.subplots(len(causals), len(head_dims), squeeze=False,
                                 figsize=(4.2 * len(head_dims), 3.4 * len(causals)))
        for (i, causal), (j, d) in ((ic, jd) for ic in enumerate(causals)
                                    for jd in enumerate(head_dims)):
            ax = axes[i][j]
            for peer in peers:
                points = sorted((r["seqlen"], r["tflops"]) for r in ok if r["peer"] == peer
                                and (r["mode"], r["head_dim"], r["causal"]) == (mode, d, causal))
                if points:
                    ax.plot(*zip(*points), marker="o", color=colors[peer],
                            label=peer_label(peer, settings))
            upstream = sorted((s, cols["fa4_upstream"])
                              for (dd, s, c), cols in anchors.ANCHORS[mode].items()
                              if (dd, c) == (d, causal)) if settings.matches_anchors else []
            # docs/anchors.md has no d96 or d192 rows; an empty zip would plot the format string.
            if upstream:
                ax.plot(*zip(*upstream), "k--", label="FA4 upstream (docs/anchors.md)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(s) for s in seqlens])
            ax.minorticks_off()
            dims = f"{d}" if HEAD_DIM_V.get(d, d) == d else f"{d}, dv={HEAD_DIM_V[d]}"
            ax.set_title(f"d={dims}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        # A peer may be absent from some panels (XLA above 4k): gather labels from all of them.
        legend = {}
        for ax in axes.flat:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        # At most three entries a row: with ablation rows one row ran past the figure's edge.
        columns = min(len(legend), 3)
        legend_rows = -(-len(legend) // columns) if legend else 0
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=max(columns, 1),
                   frameon=False)
        fig.suptitle(f"Attention {'forward' if mode == 'fwd' else 'forward + backward'}, "
                     f"{settings.dtype}, {settings.tokens} tokens, hidden {settings.hidden}")
        # ~0.25 inch per legend row under the panels, plus a margin for the x labels.
        fig.tight_layout(rect=(0, (0.25 * legend_rows + 0.2) / fig.get_figheight(), 1, 1))
        path = os.path.join(out_dir, f"attention_{mode}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# Command line.


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def name_list(allowed):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
        return names
    return parse


def make_parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The benchmark's options; other harnesses (timing_protocol.py) add theirs to it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes: tests the harness; GPU-only peers report why they skip")
    p.add_argument("--head-dims", type=int_list, help="e.g. 64,128,256")
    p.add_argument("--seqlens", type=int_list, help="e.g. 1024,4096,16384")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--modes", type=name_list(MODES), default=MODES, help="fwd,fwd_bwd")
    p.add_argument("--peers", type=name_list(PEERS), default=tuple(PEERS),
                   help="fa4_jax,fa4_jax_det,cudnn,xla,mgpu,upstream")
    p.add_argument("--fa4-tunings", type=lambda text: tuple(text.split(",")), default=(),
                   help="forward ablation rows: names from benchmarks/ablations.py TUNINGS")
    p.add_argument("--fa4-bwd-tunings", type=lambda text: tuple(text.split(",")), default=(),
                   help="backward ablation rows (fwd_bwd; each default and deterministic): "
                        "names from benchmarks/ablations.py TUNINGS, 'default' for the baseline")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, help="batch·seqlen (16384)")
    p.add_argument("--hidden", type=int, help="heads·head_dim (2048)")
    p.add_argument("--calls", type=int, help="calls per timed loop (20)")
    p.add_argument("--repeats", type=int, help="timed loops; the median is reported (5)")
    p.add_argument("--max-call-s", type=float, default=3.0,
                   help="a warm call slower than this is timed once and the peer's larger seqlens "
                        "that extrapolate above it are skipped")
    p.add_argument("--max-case-s", type=float, default=5.0,
                   help="shorten the loop so one (case, peer) spends at most this timing")
    p.add_argument("--warmup-s", type=float,
                   help="keep the GPU busy with a case's own calls this long before timing it "
                        "(clocks drop while the next peer compiles; 0.3)")
    p.add_argument("--max-xla-seqlen", type=int, help="XLA is skipped above this seqlen (4096)")
    p.add_argument("--fa4-implementation", help='fa4_jax implementation= ("cute")')
    p.add_argument("--ceiling-size", type=int,
                   help="time a bf16 N³ matmul first, docs/anchors.md's ceiling (8192; 0: skip)")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="stop starting new measurements after this; results are still written")
    p.add_argument("--out", default=".bench_out", help="directory for results.json and PNGs")
    return p


def with_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Options left unset take the preset's value (PRESETS: the H200 grid, or --dry-run's)."""
    preset = PRESETS["dry_run" if args.dry_run else "h200"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dry_run:
        jax.config.update("jax_platforms", "cpu")
    return args


def parse_args(argv):
    return with_preset(make_parser().parse_args(argv))


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        tokens=args.tokens, hidden=args.hidden, dtype=args.dtype, calls=args.calls,
        repeats=args.repeats, max_call_s=args.max_call_s, max_case_s=args.max_case_s,
        warmup_s=args.warmup_s, max_xla_seqlen=args.max_xla_seqlen,
        fa4_implementation=args.fa4_implementation)


def causals_of(args: argparse.Namespace) -> tuple[bool, ...]:
    return {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]


def install_sigterm_stop() -> None:
    """`timeout` sends SIGTERM: turn it into OutOfTime so the results gathered so far are written."""
    def stop(signum, frame):
        raise OutOfTime("SIGTERM")
    signal.signal(signal.SIGTERM, stop)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.time_budget_s
    install_sigterm_stop()
    settings = settings_from(args)
    cases = cases_in_priority_order(settings, args.modes, args.head_dims, args.seqlens,
                                    causals_of(args))
    peers = list(args.peers) + [TUNING_PREFIX + name for name in args.fa4_tunings] + [
        prefix + name for name in args.fa4_bwd_tunings
        for prefix in (BWD_TUNING_PREFIX, BWD_DET_TUNING_PREFIX)]
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "results.json")
    meta = dict(
        device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
        jax=jax.__version__, argv=sys.argv[1:], settings=dataclasses.asdict(settings),
        timer=(f"jit'd step dispatched {settings.calls}x in a Python loop over {INPUT_SETS} input "
               f"sets, block_until_ready on the last; median of {settings.repeats}; two warm-up "
               f"calls and {settings.warmup_s} s of calls excluded; compile_s = first call - "
               "warm call"),
        flops=f"fwd 4*b*h*s*s*d, halved causal; fwd_bwd {FWD_BWD_FLOP_FACTOR}x fwd",
        started_unix=time.time())
    print(f"{len(cases)} cases x {len(peers)} peers on {meta['device']} ({meta['backend']}), "
          f"budget {args.time_budget_s:.0f} s", flush=True)
    if args.ceiling_size:
        meta["matmul_ceiling"] = matmul_ceiling(args.ceiling_size, settings)
        print(format_ceiling(meta["matmul_ceiling"]), flush=True)

    results = []

    def save(ended="running"):
        write_json(json_path, dict(meta=dict(meta, ended=ended,
                                             elapsed_s=time.monotonic() - started),
                                   results=results))

    try:
        run_grid(cases, peers, settings, deadline, results, save)
        ended = "complete"
    except OutOfTime as reason:
        ended = f"stopped early: {reason}"
        results += not_run(cases, peers, results, str(reason))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    save(ended)
    pngs = plot(results, peers, settings, args.out) if results else []
    print(f"\n{ended} after {time.monotonic() - started:.0f} s; wrote {json_path} "
          f"{' '.join(pngs)}\n")
    print(format_table(results, peers, settings))
    if "matmul_ceiling" in meta:
        print("\n" + format_ceiling(meta["matmul_ceiling"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
