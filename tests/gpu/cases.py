"""Inputs and option sets shared by the GPU tier's forward and backward tests."""
import jax
import pytest


def qkv(next_key, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, head_dim_v=None):
    """Fresh standard-normal q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv]."""
    q = jax.random.normal(next_key(), (batch, seqlen_q, heads_q, head_dim), dtype)
    k = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(next_key(), (batch, seqlen_k, heads_kv, head_dim_v or head_dim), dtype)
    return q, k, v


def mask_options(causal=False, window_size=(None, None), **_):
    """`fa4_jax.attention` options -> the reference's mask keywords (softcap is not a mask)."""
    return dict(causal=causal, window_left=window_size[0], window_right=window_size[1])


# Sliding windows on each side and softcap, with and without causal: fa4_jax.attention options.
LOCAL_AND_SOFTCAP = {
    "window_left_causal": dict(causal=True, window_size=(64, None)),
    "window_both": dict(window_size=(100, 30)),
    "window_right_only": dict(window_size=(None, 16)),
    "softcap": dict(softcap=30.0),
    "softcap_causal": dict(softcap=5.0, causal=True),
}


# Windows within a few hundred keys and softcap, with and without causal: the option sets of the
# ragged and segment-id tests (each masks on top of its own rule).
WINDOWS_AND_SOFTCAP = {
    "window_causal": dict(causal=True, window_size=(70, None)),
    "window_both": dict(window_size=(100, 30)),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=5.0, causal=True),
}


def routed_tunings(kind):
    """pytest.mark.parametrize over the (head_dim, head_dim_v, tuning, causal) of `kind`'s
    shipped non-default variants without a window (the tunings the router sends calls to), ids
    like "d128-short-causal" ("d192v128-decode-full")."""
    from fa4_jax.aot import menu

    cases = sorted({(v.head_dim, v.head_dim_v, v.tuning, v.mask == "causal") for v in menu.MENU
                    if v.kind == kind and v.tuning != "default" and v.mask != "local"})
    ids = [f"d{d}{'' if dv == d else f'v{dv}'}-{t}-{'causal' if c else 'full'}" for d, dv, t, c in cases]
    return pytest.mark.parametrize("head_dim,head_dim_v,tuning,causal", cases, ids=ids)


def require_kernels(q, k, v, **options):
    """Skips unless both the forward and the backward kernel serve this call (so a green run
    never overstates coverage); the skip gives the library's reason."""
    from fa4_jax.runtime import dispatch
    from fa4_jax.api.attention import attention_params

    try:
        params = attention_params(q, k, v, implementation="cute", **options)
    except ValueError as error:
        pytest.skip(str(error))
    reason = dispatch.unsupported_reason(q, k, v, params, "bwd")
    if reason is not None:
        pytest.skip(f"no backward kernel: {reason}")
