"""The repository's scripts/ loaded as modules, so the CPU tier can test their pure functions."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py as a module (not run as __main__)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered first: a dataclass looks its module up there while its class is built.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
