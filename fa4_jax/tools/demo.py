"""`python -m fa4_jax demo`: train a small GPT-style decoder whose attention is fa4_jax.

The model (Flax Linen) uses `nn.MultiHeadDotProductAttention(attention_fn=make_attention_fn(
causal=True))`. It is trained on a synthetic corpus generated here (`demo_corpus`), then trained
again from the same seed on the same batches with `jax.nn.dot_product_attention` as the
attention. The two loss curves must agree within a tolerance set by the compute dtype; the demo
prints both throughputs, writes a PNG of both curves and a JSON of their per-step losses, and
exits non-zero when they disagree.

Without a GPU it runs a small fp32 configuration on fa4_jax's pure-JAX reference (a minute or two
on two CPU cores). On a GPU it runs a larger bf16 configuration on the fa4_jax kernels. All
visible devices are used through a (data, heads) `Mesh` (`make_mesh`): the batch is sharded over
"data", and each block is tensor parallel over "heads" (Megatron's split: the q/k/v projections
and the MLP's first layer by output columns, the attention output projection and the MLP's
second layer by input rows, `param_sharding`), so each device runs the attention of its own heads
with no collective inside attention (fa4_jax's partitioning rules) and XLA adds one all-reduce
after each block half.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

import fa4_jax
from fa4_jax.tools.demo_corpus import CharTokenizer, generate_corpus
from fa4_jax.flax import make_attention_fn

SEED = 0


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    d_model: int
    num_layers: int
    num_heads: int
    seq_len: int
    batch: int
    steps: int
    learning_rate: float
    dtype: str  # compute dtype; parameters and optimizer state stay fp32
    corpus_chars: int


CONFIGS = {
    "tiny": DemoConfig(d_model=64, num_layers=2, num_heads=4, seq_len=64, batch=8, steps=10,
                       learning_rate=3e-3, dtype="float32", corpus_chars=100_000),
    "small": DemoConfig(d_model=128, num_layers=2, num_heads=4, seq_len=128, batch=8, steps=200,
                        learning_rate=2e-3, dtype="float32", corpus_chars=400_000),
    "gpu": DemoConfig(d_model=1024, num_layers=8, num_heads=16, seq_len=2048, batch=16,
                      steps=300, learning_rate=6e-4, dtype="bfloat16", corpus_chars=4_000_000),
}

# How the two loss curves must agree (relative differences |loss_fa4 - loss_ref| / loss_ref).
# Two correct attentions differ only in rounding, but training amplifies that chaotically. So the
# check is two-part:
# - the first EARLY_STEPS steps, still tightly coupled, per step: fp32 1e-4 (>100x the measured
#   2e-7); bf16 2e-2 (bf16 keeps 8 mantissa bits, 2^-8 ~ 4e-3 relative per rounding, and the
#   implementations round probabilities and accumulate differently; measured 6e-4 on CPU,
#   2.4e-3 and 3.9e-3 on H200s on 2026-11-30);
# - the whole curve after a SMOOTHING_STEPS moving average, up to a time shift: each run's
#   smoothed loss at step t must be within SHIFTED_RTOL of the other run's at some step within
#   shift_steps of t. A tolerance on the loss alone cannot tell chaos from a bug in bf16: the
#   `gpu` config's runs sit on a plateau near 2.15 nats/char from step ~30, and the step at which
#   each leaves it (140-200) moves with rounding. In a 2-GPU run of 2026-11-30 (read off
#   its loss plot) fa4_jax's smoothed loss crossed 2.1 21 steps after cuDNN's,
#   1.8 31 steps after, and ended at 1.70, which cuDNN's had reached 57 steps before the end: the
#   later run descends under a lower, still decaying learning rate, so the lag grows. Unshifted,
#   the curves ended 1.2e-1 apart; a shift of up to 33 steps brings them within 8e-2, of up to
#   60 steps within 4e-3. SHIFT_FRACTION 0.2 (60 of 300 steps) is about twice those 33 steps,
#   and a fraction because --steps stretches the schedule (10% warmup, cosine over all steps)
#   and the plateau with it.
#   The run ahead at the end is not held to the other's losses past the other's last step, which
#   were never trained: where the window runs past it, a loss below the whole window agrees.
#   Losses too low from a bug (attention that sees the future) show within a few steps, which
#   the first part checks.
#   The shift only ever lowers the difference (the window holds step t), so the tolerances of
#   the unshifted moving averages stay safe: 3e-2 fp32 (a 4-layer model drifted 1.1% apart, one
#   run passing a learning transition a few steps earlier), 8e-2 bf16 (five H200 runs measured
#   0.7-4.0e-2 unshifted; twice the largest).
# A real bug is far outside both: attention that sees the future, a wrong scale or a broken
# gradient moves the loss by tens of percent within a few steps, and NaN never agrees. A run that
# stalls on the plateau is caught once the other has gone SHIFTED_RTOL below it more than
# shift_steps before the end: 2.15 -> 1.98 took cuDNN to step 194 in that run, 106 steps before
# the end. Each run writes both curves beside its PNG (`write_curves`), so a disagreement can be
# looked at step by step.
EARLY_STEPS = 50
SMOOTHING_STEPS = 10
SHIFT_FRACTION = 0.2
EARLY_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}
SHIFTED_RTOL = {"float32": 3e-2, "bfloat16": 8e-2}


class DecoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    num_heads: int
    dtype: jnp.dtype
    attention_fn: Callable

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        init = nn.initializers.normal(0.02)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        # mask=None: causality is a property of attention_fn (see fa4_jax.flax).
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dtype=self.dtype, use_bias=False, kernel_init=init,
            attention_fn=self.attention_fn)(h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.gelu(nn.Dense(4 * d_model, dtype=self.dtype, kernel_init=init, name="mlp_in")(h))
        return x + nn.Dense(d_model, dtype=self.dtype, kernel_init=init, name="mlp_out")(h)


class Decoder(nn.Module):
    """GPT-style language model: token + learned position embeddings, blocks, LM head."""

    vocab_size: int
    config: DemoConfig
    attention_fn: Callable

    @nn.compact
    def __call__(self, tokens):
        dtype = jnp.dtype(self.config.dtype)
        embed_init = nn.initializers.normal(0.02)
        x = nn.Embed(self.vocab_size, self.config.d_model, embedding_init=embed_init)(tokens)
        positions = jnp.arange(tokens.shape[-1])
        x = x + nn.Embed(self.config.seq_len, self.config.d_model,
                         embedding_init=embed_init)(positions)
        x = x.astype(dtype)
        for _ in range(self.config.num_layers):
            x = DecoderBlock(self.config.num_heads, dtype, self.attention_fn)(x)
        x = nn.LayerNorm(dtype=dtype)(x)
        # Small head init keeps the first logits near uniform, so early steps stay stable.
        head = nn.Dense(self.vocab_size, dtype=dtype, kernel_init=nn.initializers.normal(0.02))
        return head(x).astype(jnp.float32)


def make_mesh(num_heads: int, head_ways: int | None = None) -> Mesh:
    """All devices as a (data, heads) mesh.

    head_ways: the tensor-parallel ways. By default 2 when there are 4 or more devices (an even
    number) and the heads are even, so both kinds of parallelism run; else 1, all data
    parallel: on 2 GPUs a model this small runs faster split by batch than by heads.
    """
    devices = np.array(jax.devices())
    if head_ways is None:
        head_ways = 2 if devices.size >= 4 and devices.size % 2 == 0 and num_heads % 2 == 0 else 1
    if head_ways < 1 or devices.size % head_ways or num_heads % head_ways:
        raise ValueError(f"head_ways={head_ways} must divide the device count ({devices.size}) "
                         f"and the number of heads ({num_heads})")
    return Mesh(devices.reshape(devices.size // head_ways, head_ways), ("data", "heads"))


# Tensor parallelism over "heads", by parameter: (module name, parameter name) -> the spec.
# Column-parallel layers keep their outputs split by heads (or MLP features) into the next,
# row-parallel layer, whose partial sums XLA all-reduces: one all-reduce per block half.
_TENSOR_PARALLEL_SPECS = {
    ("query", "kernel"): PartitionSpec(None, "heads", None),  # [d_model, heads, head_dim]
    ("key", "kernel"): PartitionSpec(None, "heads", None),
    ("value", "kernel"): PartitionSpec(None, "heads", None),
    ("out", "kernel"): PartitionSpec("heads", None, None),  # [heads, head_dim, d_model]
    ("mlp_in", "kernel"): PartitionSpec(None, "heads"),  # [d_model, 4 d_model]
    ("mlp_in", "bias"): PartitionSpec("heads"),
    ("mlp_out", "kernel"): PartitionSpec("heads", None),  # [4 d_model, d_model]
}


def param_sharding(params, mesh: Mesh):
    """The NamedSharding of each parameter: tensor parallel over "heads" where
    `_TENSOR_PARALLEL_SPECS` names it, replicated otherwise (embeddings, norms, LM head)."""

    def sharding_of(path, _):
        names = tuple(getattr(entry, "key", None) for entry in path[-2:])
        return NamedSharding(mesh, _TENSOR_PARALLEL_SPECS.get(names, PartitionSpec()))

    return jax.tree_util.tree_map_with_path(sharding_of, params)


def head_parallel(attention_fn: Callable, mesh: Mesh) -> Callable:
    """attention_fn with q, k, v and its output sharded [data, -, heads, -] on `mesh`."""
    by_heads = NamedSharding(mesh, PartitionSpec("data", None, "heads", None))

    @functools.wraps(attention_fn)  # linen passes the keywords the wrapped signature names
    def sharded_attention_fn(query, key, value, **kwargs):
        query, key, value = (jax.lax.with_sharding_constraint(x, by_heads) for x in (query, key, value))
        return jax.lax.with_sharding_constraint(attention_fn(query, key, value, **kwargs), by_heads)

    return sharded_attention_fn


def make_baseline_attention_fn(implementation: str) -> Callable:
    """Causal `jax.nn.dot_product_attention` with Flax's attention_fn contract (no mask/bias)."""

    def baseline_attention_fn(query, key, value):
        return jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                            implementation=implementation)

    return baseline_attention_fn


