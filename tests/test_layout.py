"""CPU tier: the package's import graph has no circle and no arrow up its layers
(scripts/import_graph.py; docs/design.md's layout), and the count finds both when they exist."""
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_has_no_circle_and_no_upward_arrow():
    _, graph, circles, upward = load_script("import_graph").report(ROOT)
    assert len(graph) > 50, "the walk found too few modules to be the package"
    assert circles == [], f"import circles: {circles}"
    assert upward == [], f"imports that run up the layers (module -> imported): {upward}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"fa4_jax/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_circle_and_a_call_of_the_public_api_from_below_are_found(tmp_path):
    root = _package(tmp_path, {
        "fa4_jax/runtime/__init__.py": "",
        "fa4_jax/runtime/dispatch.py": "def f():\n    import fa4_jax\n    return fa4_jax\n",
        "fa4_jax/core/__init__.py": "",
        "fa4_jax/core/a.py": "from fa4_jax.core import b\n",
        "fa4_jax/core/b.py": "from fa4_jax.core.a import x\n",
    })
    _, _, circles, upward = load_script("import_graph").report(root)
    assert circles == [["fa4_jax.core.a", "fa4_jax.core.b"]]
    assert upward == [("fa4_jax.runtime.dispatch", "fa4_jax")]
