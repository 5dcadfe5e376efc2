"""Value types that import nothing else from fa4_jax: a call's static parameters, which pairs
it sees, the numerics rule, the notices a call emits."""