class BatchSampler:
    """Random windows of seq_len + 1 tokens; batch `step` is the same in every run."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, sharding: NamedSharding):
        self.tokens, self.seq_len, self.batch, self.sharding = tokens, seq_len, batch, sharding

    def __call__(self, step: int) -> jax.Array:
        rng = np.random.default_rng((SEED, step))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        return jax.device_put(windows, self.sharding)


def make_sampler(config: DemoConfig, mesh: Mesh) -> tuple[BatchSampler, int]:
    """The corpus as a batch sampler sharded over the mesh, and its vocabulary size."""
    corpus = generate_corpus(config.corpus_chars, seed=SEED)
    tokenizer = CharTokenizer(corpus)
    sampler = BatchSampler(tokenizer.encode(corpus), config.seq_len, config.batch,
                           NamedSharding(mesh, PartitionSpec("data")))
    return sampler, tokenizer.vocab_size


def make_train_step(model: Decoder, optimizer, mesh: Mesh, state_sharding):
    """jit-compiled (params, opt_state, batch) -> (params, opt_state, loss): data parallel over
    the batch, tensor parallel as `state_sharding` ((params, opt_state) shardings) says."""

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharded = NamedSharding(mesh, PartitionSpec("data"))
    return jax.jit(train_step, in_shardings=(*state_sharding, batch_sharded),
                   out_shardings=(*state_sharding, replicated), donate_argnums=(0, 1))


def warmup_steps(total_steps: int) -> int:
    """10% of training, at least 10 steps and at most half of it.

    Adam's first updates are about learning_rate per weight whatever the gradient; a 3-step
    warmup made the 8x1024 model's loss jump from 3.9 to 8.3 in a probe, 30 steps did not.
    """
    return max(1, min(max(10, total_steps // 10), total_steps // 2))


def make_optimizer(config: DemoConfig):
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate,
        warmup_steps=warmup_steps(config.steps), decay_steps=config.steps)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(name: str, model: Decoder, config: DemoConfig, sampler: BatchSampler, mesh: Mesh):
    """Trains from SEED; returns (per-step losses, tokens/s excluding the compiling first step)."""
    optimizer = make_optimizer(config)
    params = model.init(jax.random.key(SEED), sampler(0)[:, :-1])["params"]
    params_sharding = param_sharding(params, mesh)
    params = jax.device_put(params, params_sharding)
    # Adam's moments take their parameter's sharding; its step count is replicated.
    opt_sharding = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
        params_sharding, transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sharding)(params)
    train_step = make_train_step(model, optimizer, mesh, (params_sharding, opt_sharding))

    tokens_per_step = config.batch * config.seq_len
    losses = []
    timed_from = None
    # A log file gets a line every 15 s instead of a carriage-return redraw per step.
    progress = tqdm(range(config.steps), desc=name, unit="step", file=sys.stdout,
                    mininterval=0.1 if sys.stdout.isatty() else 15.0)
    for step in progress:
        params, opt_state, loss = train_step(params, opt_state, sampler(step))
        losses.append(float(loss))  # also waits for the step, so the timing below is honest
        if timed_from is None:
            timed_from = time.perf_counter()
            continue
        elapsed = time.perf_counter() - timed_from
        # refresh=False: set_postfix would otherwise redraw on every step, past mininterval.
        progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False,
                             tok_s=f"{step * tokens_per_step / elapsed:,.0f}")
    progress.close()
    steps_timed = config.steps - 1
    elapsed = time.perf_counter() - timed_from
    tokens_per_s = steps_timed * tokens_per_step / elapsed if steps_timed else float("nan")
    return np.array(losses), tokens_per_s


@dataclasses.dataclass(frozen=True)
class CurveComparison:
    early_max: float  # max per-step relative difference over the first EARLY_STEPS steps
    shift_steps: int  # how many steps the moving averages may be shifted (`shift_steps`)
    shifted_max: float  # max `_shifted_difference` of the moving averages, both ways round
    agree: bool


def shift_steps(steps: int) -> int:
    """The time shift allowed between two runs of `steps` steps: SHIFT_FRACTION of them."""
    return round(SHIFT_FRACTION * steps)


def compare_curves(losses: np.ndarray, reference_losses: np.ndarray, dtype: str) -> CurveComparison:
    """Applies the two-part agreement rule above to two [steps] loss curves; NaN anywhere never
    agrees."""
    early = _relative_difference(losses[:EARLY_STEPS], reference_losses[:EARLY_STEPS])
    shift = shift_steps(len(losses))
    smoothed, reference_smoothed = _moving_average(losses), _moving_average(reference_losses)
    shifted = np.concatenate([_shifted_difference(smoothed, reference_smoothed, shift),
                              _shifted_difference(reference_smoothed, smoothed, shift)])
    early_max, shifted_max = float(np.max(early)), float(np.max(shifted))
    agree = (np.isfinite(early_max) and np.isfinite(shifted_max)
             and early_max <= EARLY_RTOL[dtype] and shifted_max <= SHIFTED_RTOL[dtype])
    return CurveComparison(early_max, shift, shifted_max, bool(agree))


def _relative_difference(values, reference):
    return np.abs(values - reference) / np.abs(reference)


def _moving_average(values):
    window = min(SMOOTHING_STEPS, len(values))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _shifted_difference(values: np.ndarray, other: np.ndarray, shift: int) -> np.ndarray:
    """[n] float: at each step t, the smallest relative difference between values[t] and other's
    values within `shift` steps of t; 0 where that window runs past other's last step and
    values[t] is below all of it (other may yet get there). values and other: [n] float. NaN in
    either gives NaN."""
    differences = np.empty(len(values))
    for t, value in enumerate(values):
        window = other[max(0, t - shift):t + shift + 1]
        ahead_at_the_end = t + shift >= len(other) and value < np.min(window)
        differences[t] = 0.0 if ahead_at_the_end else np.min(_relative_difference(value, window))
    return differences


def write_curves(png_path: str, config_name: str, config: DemoConfig, comparison: CurveComparison,
                 runs: dict[str, tuple[np.ndarray, float]]) -> str:
    """Both runs' per-step losses and tokens/s, the config and the comparison, as JSON beside
    the PNG (same name, .json); returns its path."""
    import json
    import os

    path = os.path.splitext(png_path)[0] + ".json"
    with open(path, "w") as f:
        json.dump({"config": config_name, "settings": dataclasses.asdict(config),
                   "devices": jax.device_count(), "comparison": dataclasses.asdict(comparison),
                   "runs": {name: {"tokens_per_s": float(tps),
                                   "losses": [float(x) for x in losses]}
                            for name, (losses, tps) in runs.items()}}, f, indent=1)
    return path


def plot_curves(path: str, curves: dict[str, np.ndarray], title: str):
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    # Dashed over solid, so that curves which agree still both show.
    for (label, losses), style in zip(curves.items(), ("-", "--")):
        ax.plot(np.arange(1, len(losses) + 1), losses, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(prog="python -m fa4_jax demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gpu" if on_gpu else "small",
                        help="model size and dtype (default: gpu on a GPU, else small)")
    parser.add_argument("--steps", type=int, help="training steps (default: the config's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    parser.add_argument("--batch", type=int,
                        help="global batch, a multiple of the mesh's data axis (default: the config's)")
    parser.add_argument("--head-ways", type=int,
                        help="tensor-parallel ways over attention heads (default: make_mesh's)")
    parser.add_argument("--out", default="fa4_jax_demo_loss.png", help="loss-curve PNG path")
    return parser.parse_args(argv)


def resolve_config(args) -> tuple[DemoConfig, Mesh]:
    """The config with the command line's overrides, and the device mesh it trains on."""
    overrides = {"steps": args.steps, "seq_len": args.seq_len, "batch": args.batch}
    config = dataclasses.replace(CONFIGS[args.config],
                                 **{k: v for k, v in overrides.items() if v is not None})
    if config.steps < 1 or config.seq_len < 1 or config.batch < 1:
        raise SystemExit("--steps, --seq-len and --batch must be positive")
    try:
        mesh = make_mesh(config.num_heads, args.head_ways)
    except ValueError as error:
        raise SystemExit(f"--head-ways: {error}") from None
    if config.batch % mesh.shape["data"]:
        raise SystemExit(f"--batch {config.batch} must be a multiple of the mesh's data axis "
                         f"({mesh.shape['data']}; data parallel over the batch)")
    return config, mesh


