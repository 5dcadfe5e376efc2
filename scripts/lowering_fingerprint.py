"""The programs fa4_jax's public calls lower to on an H200, for a before/after comparison.

    python scripts/lowering_fingerprint.py OUT.json            # this tree's programs
    python scripts/lowering_fingerprint.py OUT.json --compare BEFORE.json [--targets OLD=NEW ...]

Runs on a CPU: the run time sees the shipping menu on an H200 (tests/h200_menu.py), and each call
of a corpus (the public entry points over the problem classes of the GPU tier: dtypes, head dims
served as they are or zero-padded, masks, softcap, GQA, decode, ragged batches, segment ids,
shared and per-head mask arrays, deterministic mode, gradients through out and lse, the jax
drop-in, varlen, Flax) is lowered for CUDA. Its StableHLO, without locations, is the program the
GPU would run: two trees whose programs are equal, on one library, give the same bits on the
GPU. `--targets` renames custom-call targets of BEFORE (a change that renames them on purpose).
Exit status 1 when a program differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fa4_jax  # noqa: E402
from tests.h200_menu import use_h200_menu  # noqa: E402


def _arrays(b, sq, sk, h, hk, d, dv, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((b, sq, h, d), dtype), jax.ShapeDtypeStruct((b, sk, hk, d), dtype),
            jax.ShapeDtypeStruct((b, sk, hk, dv), dtype))


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _bool(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bool_)


def _grad(f):
    """f's (out, grads of a loss of out) -- and of lse, when f returns it."""
    def loss(q, k, v, *rest):
        result = f(q, k, v, *rest)
        out, lse = result if isinstance(result, tuple) else (result, None)
        value = jnp.sum(out.astype(jnp.float32) ** 2)
        return value + (0.0 if lse is None else jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def corpus():
    """name -> (function, argument shapes)."""
    calls = {}
    attention = fa4_jax.attention
    for dtype in (jnp.bfloat16, jnp.float16):
        tag = "bf16" if dtype == jnp.bfloat16 else "fp16"
        for d, dv in ((64, 64), (88, 88), (128, 128), (192, 128), (256, 256)):
            shapes = _arrays(2, 1024, 1024, 8, 2, d, dv, dtype)
            for mask, options in (("none", {}), ("causal", dict(causal=True)),
                                  ("window", dict(window_size=(128, 0))),
                                  ("softcap", dict(causal=True, softcap=30.0))):
                calls[f"attention/{tag}/d{d}/{mask}"] = (
                    lambda q, k, v, o=options: attention(q, k, v, **o), shapes)
                calls[f"attention/{tag}/d{d}/{mask}/grad"] = (
                    _grad(lambda q, k, v, o=options: attention(q, k, v, **o)), shapes)
    base = _arrays(2, 1000, 1300, 8, 2, 128, 128)
    calls["attention/unequal_causal_lse_grad"] = (
        _grad(lambda q, k, v: attention(q, k, v, causal=True, return_lse=True)), base)
    calls["attention/deterministic_grad"] = (
        _grad(lambda q, k, v: attention(q, k, v, causal=True, deterministic=True)),
        _arrays(2, 2048, 2048, 8, 2, 192, 128))
    calls["attention/decode_gqa"] = (lambda q, k, v: attention(q, k, v), _arrays(4, 1, 8192, 32, 4, 128, 128))
    calls["attention/decode_ragged"] = (
        lambda q, k, v, kl: attention(q, k, v, key_value_seq_lengths=kl),
        (*_arrays(4, 1, 8192, 32, 4, 128, 128), _i32(4)))
    calls["attention/short_causal"] = (lambda q, k, v: attention(q, k, v, causal=True),
                                       _arrays(8, 512, 512, 16, 16, 64, 64))
    calls["attention/ragged_grad"] = (
        _grad(lambda q, k, v, ql, kl: attention(q, k, v, causal=True, query_seq_lengths=ql,
                                                key_value_seq_lengths=kl)),
        (*base, _i32(2), _i32(2)))
    calls["attention/segments_grad"] = (
        _grad(lambda q, k, v, qi, ki: attention(q, k, v, causal=True, query_segment_ids=qi,
                                                kv_segment_ids=ki)),
        (*_arrays(2, 1024, 1024, 8, 2, 128, 128), _i32(2, 1024), _i32(2, 1024)))
    calls["attention/segments_deterministic_grad"] = (
        _grad(lambda q, k, v, qi, ki: attention(q, k, v, query_segment_ids=qi, kv_segment_ids=ki,
                                                deterministic=True)),
        (*_arrays(2, 1024, 1024, 8, 2, 64, 64), _i32(2, 1024), _i32(2, 1024)))
    calls["attention/mask_shared_grad"] = (
        _grad(lambda q, k, v, m: attention(q, k, v, mask=m, window_size=(256, None))),
        (*_arrays(2, 1024, 1024, 8, 2, 128, 128), _bool(2, 1, 1024, 1024)))
    calls["attention/mask_per_head"] = (
        lambda q, k, v, m: attention(q, k, v, mask=m),
        (*_arrays(2, 512, 512, 4, 2, 64, 64), _bool(2, 4, 512, 512)))
    calls["attention/reference"] = (lambda q, k, v: attention(q, k, v, implementation="reference"),
                                    _arrays(1, 256, 256, 2, 2, 64, 64))
    calls["dot_product/causal_grad"] = (
        _grad(lambda q, k, v: fa4_jax.dot_product_attention(q, k, v, is_causal=True)),
        _arrays(2, 1024, 1024, 8, 2, 128, 128))
    calls["dot_product/window_lengths"] = (
        lambda q, k, v, ql, kl: fa4_jax.dot_product_attention(
            q, k, v, local_window_size=(64, 16), query_seq_lengths=ql, key_value_seq_lengths=kl),
        (*_arrays(2, 700, 900, 8, 8, 64, 64), _i32(2), _i32(2)))
    calls["dot_product/mask_residual"] = (
        lambda q, k, v, m: fa4_jax.dot_product_attention(q, k, v, mask=m, return_residual=True),
        (*_arrays(2, 512, 512, 8, 8, 128, 128), _bool(2, 1, 512, 512)))
    calls["dot_product/bias"] = (
        lambda q, k, v, bias: fa4_jax.dot_product_attention(q, k, v, bias=bias),
        (*_arrays(1, 256, 256, 4, 4, 64, 64), jax.ShapeDtypeStruct((1, 4, 256, 256), jnp.bfloat16)))
    packed = _arrays(1, 3000, 3000, 8, 2, 128, 128)
    calls["varlen/one_packing_grad"] = (
        _grad(lambda q, k, v, cu: fa4_jax.varlen_attention(q[0], k[0], v[0], cu, cu, max_seqlen_q=1500,
                                                           max_seqlen_k=1500, causal=True)[None]),
        (*packed, _i32(4)))
    calls["varlen/two_packings"] = (
        lambda q, k, v, cq, ck: fa4_jax.varlen_attention(q[0], k[0], v[0], cq, ck, max_seqlen_q=1500,
                                                         max_seqlen_k=1500, causal=True),
        (*packed, _i32(4), _i32(4)))
    from fa4_jax.flax import make_attention_fn
    flax_shapes = _arrays(2, 512, 512, 8, 8, 64, 64)
    calls["flax/causal"] = (lambda q, k, v: make_attention_fn(causal=True)(q, k, v), flax_shapes)
    calls["flax/causal_mask"] = (
        lambda q, k, v, m: make_attention_fn(causal=True)(q, k, v, mask=m),
        (*flax_shapes, _bool(2, 1, 512, 512)))
    return calls


def _program(function, shapes) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = jax.jit(function).trace(*shapes).lower(lowering_platforms=("cuda",))
    text = lowered.as_text(debug_info=False)
    return re.sub(r"\s*loc\([^)]*\)", "", text)


def fingerprints() -> dict[str, dict]:
    monkeypatch = pytest.MonkeyPatch()
    use_h200_menu(monkeypatch)
    found = {}
    for name, (function, shapes) in corpus().items():
        try:
            text = _program(function, shapes)
            found[name] = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text}
        except Exception as error:  # a call that does not lower is a finding too
            found[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(f"{name}: {found[name].get('sha256', found[name].get('error'))[:16]}", flush=True)
    monkeypatch.undo()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, help="a file this script wrote on another tree")
    parser.add_argument("--targets", nargs="*", default=[], metavar="OLD=NEW",
                        help="custom-call target renames applied to the other tree's programs")
    args = parser.parse_args()
    found = fingerprints()
    args.out.write_text(json.dumps(found, indent=1))
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    renames = dict(pair.split("=", 1) for pair in args.targets)
    differ = []
    for name in sorted(set(before) | set(found)):
        old, new = before.get(name, {}), found.get(name, {})
        old_text = old.get("text")
        for a, b in renames.items():
            old_text = old_text and old_text.replace(f'"{a}"', f'"{b}"')
        if old_text is None or new.get("text") is None or old_text != new["text"]:
            differ.append(name)
    same = len(set(before) & set(found)) - len([n for n in differ if n in before and n in found])
    print(f"{same} programs identical, {len(differ)} differ: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    np.set_printoptions(threshold=10)
    sys.exit(main())
