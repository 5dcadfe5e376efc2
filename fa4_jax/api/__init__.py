"""The public entry points (re-exported by `fa4_jax`): `attention` and `explain`, the
`jax.nn.dot_product_attention` drop-in, `varlen_attention`, ring attention. They validate the
call, describe it as one `core` value per idea, and hand it to `ops`."""
