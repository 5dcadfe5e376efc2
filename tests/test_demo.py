"""The training demo: it runs, its two loss curves agree, and its agreement check can fail."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import fa4_jax
from fa4_jax import demo
from fa4_jax.flax import make_attention_fn

TINY_STEPS = 8


def test_demo_tiny_run_agrees_and_writes_plot(tmp_path, capsys):
    plot = tmp_path / "loss.png"
    exit_code = demo.main(["--config", "tiny", "--steps", str(TINY_STEPS), "--out", str(plot)])
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    assert "-> AGREE" in printed
    assert "reference" in printed  # no GPU here: the demo must say it runs the reference
    assert plot.stat().st_size > 0
    curves = json.loads((tmp_path / "loss.json").read_text())
    assert curves["comparison"]["agree"] is True and curves["settings"]["steps"] == TINY_STEPS
    runs = curves["runs"]
    assert set(runs) == {"fa4_jax", "jax.nn (xla)"}
    for run in runs.values():
        assert len(run["losses"]) == TINY_STEPS and all(np.isfinite(run["losses"]))
        assert run["tokens_per_s"] > 0


def test_compare_curves_rule(seed):
    rng = np.random.default_rng(seed)
    reference = rng.uniform(1.0, 4.0, size=200)
    early_rtol, smoothed_rtol = demo.EARLY_RTOL["float32"], demo.SMOOTHED_RTOL["float32"]

    def agree(losses):
        return demo.compare_curves(losses, reference, "float32").agree

    assert agree(reference.copy())
    early_error = reference.copy()
    early_error[rng.integers(demo.EARLY_STEPS)] *= 1 + 2 * early_rtol
    assert not agree(early_error)
    # Late single-step drift of the size chaotic amplification produces is tolerated...
    late_spike = reference.copy()
    late_spike[demo.EARLY_STEPS + rng.integers(100)] *= 1 + smoothed_rtol
    assert agree(late_spike)
    # ...a sustained late offset is not.
    late_offset = reference.copy()
    late_offset[-2 * demo.SMOOTHING_STEPS:] *= 1 + 2 * smoothed_rtol
    assert not agree(late_offset)
    poisoned = reference.copy()
    poisoned[-1] = np.nan
    assert not agree(poisoned)


def test_non_causal_attention_is_caught_by_the_loss_comparison():
    # A real bug, attention that sees the future, must fail the demo's check.
    config = dataclasses.replace(demo.CONFIGS["tiny"], steps=TINY_STEPS)
    mesh = demo.make_mesh(config.num_heads, head_ways=1)
    sampler, vocab_size = demo.make_sampler(config, mesh)
    leaky = demo.Decoder(vocab_size, config, make_attention_fn(causal=False))
    causal = demo.Decoder(vocab_size, config, demo.make_baseline_attention_fn("xla"))
    leaky_losses, _ = demo.train("leaky", leaky, config, sampler, mesh)
    causal_losses, _ = demo.train("causal", causal, config, sampler, mesh)
    assert not demo.compare_curves(leaky_losses, causal_losses, config.dtype).agree


def test_head_parallel_attention_is_local_per_head_shard(next_key):
    """The demo's (data, heads) mesh: attention equals unsharded, output stays head-sharded, and
    the compiled step gathers nothing (each device attends with its own heads)."""
    mesh = demo.make_mesh(num_heads=4)
    assert dict(mesh.shape) == {"data": jax.device_count() // 2, "heads": 2}
    q, k, v = (jax.random.normal(next_key(), (8, 32, 4, 16), jnp.float32) for _ in range(3))
    sharded = jax.jit(demo.head_parallel(make_attention_fn(causal=True), mesh))
    out = sharded(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("data", None, "heads")), out.ndim)
    np.testing.assert_allclose(out, fa4_jax.attention(q, k, v, causal=True), atol=1e-5, rtol=1e-5)
    compiled = sharded.lower(q, k, v).compile().as_text()
    assert "all-gather" not in compiled and "all-to-all" not in compiled


def test_tensor_parallel_step_equals_the_data_parallel_step():
    """The (data, heads) mesh's tensor-parallel parameters: the projections and MLP weights are
    split over "heads" on the devices, and a training step gives the losses and parameters of
    the same step with every parameter replicated."""
    config = dataclasses.replace(demo.CONFIGS["tiny"], steps=3)
    tensor_parallel = demo.make_mesh(config.num_heads, head_ways=2)
    data_parallel = demo.make_mesh(config.num_heads, head_ways=1)
    results = {}
    for name, mesh in (("tensor", tensor_parallel), ("data", data_parallel)):
        sampler, vocab_size = demo.make_sampler(config, mesh)
        model = demo.Decoder(vocab_size, config,
                             demo.head_parallel(make_attention_fn(causal=True), mesh))
        params = model.init(jax.random.key(demo.SEED), sampler(0)[:, :-1])["params"]
        shardings = demo.param_sharding(params, mesh)
        results[name] = demo.train(name, model, config, sampler, mesh)[0]
        if name == "tensor":
            block = shardings["DecoderBlock_0"]
            attention = block["MultiHeadDotProductAttention_0"]
            assert attention["query"]["kernel"].spec == PartitionSpec(None, "heads", None)
            assert attention["out"]["kernel"].spec == PartitionSpec("heads", None, None)
            assert block["mlp_out"]["kernel"].spec == PartitionSpec("heads", None)
            shard_shapes = {s.data.shape for s in jax.device_put(
                params, shardings)["DecoderBlock_0"]["mlp_in"]["kernel"].addressable_shards}
            assert shard_shapes == {(config.d_model, 2 * config.d_model)}
    np.testing.assert_allclose(results["tensor"], results["data"], rtol=1e-5)
