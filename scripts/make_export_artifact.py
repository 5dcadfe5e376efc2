"""Serialize a `jax.export` artifact of fa4_jax's kernels: the test data of the GPU tier's ABI
check (tests/gpu/test_export.py).

    python scripts/make_export_artifact.py tests/data/attention_vN.jaxexport

Run on a GPU whose kernels the library has. The artifact holds the forward and backward custom
calls of a causal bf16 d128 call and a windowed GQA fp16 d64 call, with their problem attributes
only; loading it later on a retuned library must still run (the handler routes by shape). The
calls name the current targets (fa4_jax.abi.targets); tests/data/attention_v2.jaxexport, made
before them, names targets that are now legacy ones.
"""
import sys

import jax
import jax.numpy as jnp

import fa4_jax
from fa4_jax.abi import targets

SHAPES = dict(causal=((1, 256, 4, 128), (1, 256, 4, 128), jnp.bfloat16),
              window=((2, 200, 8, 64), (2, 300, 2, 64), jnp.float16))


def program(q1, k1, v1, q2, k2, v2):
    """(out, dq, dk, dv) of both calls: a loss of out differentiated, on the kernels."""
    def causal(q, k, v):
        return fa4_jax.attention(q, k, v, causal=True, implementation="cute")

    def window(q, k, v):
        return fa4_jax.attention(q, k, v, window_size=(64, 16), softcap=20.0, implementation="cute")

    results = []
    for attend, (q, k, v) in ((causal, (q1, k1, v1)), (window, (q2, k2, v2))):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
        results += [attend(q, k, v), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]
    return tuple(results)


def argument_specs():
    specs = []
    for q_shape, kv_shape, dtype in SHAPES.values():
        specs += [jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
                  jax.ShapeDtypeStruct(kv_shape, dtype)]
    return specs


def main(path: str) -> None:
    exported = jax.export.export(jax.jit(program), platforms=["cuda"],
                                  disabled_checks=fa4_jax.export_disabled_checks())(*argument_specs())
    text = exported.mlir_module()
    assert all(f"@{kind.current.name}(" in text for kind in targets.TARGETS.values()), \
        "the kernels are not in the program"
    with open(path, "wb") as f:
        f.write(exported.serialize())
    print(f"{path}: {len(exported.serialize())} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
