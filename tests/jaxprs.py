"""Walking a jaxpr and every jaxpr nested in its equations (scan, cond, remat, custom_vjp)."""


def walk(jaxpr):
    """Yields `jaxpr`, then each sub-jaxpr of its equations' params, depth first."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                # Sub-jaxprs come bare (remat) or closed (scan, custom_vjp).
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from walk(sub)
