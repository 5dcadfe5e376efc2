"""GPU tier: the CuTe backward kernels against the reference's gradients, and deterministic mode.

Run with `pytest -m gpu`. Every test first confirms that the backward kernel (not the reference
fallback of `bodies.backward`) serves the call, and skips with the library's reason otherwise,
so a green run never overstates coverage. Gradients are taken of out and lse together (random
cotangents for both), against the reference's semantics in fp32 and in the input dtype
(`tests.numerics.dense_attention`, which compiles much faster than the chunked reference) under
docs/design.md's numerics rule.
"""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.abi import targets
from fa4_jax.runtime import dispatch
from fa4_jax.api.attention import attention_params
from fa4_jax.fallbacks.reference import attention_reference
from tests.gpu.cases import LOCAL_AND_SOFTCAP, mask_options, qkv, require_kernels
from tests.numerics import assert_close_by_rule, dense_attention, visible_mask

pytestmark = pytest.mark.gpu

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Gradients are taken under one jax.jit per (function, options), cached: eager op-by-op dispatch
# compiles every primitive for every new shape, which made a test cost ~10 s of compiling.


def _kernel_grads(q, k, v, d_out, d_lse, **options):
    return _kernel_grad_fn(tuple(sorted(options.items())))(q, k, v, d_out, d_lse)


@functools.cache
def _kernel_grad_fn(option_items):
    options = dict(option_items)

    def attend(q, k, v):
        return fa4_jax.attention(q, k, v, return_lse=True, implementation="cute", **options)

    return jax.jit(lambda q, k, v, d_out, d_lse: jax.vjp(attend, q, k, v)[1]((d_out, d_lse)))


def _reference_grads(q, k, v, d_out, d_lse, compute_dtype, **options):
    return _reference_grad_fn(compute_dtype, tuple(sorted(options.items())))(q, k, v, d_out, d_lse)


@functools.cache
def _reference_grad_fn(compute_dtype, option_items):
    options = dict(option_items)
    mask = mask_options(**options)

    def attend(q, k, v):
        out, lse = dense_attention(q, k, v, softcap=options.get("softcap"),
                                   compute_dtype=compute_dtype, **mask)
        return out.astype(q.dtype), lse

    return jax.jit(lambda q, k, v, d_out, d_lse: jax.vjp(attend, q, k, v)[1]((d_out, d_lse)))


def _cotangents(next_key, q, v, seqlen_k, **options):
    """Random (d_out, d_lse); d_lse is 0 on rows that see no key (their lse is -inf)."""
    batch, seqlen_q, heads_q, _ = q.shape
    d_out = jax.random.normal(next_key(), (batch, seqlen_q, heads_q, v.shape[-1]), q.dtype)
    d_lse = jax.random.normal(next_key(), (batch, heads_q, seqlen_q), jnp.float32)
    visible = visible_mask(seqlen_q, seqlen_k, **mask_options(**options)).any(axis=1)
    return d_out, jnp.where(visible, d_lse, 0.0), visible


