"""The command line: ``python -m punica_numba COMMAND [ARGS]``.

Commands:
    demo   serve a mixed batch over PEFT adapters, check it against PEFT (punica_numba.demo)
    bench  time shrink and expand against the copy-bandwidth limit (punica_numba.bench)
    tune   time every launch configuration, write this GPU's table (punica_numba.tuning.sweep)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: command -> one-line help; each command is a module with ``main(argv) -> int``.
COMMANDS = {
    "demo": "serve a mixed batch over PEFT adapters through the engine; check it "
    "against PEFT and time it",
    "bench": "time shrink and expand (CUDA-graph replay) against the copy-bandwidth limit "
    "and torch baselines",
    "tune": "check and time every launch configuration over a grid of problems; write this "
    "GPU's tuned table (JSON)",
}

USAGE = "usage: python -m punica_numba COMMAND [ARGS]  (COMMAND --help for its options)"


def _help() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; return its exit code (2 for a usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_help(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        print(_help())
        return 0
    if command == "demo":
        from . import demo  # imported on demand: help needs no kernels

        return demo.main(rest)
    if command == "bench":
        from . import bench

        return bench.main(rest)
    if command == "tune":
        from .tuning import sweep

        return sweep.main(rest)
    print(
        f"{USAGE}\nerror: unknown command {command!r}; choose from {sorted(COMMANDS)}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