def fa4_backend_choice(config: DemoConfig) -> str:
    """What fa4_jax.attention runs the model's attention call on, and why, as fa4_jax says.

    Asked of fa4_jax itself rather than guessed from the platform, so the demo reports the
    fallback even on a GPU without built kernels.
    """
    head_dim = config.d_model // config.num_heads
    qkv = jax.ShapeDtypeStruct((config.batch, config.seq_len, config.num_heads, head_dim),
                               jnp.dtype(config.dtype))
    backend, reason = fa4_jax.which_backend(qkv, qkv, qkv, causal=True)
    names = {"cute": "fa4_jax's kernels", "cudnn": "cuDNN", "reference": "the pure-JAX reference"}
    return names[backend] + ("" if reason is None else f": {reason}")


def main(argv=None) -> int:
    args = parse_args(argv)
    config, mesh = resolve_config(args)
    sampler, vocab_size = make_sampler(config, mesh)
    # cuDNN's attention takes only half precision; XLA's is the baseline everywhere else.
    on_gpu = jax.default_backend() == "gpu"
    baseline_impl = "cudnn" if on_gpu and config.dtype != "float32" else "xla"

    print(f"config {args.config}: {config}")
    print(f"{jax.device_count()} x {jax.devices()[0].device_kind}, mesh "
          f"{dict(mesh.shape)} ({mesh.shape['data']}-way data parallel, {mesh.shape['heads']}-way "
          f"tensor parallel over heads); "
          f"corpus {config.corpus_chars:,} chars, vocab {vocab_size}")
    print(f"attention under test: fa4_jax on {jax.default_backend()} "
          f"[{fa4_backend_choice(config)}]; "
          f"baseline: jax.nn.dot_product_attention(implementation={baseline_impl!r})")

    fa4_model = Decoder(vocab_size, config, head_parallel(make_attention_fn(causal=True), mesh))
    baseline_model = Decoder(vocab_size, config,
                             head_parallel(make_baseline_attention_fn(baseline_impl), mesh))
    fa4_losses, fa4_tps = train("fa4_jax", fa4_model, config, sampler, mesh)
    base_losses, base_tps = train(f"jax.nn ({baseline_impl})", baseline_model, config, sampler,
                                  mesh)

    comparison = compare_curves(fa4_losses, base_losses, config.dtype)
    plot_curves(args.out, {f"fa4_jax ({fa4_tps:,.0f} tok/s)": fa4_losses,
                           f"jax.nn {baseline_impl} ({base_tps:,.0f} tok/s)": base_losses},
                title=f"{args.config}: {config.num_layers}x{config.d_model}, seq {config.seq_len}, "
                      f"{config.dtype}")

    print(f"fa4_jax : final loss {fa4_losses[-1]:.4f}, {fa4_tps:,.0f} tokens/s")
    print(f"baseline: final loss {base_losses[-1]:.4f}, {base_tps:,.0f} tokens/s")
    early_steps = min(EARLY_STEPS, config.steps)
    print(f"loss agreement ({config.dtype}): steps 1-{early_steps} max relative difference "
          f"{comparison.early_max:.1e} (tolerance {EARLY_RTOL[config.dtype]:.0e}); "
          f"{SMOOTHING_STEPS}-step moving averages against the other's closest within "
          f"{comparison.shift_steps} steps {comparison.shifted_max:.1e} "
          f"(tolerance {SHIFTED_RTOL[config.dtype]:.0e}) -> "
          f"{'AGREE' if comparison.agree else 'DISAGREE'}")
    curves_path = write_curves(args.out, args.config, config, comparison,
                               {"fa4_jax": (fa4_losses, fa4_tps),
                                f"jax.nn ({baseline_impl})": (base_losses, base_tps)})
    print(f"loss curves written to {args.out} and {curves_path}")
    return 0 if comparison.agree else 1
