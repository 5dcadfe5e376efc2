"""First-use checks of kernels that no GPU of their arch has run before users do.

An arch menu whose VERIFIED is False (kernels/sm100/menu.py: Blackwell's, compiled and
statically checked here, never executed; the build writes the flag into the library's manifest)
ships kernels that could be wrong on the hardware in ways no check without it can see. So before the dispatch lets a call run one of them, the
variant is run in this process on a few small problems (`PROBES`, and for a forward a ragged
batch whose K and V padding is NaN, `RAGGED_PROBE`; milliseconds) and compared with the
reference under the numerics rule (`fa4_jax.selftest`'s checks). A variant that
passes serves every call after it; one that fails is never used in this process: the dispatch
says why with a `FallbackWarning` and the call runs on cuDNN or the reference. Never a wrong
answer.

    FA4_JAX_TRUST_UNVERIFIED=1        skip the checks (you have run `python -m fa4_jax.selftest`
                                      on this GPU and it passed)
    FA4_JAX_CACHE_DIR=DIR             where verdicts are kept (default ~/.cache/fa4_jax)
    FA4_JAX_UNVERIFIED_ARCHES=sm_90a  also check the kernels of these archs (comma-separated;
                                      how the GPU tier exercises this on a Hopper GPU)

Verdicts are kept on disk (`verified.json` in the cache directory), keyed by the library's
bytes, the GPU's name and the driver's version, so a process pays for a variant's check only
the first time that library meets that GPU and driver.

`python -m fa4_jax.selftest` runs the full check on any GPU and prints a report to paste into
an issue.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

from fa4_jax import notices, routing

# (seqlen_q, seqlen_k, batch) of each check: odd lengths over two 256-row CTA tiles and three
# key blocks (tails on both sides, a diagonal that crosses blocks), one decode row, and a batch
# whose 480 tiles give each CTA of a persistent grid (148 on a B200) several in a row, and under
# a causal or window mask tiles without any key (more rows than keys, bottom-right).
PROBES = ((300, 333, 1), (1, 777, 1), (600, 100, 40))
# A forward variant's ragged check: buffers of (300, 333) rows and keys, each batch entry's
# valid (query rows, keys). The second entry ends inside a key block whose padding holds NaN:
# a kernel that let it reach P·V (instead of zeroing those V rows) returns NaN.
RAGGED_PROBE = ((300, 333), ((300, 333), (150, 200)))

_results: dict[str, str | None] = {}
# Variants whose check is running, and the threads that run checks (whose own calls the
# variants under check serve).
_pending: dict[str, threading.Event] = {}
_checker_threads: set[int] = set()
_lock = threading.Lock()


def unverified_arches(library) -> frozenset[str]:
    """The archs whose kernels are checked on first use: those the library's manifest marks
    unverified (an arch menu's VERIFIED = False), and FA4_JAX_UNVERIFIED_ARCHES."""
    marked = set(library.unverified_arches)
    extra = {a.strip() for a in os.environ.get("FA4_JAX_UNVERIFIED_ARCHES", "").split(",") if a.strip()}
    return frozenset(marked | extra)


_bypass_depth = 0


def trusted() -> bool:
    return _bypass_depth > 0 or os.environ.get("FA4_JAX_TRUST_UNVERIFIED", "") not in ("", "0")


@contextlib.contextmanager
def bypassed():
    """Lets every kernel serve calls, checked or not, while inside (`fa4_jax.selftest`, which
    reports on the kernels themselves)."""
    global _bypass_depth
    _bypass_depth += 1
    try:
        yield
    finally:
        _bypass_depth -= 1


def failure_reason(variant: routing.Variant, library) -> str | None:
    """None when `variant` (of `library`, an `fa4_jax.ffi.Library`) may serve calls on this GPU:
    its arch is verified, the check is turned off, or the variant passed its first-use check in
    this process; else why not. The first caller runs the check; others wait for its verdict."""
    if variant.arch not in unverified_arches(library) or trusted():
        return None
    name = variant.name
    with _lock:
        if name in _results:
            return _results[name]
        if threading.get_ident() in _checker_threads:
            return None
        done = _pending.get(name)
        if done is None:
            done = _pending[name] = threading.Event()
            owner = True
        else:
            owner = False
    if not owner:
        done.wait()
        return _results[name]
    reason = "its first-use check did not finish"
    try:
        key = _disk_key(library, name)
        saved = _load_verdicts()
        if key in saved:
            reason = saved[key]
        else:
            reason = _check_on_a_fresh_thread(variant)
            _save_verdict(key, reason)
    finally:
        # Waiting callers get a verdict even if this one was interrupted.
        with _lock:
            _results[name] = reason
            del _pending[name]
        done.set()
    if reason is not None:
        notices.logger.warning("fa4_jax: %s failed its first-use check: %s", name, reason)
    return reason


def _check_on_a_fresh_thread(variant: routing.Variant) -> str | None:
    """Runs `_check` on a thread of its own: the caller is usually tracing a jit (the dispatch
    decides at trace time), and JAX's trace state is per thread, so there the check's calls run
    as plain eager calls on concrete arrays."""
    def work():
        ident = threading.get_ident()
        with _lock:
            _checker_threads.add(ident)
        try:
            return _check(variant)
        except Exception as error:  # a kernel that cannot even run is not used either
            return f"its first-use check raised {type(error).__name__}: {error}"
        finally:
            with _lock:
                _checker_threads.discard(ident)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


def _verdicts_path() -> Path:
    return Path(os.environ.get("FA4_JAX_CACHE_DIR") or Path.home() / ".cache" / "fa4_jax") / "verified.json"


@functools.cache
def _library_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _disk_key(library, name: str) -> str:
    """What a verdict holds for: this library's bytes, this GPU and driver, this variant."""
    import jax

    device = jax.devices()[0]
    library_id = _library_digest(library.path) if os.path.exists(library.path) else library.path
    return "|".join([library_id, device.device_kind, device.client.platform_version, name])


def _load_verdicts() -> dict:
    try:
        return json.loads(_verdicts_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_verdict(key: str, reason: str | None) -> None:
    """Adds one verdict to the file (a whole-file replace, so a reader never sees half of it);
    a cache that cannot be written only costs the next process a check."""
    path = _verdicts_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = {**_load_verdicts(), key: reason}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(verdicts, f, indent=1)
        os.replace(f.name, path)
    except OSError:
        pass


def results() -> dict[str, str | None]:
    """variant name -> None (passed) or why it failed, for the variants checked so far."""
    with _lock:
        return dict(_results)


def forget() -> None:
    """Drops the checks' results (tests)."""
    with _lock:
        _results.clear()


def _check(variant: routing.Variant) -> str | None:
    """Runs PROBES through the public API and compares what `variant` computes with the
    reference: out and lse for a forward variant (and RAGGED_PROBE's), the gradients for a
    backward one."""
    import jax.numpy as jnp

    from fa4_jax import selftest

    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[variant.dtype]
    options = dict(selftest.MASK_OPTIONS[variant.mask], **({"softcap": selftest.SOFTCAP} if variant.softcap else {}))
    judged = ("out", "lse") if variant.kind == "fwd" else ("dq", "dk", "dv")
    failures = []
    for seed, (seqlen_q, seqlen_k, batch) in enumerate(PROBES):
        # implementation=None: a forward-only arch's backward runs on the reference.
        check = selftest._check_call(variant.name, dtype, variant.head_dim, variant.head_dim_v, options,
                                     seqlen_q, seqlen_k, seed, implementation=None, batch=batch)
        wrong = {name: check.errors[name] for name in judged if check.errors[name][0] > check.errors[name][1]}
        if wrong:
            failures.append(f"{variant.name} sq={seqlen_q} sk={seqlen_k}: " + ", ".join(
                f"{name} error {error:.3g} > {bound:.3g}" for name, (error, bound) in wrong.items()))
    if variant.kind == "fwd":
        failures += _ragged_failures(variant, dtype, options)
    return None if not failures else "; ".join(failures)


def _ragged_failures(variant: routing.Variant, dtype, options) -> list[str]:
    """RAGGED_PROBE through the public API with NaN in K's and V's padding: each entry's valid
    rows against the reference on that entry alone, rows past it 0 with lse −inf."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fa4_jax
    from fa4_jax import selftest
    from fa4_jax.reference import dense_attention

    (seqlen_q, seqlen_k), lengths = RAGGED_PROBE
    q_len, kv_len = (jnp.array(side, jnp.int32) for side in zip(*lengths))
    keys = jax.random.split(jax.random.key(len(PROBES)), 3)
    batch = len(lengths)
    q = jax.random.normal(keys[0], (batch, seqlen_q, selftest.HEADS_Q, variant.head_dim), dtype)
    k, v = (jax.random.normal(key, (batch, seqlen_k, selftest.HEADS_KV, dim), dtype)
            for key, dim in ((keys[1], variant.head_dim), (keys[2], variant.head_dim_v)))
    padding = jnp.arange(seqlen_k)[None, :, None, None] >= kv_len[:, None, None, None]
    k, v = (jnp.where(padding, jnp.nan, x).astype(dtype) for x in (k, v))
    out, lse = jax.jit(lambda q, k, v: fa4_jax.attention(
        q, k, v, return_lse=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **options))(q, k, v)
    window_left, window_right = options.get("window_size", (None, None))
    failures = []
    for b, (rows, keys_b) in enumerate(lengths):
        entry = (q[b:b + 1, :rows], k[b:b + 1, :keys_b], v[b:b + 1, :keys_b])

        def reference(compute_dtype):
            return dense_attention(*entry, compute_dtype=compute_dtype, causal=options.get("causal", False),
                                   window_left=window_left, window_right=window_right,
                                   softcap=options.get("softcap"))

        (ref_out, ref_lse), (low_out, low_lse) = reference(jnp.float32), reference(dtype)
        factor = 3 if options.get("softcap") else 2
        for name, ours, ref, low in (("out", out[b:b + 1, :rows], ref_out, low_out),
                                     ("lse", lse[b:b + 1, :, :rows], ref_lse, low_lse)):
            error, bound = selftest._bound_by_rule(ours, ref, low, factor, dtype)
            if error > bound:
                failures.append(f"{variant.name} ragged entry {b}: {name} error {error:.3g} > {bound:.3g}")
        past_out = np.asarray(out[b, rows:], np.float32)
        past_lse = np.asarray(lse[b, :, rows:])
        if past_out.size and not ((past_out == 0).all() and np.isneginf(past_lse).all()):
            failures.append(f"{variant.name} ragged entry {b}: rows past its length are not 0 with lse -inf")
    return failures
