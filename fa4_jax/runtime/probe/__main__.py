"""`python -m fa4_jax.runtime.probe`: the probe process (fa4_jax.runtime.probe.child)."""
import sys

from fa4_jax.runtime.probe.child import main

sys.exit(main())
