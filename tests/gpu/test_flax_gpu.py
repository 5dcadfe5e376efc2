"""GPU tier: a few Flax Linen training steps on the fa4_jax kernels track Flax's own attention.

docs/design.md's numerics rule applied to a training run: the bf16 run on the kernels may deviate
from an fp32 run with Flax's attention by at most twice what Flax's bf16 attention deviates.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fa4_jax.flax import make_attention_fn
from tests.numerics import assert_close_by_rule

pytestmark = pytest.mark.gpu

_UNSERVED = "implementation='cute' cannot serve this call"
STEPS = 5


def train_attention_layer(attention_fn, dtype, seed, mask_of=None):
    """Losses of STEPS Adam steps of one attention layer (8 heads of 128) regressing a target;
    `mask_of(x)`: the mask the module is called with, as model code passes it."""
    k_x, k_target, k_init = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (4, 512, 1024), jnp.float32)
    target = jax.random.normal(k_target, x.shape, jnp.float32)
    module = nn.MultiHeadDotProductAttention(num_heads=8, dtype=dtype, attention_fn=attention_fn)
    params = module.init(k_init, x)["params"]
    mask = None if mask_of is None else mask_of(x)
    optimizer = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return jnp.mean((module.apply({"params": p}, x, mask=mask).astype(jnp.float32) - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return np.array(losses)


def _causal_flax_attention(query, key, value, dtype=None):
    # Flax's way: a dense causal mask; fa4_jax's way: the factory's causal flag.
    mask = nn.make_causal_mask(jnp.ones(query.shape[:2]))
    return nn.dot_product_attention(query, key, value, mask=mask, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_linen_training_on_kernels_tracks_flax_attention(causal, seed):
    flax_attention = _causal_flax_attention if causal else nn.dot_product_attention
    try:
        on_kernels = train_attention_layer(
            make_attention_fn(causal=causal, implementation="cute"), jnp.bfloat16, seed)
    except ValueError as error:
        if _UNSERVED in str(error):
            pytest.skip(str(error))
        raise
    reference = train_attention_layer(flax_attention, jnp.float32, seed)
    flax_bf16 = train_attention_layer(flax_attention, jnp.bfloat16, seed)
    assert_close_by_rule(on_kernels, reference, flax_bf16, name=f"losses (seed {seed})")


def _causal_and_padding_mask(x):
    # Flax's masks as model code builds them: causal, and each row's padding past a length.
    lengths = jnp.asarray([512, 300, 1, 450])
    padding = nn.make_attention_mask(jnp.arange(x.shape[1])[None, :] < lengths[:, None],
                                     jnp.arange(x.shape[1])[None, :] < lengths[:, None])
    return nn.combine_masks(nn.make_causal_mask(jnp.ones(x.shape[:2])), padding)


def test_linen_model_code_passing_flax_masks_runs_on_the_kernels(seed):
    # Existing model code, unchanged: the module is called with Flax's mask arrays; the
    # kernels read them (implementation="cute" raises otherwise).
    on_kernels = train_attention_layer(make_attention_fn(implementation="cute"), jnp.bfloat16, seed,
                                       _causal_and_padding_mask)
    reference = train_attention_layer(nn.dot_product_attention, jnp.float32, seed, _causal_and_padding_mask)
    flax_bf16 = train_attention_layer(nn.dot_product_attention, jnp.bfloat16, seed, _causal_and_padding_mask)
    assert_close_by_rule(on_kernels, reference, flax_bf16, name=f"losses (seed {seed})")