def _check_backward(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                    head_dim_v=None, **options):
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype,
                   head_dim_v)
    require_kernels(q, k, v, **options)
    d_out, d_lse, row_visible = _cotangents(next_key, q, v, seqlen_k, **options)
    grads = _kernel_grads(q, k, v, d_out, d_lse, **options)
    ref = _reference_grads(q, k, v, d_out, d_lse, jnp.float32, **options)
    lowp = _reference_grads(q, k, v, d_out, d_lse, dtype, **options)
    factor = 3 if options.get("softcap") else 2
    for name, grad, want, want_lowp, x in zip(("dq", "dk", "dv"), grads, ref, lowp, (q, k, v)):
        assert grad.dtype == x.dtype and grad.shape == x.shape, name
        assert np.isfinite(np.asarray(grad, np.float32)).all(), f"{name}: non-finite entries"
        assert_close_by_rule(grad, want, want_lowp, factor=factor, name=name)
    # Rows that see no key get dq = 0; keys no row sees get dk = dv = 0 (exactly: nothing added).
    visible = visible_mask(seqlen_q, seqlen_k, **mask_options(**options))
    dq, dk, dv = (np.asarray(g, np.float32) for g in grads)
    assert np.all(dq[:, ~row_visible] == 0.0)
    col_visible = visible.any(axis=0)
    assert np.all(dk[:, ~col_visible] == 0.0) and np.all(dv[:, ~col_visible] == 0.0)
    # Fresh cotangents give fresh gradients (no stale workspace or output served twice).
    if row_visible.any():
        other = _kernel_grads(q, k, v, -2 * d_out, d_lse, **options)
        assert not np.array_equal(np.asarray(other[2]), np.asarray(grads[2]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_head_dims_dtypes(next_key, head_dim, dtype, causal):
    _check_backward(next_key, 2, 1000, 1000, 4, 2, head_dim, dtype, causal=causal)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_192_with_value_dim_128(next_key, causal, deterministic):
    _check_backward(next_key, 2, 600, 600, 4, 2, 192, jnp.bfloat16, head_dim_v=128, causal=causal,
                    deterministic=deterministic)


LENGTHS = [(1, 1), (17, 17), (113, 113), (2049, 2049), (17, 1000), (1000, 17), (113, 2049),
           (2049, 113)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_odd_and_unequal_lengths(next_key, seqlen_q, seqlen_k, causal):
    _check_backward(next_key, 1, seqlen_q, seqlen_k, 4, 2, 128, jnp.bfloat16, causal=causal)


# Deterministic d192/d256 calls take two dQ accumulators (routing.dq_copies), and every
# deterministic call leaves them unzeroed (a copy's first add stores): odd lengths, sq != sk.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 1000), (1000, 17), (2049, 113), (113, 2049)])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_deterministic_odd_and_unequal_lengths(next_key, head_dim, seqlen_q, seqlen_k, causal):
    _check_backward(next_key, 1, seqlen_q, seqlen_k, 4, 2, head_dim, jnp.bfloat16, causal=causal,
                    deterministic=True)


@pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_and_mqa(next_key, heads_q, heads_kv, dtype):
    _check_backward(next_key, 2, 513, 513, heads_q, heads_kv, 128, dtype, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fully_masked_rows(next_key, head_dim, deterministic):
    # causal with seqlen_q > seqlen_k: the first 200 rows see no key, so no key block adds into
    # their query blocks. Deterministic mode does not zero the dQ workspace: there the
    # postprocess must read those blocks' semaphores as "never written". The freed poison makes
    # that workspace hold NaN (the allocator hands its memory back to the next call's buffers),
    # so a block read anyway fails the finiteness and zero checks.
    poison = jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()
    del poison
    _check_backward(next_key, 2, 300, 100, 4, 2, head_dim, jnp.bfloat16, causal=True,
                    deterministic=deterministic)


@pytest.mark.parametrize("options", LOCAL_AND_SOFTCAP.values(), ids=LOCAL_AND_SOFTCAP.keys())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_windows_and_softcap(next_key, head_dim, options):
    _check_backward(next_key, 1, 777, 1031, 4, 2, head_dim, jnp.bfloat16, **options)


@pytest.mark.parametrize("options", LOCAL_AND_SOFTCAP.values(), ids=LOCAL_AND_SOFTCAP.keys())
@pytest.mark.parametrize("head_dim", [128, 256])
def test_deterministic_windows_and_softcap(next_key, head_dim, options):
    _check_backward(next_key, 1, 777, 1031, 4, 2, head_dim, jnp.bfloat16, deterministic=True,
                    **options)


@pytest.mark.parametrize("softcap", [None, 400.0])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_key_tail_with_very_negative_lse(next_key, head_dim, softcap):
    # Every score is about -200 (q along -k), so lse < -88: a key past seqlen_k (zero-filled in
    # the last, partial key block) would get P = exp(-lse) = inf unless masked, and dQ would be
    # NaN. Softcap 400 keeps the scores near -185.
    batch, seqlen, heads = 1, 1000, 2
    direction = jax.random.normal(next_key(), (head_dim,), jnp.float32)
    direction = direction / jnp.linalg.norm(direction) * jnp.sqrt(head_dim)
    noise = lambda shape: 0.1 * jax.random.normal(next_key(), shape, jnp.float32)
    shape = (batch, seqlen, heads, head_dim)
    q = (-200.0 / head_dim**0.5 * direction + noise(shape)).astype(jnp.bfloat16)
    k = (direction + noise(shape)).astype(jnp.bfloat16)
    v = jax.random.normal(next_key(), shape, jnp.bfloat16)
    options = {} if softcap is None else {"softcap": softcap}
    require_kernels(q, k, v, **options)
    _, lse = fa4_jax.attention(q, k, v, return_lse=True, implementation="reference", **options)
    assert float(jnp.max(lse)) < -88.0, "the case must drive lse below exp's range"
    d_out = jax.random.normal(next_key(), shape, jnp.bfloat16)
    d_lse = jnp.zeros((batch, heads, seqlen), jnp.float32)
    grads = _kernel_grads(q, k, v, d_out, d_lse, **options)
    ref = _reference_grads(q, k, v, d_out, d_lse, jnp.float32, **options)
    lowp = _reference_grads(q, k, v, d_out, d_lse, jnp.bfloat16, **options)
    for name, grad, want, want_lowp in zip(("dq", "dk", "dv"), grads, ref, lowp):
        assert np.isfinite(np.asarray(grad, np.float32)).all(), f"{name}: non-finite entries"
        assert_close_by_rule(grad, want, want_lowp, factor=3 if softcap else 2, name=name)


def _deterministic_case(next_key, head_dim=128):
    # Many key blocks add into every dQ tile and 4 q heads share each kv head: the orders the
    # fixed-order reduction has to pin down.
    q, k, v = qkv(next_key, 2, 2048, 2048, 8, 2, head_dim, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    return q, k, v, d_out


def _grad_fn(d_out, deterministic, causal=True):
    def loss(q, k, v):
        out = fa4_jax.attention(q, k, v, causal=causal, deterministic=deterministic,
                                implementation="cute")
        return (out.astype(jnp.float32) * d_out.astype(jnp.float32)).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# Each head dim's dQ hand-over differs: d64's 128-row tiles, d128's two-stage rings, d256's
# single-buffered sdQ.
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_is_bitwise_repeatable(next_key, causal, head_dim):
    q, k, v, d_out = _deterministic_case(next_key, head_dim)
    require_kernels(q, k, v, causal=causal, deterministic=True)
    grad = _grad_fn(d_out, True, causal)
    first = [np.asarray(g) for g in grad(q, k, v)]
    for _ in range(9):
        for want, got in zip(first, grad(q, k, v)):
            np.testing.assert_array_equal(np.asarray(got), want)
    # Same numbers as the default mode up to accumulation order.
    default = _grad_fn(d_out, False, causal)(q, k, v)
    batch, seqlen_q, heads_q, _ = q.shape
    no_d_lse = jnp.zeros((batch, heads_q, seqlen_q), jnp.float32)
    ref = _reference_grads(q, k, v, d_out, no_d_lse, jnp.float32, causal=causal)
    lowp = _reference_grads(q, k, v, d_out, no_d_lse, jnp.bfloat16, causal=causal)
    for name, det, fast, want, want_lowp in zip(("dq", "dk", "dv"), first, default, ref, lowp):
        assert_close_by_rule(det, want, want_lowp, name=f"deterministic {name}")
        assert_close_by_rule(fast, want, want_lowp, name=f"default {name}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_an_empty_d_lse_gives_the_bits_of_zeros(next_key, head_dim):
    # When lse is not differentiated the call passes an empty d_lse and the preprocess reads
    # none (vjp.py's symbolic zeros): D = rowsum(dO ∘ O) − 0 either way, so in deterministic
    # mode both calls give the same bits. A stale dLSE read (garbage past an empty buffer)
    # would not.
    q, k, v, d_out = _deterministic_case(next_key, head_dim)
    require_kernels(q, k, v, causal=True, deterministic=True)
    params = attention_params(q, k, v, causal=True, deterministic=True, implementation="cute")
    out, lse = jax.jit(lambda q, k, v: dispatch.forward(q, k, v, params))(q, k, v)
    backward = jax.jit(lambda d_lse: dispatch.backward(q, k, v, out, lse, d_out, d_lse, params))
    without = backward(None)
    with_zeros = backward(jnp.zeros(lse.shape, jnp.float32))
    for name, got, want in zip(("dq", "dk", "dv"), without, with_zeros):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    # And the d_lse operand is read when given: a constant c shifts D by -c, which moves dQ.
    shifted = backward(jnp.ones(lse.shape, jnp.float32))
    assert not np.array_equal(np.asarray(shifted[0]), np.asarray(without[0]))


def test_a_loss_of_out_passes_the_backward_an_empty_d_lse(next_key):
    # What the symbolic zeros buy, in the program XLA runs: the backward custom call's d_lse
    # operand is empty ([0, h, sq]), not an fp32 array of zeros built by a broadcast kernel.
    q, k, v = qkv(next_key, 1, 512, 512, 4, 4, 64, jnp.bfloat16)
    require_kernels(q, k, v, causal=False)

    def loss(q, k, v):
        return fa4_jax.attention(q, k, v, implementation="cute").astype(jnp.float32).sum()

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    backward = targets.TARGETS["bwd"].current.name
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{backward}"' in line]
    assert len(calls) == 1, hlo
    assert "f32[0,4,512]" in calls[0] and "f32[1,4,512]" in calls[0], calls[0]  # d_lse, lse


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_default_mode_repeats_agree_to_rounding(next_key, causal, head_dim):
    # The default mode adds dQ in a varying order: runs agree to rounding, not bits. A lost or
    # doubled add in a rare interleaving would move a dQ row by a key block's share, far beyond
    # that: 10 runs against the first. d64's first add into each query block claims a store over
    # the unzeroed accumulator and the others wait for it (TileConfig.default_stores_first),
    # where such a race could hide.
    q, k, v, d_out = _deterministic_case(next_key, head_dim)
    require_kernels(q, k, v, causal=causal)
    params = attention_params(q, k, v, causal=causal, implementation="cute")
    out, lse = jax.jit(lambda q, k, v: dispatch.forward(q, k, v, params))(q, k, v)
    grad = jax.jit(lambda q, k, v, out, lse, d_out: dispatch.backward(q, k, v, out, lse, d_out, None,
                                                                      params))
    arrays = (q, k, v, out, lse, d_out)
    first = [np.asarray(g, np.float32) for g in grad(*arrays)]
    for _ in range(9):
        for name, want, got in zip(("dq", "dk", "dv"), first, grad(*arrays)):
            got = np.asarray(got, np.float32)
            # bf16 holds 8 mantissa bits: a reordered fp32 sum rounds to within 2^-7 relative.
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(want).max()),
                                       err_msg=name)


_FRESH_PROCESS = """
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
from tests.gpu.test_backward_gpu import _grad_fn
seed = int(sys.argv[1])
keys = iter(jax.random.split(jax.random.key(seed), 4))
q, k, v, d_out = (jax.random.normal(next(keys), s, jnp.bfloat16)
                  for s in ((2, 2048, 8, 128), (2, 2048, 2, 128), (2, 2048, 2, 128),
                            (2, 2048, 8, 128)))
grads = _grad_fn(d_out, True)(q, k, v)
print(json.dumps([hashlib.sha256(np.asarray(g).tobytes()).hexdigest() for g in grads]))
"""


@pytest.mark.gpu_processes
def test_deterministic_mode_is_bitwise_equal_across_processes(seed):
    # No preallocation: the parent (and, in a sharded tier run, its sibling processes) already
    # hold their share of the GPU's memory.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        p for p in (_REPO, os.environ.get("PYTHONPATH")) if p))
    digests = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(seed)], cwd=_REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert digests[0] == digests[1]


def test_grad_of_jit_equals_jit_of_grad(next_key):
    q, k, v = qkv(next_key, 1, 700, 700, 4, 2, 128, jnp.bfloat16)
    require_kernels(q, k, v, causal=True, deterministic=True)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)

    def loss(q, k, v):
        out = fa4_jax.attention(q, k, v, causal=True, deterministic=True, implementation="cute")
        return (out.astype(jnp.float32) * d_out.astype(jnp.float32)).sum()

    grad_of_jit = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(q, k, v)
    jit_of_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grad_of_jit, jit_of_grad):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradient_of_lse_alone(next_key):
    # d(sum lse)/dq has only the dLSE term: D = -dLSE and dP · 0.
    q, k, v = qkv(next_key, 1, 333, 333, 4, 2, 64, jnp.bfloat16)
    require_kernels(q, k, v, causal=True)

    def kernel_lse(q, k, v):
        return fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="cute")[1]

    def reference_lse(compute_dtype):
        return lambda q, k, v: attention_reference(q, k, v, causal=True,
                                                   compute_dtype=compute_dtype)[1]

    grads = jax.grad(lambda *x: kernel_lse(*x).sum(), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *x: reference_lse(jnp.float32)(*x).sum(), argnums=(0, 1, 2))(q, k, v)
    lowp = jax.grad(lambda *x: reference_lse(jnp.bfloat16)(*x).sum(), argnums=(0, 1, 2))(q, k, v)
    for name, grad, want, want_lowp in zip(("dq", "dk", "dv"), grads, ref, lowp):
        assert_close_by_rule(grad, want, want_lowp, name=name)
    assert np.all(np.asarray(grads[2], np.float32) == 0.0)  # lse does not depend on v


