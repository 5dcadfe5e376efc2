"""fa4_jax's import graph: its circles and the arrows that run up the layers.

    python scripts/import_graph.py [--package-root DIR] [--layers old]

Every `import` of a fa4_jax module counts, at module level or inside a function (a deferred
import is still a dependency). A circle is a strongly connected component of more than one
module. Layers, lowest first: core, abi, kernels, runtime and fallbacks, aot, ops, api, tools; an
arrow from a module to one of a higher layer runs up. `--layers old` maps the flat modules of the
layout before the package folders (2026-12) onto the same layers, for a before/after count.
Exit status 1 when there is a circle or an upward arrow.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

LAYERS = {"core": 0, "abi": 1, "kernels": 2, "runtime": 2, "fallbacks": 2, "aot": 3, "ops": 3,
          "api": 4, "flax": 4, "tools": 5, "__init__": 4, "__main__": 6}

# The flat layout's modules, by the layer each now lives in.
OLD_LAYERS = {
    "params": "core", "notices": "core", "numerics_rule": "core",
    "routing": "abi", "segment_layout": "abi", "bwd_workspace": "abi",
    "dispatch": "runtime", "ffi": "runtime", "pack_gqa": "runtime", "split_kv": "runtime",
    "lse_merge": "runtime", "segments": "runtime", "mask_bits": "runtime",
    "verification": "runtime", "verdict_store": "runtime", "probe": "runtime",
    "reference": "fallbacks", "cudnn": "fallbacks",
    "vjp": "ops", "sharding": "ops", "backends": "ops",
    "api": "api", "varlen": "api", "context_parallel": "api", "flax": "api",
    "selftest": "tools", "verdicts": "tools", "demo": "tools", "demo_corpus": "tools",
}


def modules(package: Path) -> dict[str, Path]:
    """Dotted name of each module under package (a package is its __init__)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The fa4_jax modules `name` (at `path`) imports."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                stem = ".".join(base[:len(base) - node.level + 1] + ([stem] if stem else []))
            # `from x import y` imports module x.y when there is one, else (a name of) x.
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(module: str, old: bool) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS["__init__"]
    top = parts[1]
    if old and top in OLD_LAYERS:
        top = OLD_LAYERS[top]
    return LAYERS.get(top)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def report(package_root: Path, old: bool = False):
    """(modules, graph, circles, upward arrows) of the fa4_jax package under package_root."""
    found = modules(package_root / "fa4_jax")
    graph = {name: imports(path, name, set(found)) for name, path in found.items()}
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if None not in (layer(a, old), layer(b, old)) and layer(b, old) > layer(a, old))
    return found, graph, circles(graph), upward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package-root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--layers", choices=("new", "old"), default="new")
    args = parser.parse_args()
    found, graph, loops, upward = report(Path(args.package_root), args.layers == "old")
    print(f"{len(found)} modules, {sum(map(len, graph.values()))} imports")
    print(f"{len(loops)} circle(s)")
    for loop in loops:
        print("  " + " <-> ".join(m.removeprefix("fa4_jax.") for m in loop))
    print(f"{len(upward)} upward arrow(s)")
    for a, b in upward:
        print(f"  {a.removeprefix('fa4_jax.')} -> {b.removeprefix('fa4_jax.')}")
    return 1 if loops or upward else 0


if __name__ == "__main__":
    sys.exit(main())
