"""`python -m fa4_jax COMMAND [ARGS...]`: the package's commands (fa4_jax.tools).

    demo       train a small Flax transformer with fa4_jax and with jax's attention, and compare
    selftest   check every compiled kernel for this GPU against the reference
    verdicts   show, forget or check the first-use verdicts of this library on this GPU

`python -m fa4_jax COMMAND --help` tells a command's arguments.
"""
import importlib
import sys

COMMANDS = ("demo", "selftest", "verdicts")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command = importlib.import_module(f"fa4_jax.tools.{argv[0]}")
    return command.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
