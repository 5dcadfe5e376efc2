"""What runs a call the kernels do not serve: the pure-JAX reference and cuDNN (through
`jax.nn.dot_product_attention`)."""
