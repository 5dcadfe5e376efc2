"""fa4_jax: FlashAttention-4 kernels for JAX.

Public surface: `attention` (the full-featured entry point) and `dot_product_attention`
(a drop-in for `jax.nn.dot_product_attention`).
"""
from fa4_jax.api import attention, dot_product_attention

__version__ = "0.1.0"

__all__ = ["attention", "dot_product_attention", "__version__"]
