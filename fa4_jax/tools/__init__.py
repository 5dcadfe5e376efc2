"""Commands built on the public API: the demo, the selftest, the first-use verdicts
(`python -m fa4_jax demo | selftest | verdicts`)."""
