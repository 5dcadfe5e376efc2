"""The static description of one attention call, shared by every backend.

`AttentionParams` is what `api.attention` hands to the differentiable op after validation: plain
Python values, hashable, so it can be a `nondiff_argnums` of `jax.custom_vjp` and a static
attribute source for the FFI call. It imports nothing else from the package.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Validated, canonical options of one attention call.

    Mask semantics (query row i in [0, seqlen_q), key column j in [0, seqlen_k)), with the
    alignment offset `offset = seqlen_k - seqlen_q` (bottom-right, FlashAttention's rule and
    `fa4_jax.attention`'s) or `offset = 0` (top_left: jax.nn.dot_product_attention's rule):

    - causal: key j is visible when j <= i + offset;
    - window_left (None = unbounded): visible when j >= i + offset - window_left;
    - window_right (None = unbounded): visible when j <= i + offset + window_right.

    A row with no visible key produces output 0 and lse -inf.

    Ragged batch: the op may also receive int32 arrays q_len, kv_len [batch] (array operands,
    so their values may change without a retrace). In entry b only rows i < q_len[b]
    and keys j < kv_len[b] exist, and offset = kv_len[b] - q_len[b] (0 when top_left); other
    rows have output 0 and lse -inf, other keys get zero gradient.

    Attributes:
      softmax_scale: multiplies q·k before the softcap and the softmax.
      causal: bottom-right aligned causal mask.
      window_left, window_right: sliding-window bounds, ints >= 0 or None.
      softcap: if not None, scores become softcap * tanh(scores / softcap).
      top_left: align causal and window masks to the top-left corner (offset 0) instead of
        the bottom-right; canonically False when it makes no difference (no mask).
      deterministic: the backward pass must be bitwise reproducible.
      implementation: the resolved backend, "cute" or "reference".
      require_kernels: the caller asked for the kernels (implementation="cute"): a backward
        they cannot run raises instead of taking the reference.
    """

    softmax_scale: float
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    softcap: float | None = None
    top_left: bool = False
    deterministic: bool = False
    implementation: str = "reference"
    require_kernels: bool = False