# Top-left masks (the drop-in's rule), whose diagonal sits at offset 0 whatever the lengths: the
# gradients of the drop-in on the kernels against jax's own, and the deterministic order on them.
@pytest.mark.parametrize("window", [None, (64, 0), (50, 20)], ids=["causal", "causal_window", "window"])
@pytest.mark.parametrize("shape", [(2, 300, 1000, 4, 2), (2, 1000, 300, 4, 2), (1, 1100, 2100, 4, 4)],
                         ids=["q_shorter", "q_longer", "many_blocks"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_top_left_gradients_on_the_kernels(next_key, head_dim, shape, window):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = shape
    q, k, v = qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
    d_out = jax.random.normal(next_key(), q.shape, jnp.bfloat16)
    is_causal = window is None or window[1] == 0

    def grads(attention, q, k, v):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got = grads(functools.partial(fa4_jax.dot_product_attention, is_causal=is_causal,
                                  local_window_size=window, implementation="cute"), q, k, v)
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=is_causal, local_window_size=window,
                            implementation="xla")
    with jax.default_matmul_precision("highest"):  # not TF32: the f32 oracle at full precision
        ref = grads(xla, *(x.astype(jnp.float32) for x in (q, k, v)))
    lowp = grads(xla, q, k, v)
    # Rows past the window's reach see no key, and jax gives them the mean of the values: their
    # share of dv (a [B, N_kv, D] vector over every key) is added to the kernel's dv in bf16, a
    # second rounding of dv that jax's one matmul does not make (half an ulp more).
    keyless = window is not None and seqlen_q > seqlen_k + window[0]
    for name, grad, want, want_lowp in zip(("dq", "dk", "dv"), got, ref, lowp):
        assert_close_by_rule(grad, want, want_lowp, name=name, factor=3 if keyless and name == "dv" else 2)
    # The deterministic order over top-left masks: bitwise repeatable, and the default mode's
    # gradients to rounding.
    from fa4_jax.api.attention import run

    left, right = (None, None) if window is None else window
    options = dict(causal=is_causal, softmax_scale=None, window_size=(left, 0 if is_causal else right),
                   softcap=None, return_lse=False, implementation="cute", top_left=True)
    deterministic = grads(functools.partial(run, deterministic=True, **options), q, k, v)
    again = grads(functools.partial(run, deterministic=True, **options), q, k, v)
    default = grads(functools.partial(_attention, deterministic=False, **options), q, k, v)
    for name, first, second, fast in zip(("dq", "dk", "dv"), deterministic, again, default):
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second), err_msg=name)
        want = np.asarray(fast, np.float32)
        np.testing.assert_allclose(np.asarray(first, np.float32), want, rtol=2 ** -6,
                                   atol=2 ** -6 * float(np.abs(want).max()), err_msg=name)
