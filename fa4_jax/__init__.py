"""fa4_jax: FlashAttention-4 kernels for JAX."""
__version__ = "0.1.0"
