"""The differentiable op: its custom VJP, its sharding rules, and the per-device bodies that
run the kernels (`runtime`) or a fallback."""
