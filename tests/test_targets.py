"""CPU tier: the custom call targets' table (fa4_jax.abi.targets) against what names a target: the
calls the run time lowers, the program an earlier release exported, and the sources. The built
library's handlers against the table: tests/test_build.py."""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from fa4_jax.abi import targets
from fa4_jax.core.params import AttentionParams
from fa4_jax.runtime import ffi

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "tests" / "data" / "attention_v2.jaxexport"
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @(\w+)\(([^)]*)\).*?mhlo\.backend_config = \{([^}]*)\}")


def _custom_calls(module_text: str) -> list[tuple[str, int, dict]]:
    """(target, operand count, attributes as text) of each custom call of a StableHLO module."""
    calls = []
    for target, operands, attributes in _CUSTOM_CALL.findall(module_text):
        pairs = (item.split(" = ", 1) for item in attributes.split(", "))
        calls.append((target, len(operands.split(", ")), {name: value for name, value in pairs}))
    return calls


def _lowered_calls(monkeypatch, operands: str) -> list[tuple[str, int, dict]]:
    """The custom calls of a causal forward and its gradient, lowered for CUDA as on an H200 (no
    GPU needed to lower), with `operands`: none, segment ids or a mask."""
    from tests.h200_menu import use_h200_menu

    use_h200_menu(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    extra = {"none": {}, "segment ids": dict(query_segment_ids=ids, kv_segment_ids=ids),
             "mask": dict(mask=jax.ShapeDtypeStruct((2, 1, 256, 256), jnp.bool_))}[operands]

    def value_and_grads(q, k, v, extra):
        def loss(q, k, v):
            out = fa4_jax.attention(q, k, v, causal=True, implementation="cute", **extra)
            return out.astype(jnp.float32).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    lowered = jax.jit(value_and_grads).trace(q, q, q, extra).lower(lowering_platforms=("cuda",))
    return _custom_calls(lowered.as_text())


@pytest.mark.parametrize("operands, count", [("none", 0), ("segment ids", targets.SEGMENT_OPERANDS),
                                             ("mask", targets.MASK_OPERANDS)])
def test_a_call_names_the_current_target_and_counts_its_optional_operands(monkeypatch, operands, count):
    # The handler's instantiate stage sees the attribute, not the operands: it loads the variants
    # of the count the attribute gives, and execute checks the operands against it.
    calls = _lowered_calls(monkeypatch, operands)
    assert sorted(target for target, _, _ in calls) == sorted(
        targets.TARGETS[kind].current.name for kind in ("fwd", "bwd"))
    for target, operand_count, attributes in calls:
        kind = next(kind for kind, kind_targets in targets.TARGETS.items()
                    if kind_targets.current.name == target)
        assert attributes["optional_operands"] == f"{count} : i32", target
        assert operand_count == targets.TARGETS[kind].fixed_operands + count, target


def test_a_call_of_more_optional_operands_than_any_target_takes_is_refused():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    library = ffi.Library(path="(none)", compiled=frozenset(), routes=(), dq_copies_max_keys={},
                          tuning_targets=False)
    attrs = ffi.attributes(AttentionParams(softmax_scale=0.1))
    with pytest.raises(ValueError, match="3 optional operands"):
        ffi.forward_call(library, q, q, q, ffi.seq_used(None), attrs, segments=(q, q, q))


def test_the_earlier_releases_program_calls_registered_names_as_they_were():
    # tests/data/attention_v2.jaxexport, exported by the release before one handler per kind
    # (tests/gpu/test_export.py runs it): each call names a legacy target, whose handler pair
    # fixes the optional operands the call passes, and carries the problem's attributes only.
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    exported = jax.export.deserialize(bytearray(ARTIFACT.read_bytes()))
    legacy = {target.name: (kind, target) for kind, kind_targets in targets.TARGETS.items()
              for target in kind_targets.legacy}
    problem = set(ffi.attributes(AttentionParams(softmax_scale=0.1)))
    calls = _custom_calls(exported.mlir_module())
    assert {name for name, _, _ in calls} == {"fa4_jax_fwd_v2", "fa4_jax_bwd_v2"}
    for name, operand_count, attributes in calls:
        assert name in legacy, name
        kind, target = legacy[name]
        assert operand_count == targets.TARGETS[kind].fixed_operands + target.optional_operands, name
        assert set(attributes) == problem | ({"deterministic"} if kind == "bwd" else set()), name
    checks = {str(check) for check in ffi.export_disabled_checks()}
    assert {str(check) for check in exported.disabled_safety_checks} <= checks


def test_every_registered_name_is_one_targets_and_each_legacy_one_fixes_a_count():
    names = [target.name for development in (False, True) for target in targets.registered(development)]
    assert len(names) == len(set(names))
    for kind_targets in targets.TARGETS.values():
        assert kind_targets.current.optional_operands is None
        assert kind_targets.development.handler == kind_targets.current.handler
        for target in kind_targets.legacy:
            assert target.optional_operands in targets.OPTIONAL_OPERANDS, target
            # The current pair needs the attribute that a legacy call lacks.
            assert target.handler != kind_targets.current.handler, target


def test_only_the_table_writes_a_target_name():
    # Everything else reads the table, so that a new target is one edit: the run time's calls,
    # its registration, export's disabled checks, the scripts and benchmarks.
    name = re.compile(r"fa4_jax_(dev_)?(fwd|bwd)_\w*v\d+")
    table = ROOT / "fa4_jax" / "abi" / "targets.py"
    sources = [*(ROOT / "fa4_jax").rglob("*.py"), *(ROOT / "ffi").iterdir(),
               *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").rglob("*")]
    writers = [str(path.relative_to(ROOT)) for path in sources
               if path != table and path.is_file() and name.search(path.read_text(errors="replace"))]
    assert writers == []
