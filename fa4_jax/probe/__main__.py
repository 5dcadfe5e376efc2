"""`python -m fa4_jax.probe`: the probe process (fa4_jax.probe.child)."""
import sys

from fa4_jax.probe.child import main

sys.exit(main())
