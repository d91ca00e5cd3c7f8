"""How often does an op read stale weights or metadata? A table, beyond pass/fail (GPU only).

Runs the scenarios of ``tests/test_fresh_weights.py`` for many iterations: before every
call a writer rewrites the weights (new random values) and the metadata (the other of two
mappings), and each result is checked against the float64 reference. Writers:

* ``torch``: torch's copies, which let the next kernel start only as they end;
* ``slow``: our Numba copy kernel, slow (a spin, then few threads), without
  ``launch_dependents``: a control, as slow as the next;
* ``early``: the same kernel saying ``launch_dependents`` first, so that the op's blocks are
  placed and run their code before the wait while it still spins.

Two kinds of control rows follow the scenarios:

* ``stale B``: the check itself. B left unwritten, so every iteration must come out wrong.
* ``promise broken``: the bare r=64 expand built as if it ran just behind the package's own
  shrink, the promise under which an expand that asks ahead also loads B (and leaves an
  empty tile) before its wait (``punica_numba.kernels.expand_mma``, "B before the wait";
  the wrapper's ``add_lora_linear`` makes it). Behind the early writer that promise is
  false, and this row shows what then happens; behind torch's copies and the slow writer,
  whether the build is safe behind kernels that let the next start only as they end. It
  reaches into ``punica_numba.ops.launching``, which is not public: where that has
  changed, the rows are skipped with a note.

Usage (from the repository root)::

    python tests/fresh_weights_probe.py                      # 200 iterations of each
    python tests/fresh_weights_probe.py --iterations 1000 --only expand --writers early
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the repository root

import torch  # noqa: E402

import punica_numba  # noqa: E402
from tests.fresh_writer import SPIN_NS, NumbaWriter  # noqa: E402
from tests.test_fresh_weights import (  # noqa: E402
    GPU_SCENARIOS,
    MODES,
    WRITER_GRID,
    WRITERS,
    Rig,
    run,
)

COLUMNS = (
    ("scenario", 36),
    ("op", 6),
    ("build", 6),
    ("writer", 6),
    ("mode", 5),
    ("iterations", 10),
    ("wrong", 6),
    ("max error", 10),
    ("x bound", 9),
    ("written", 8),
    ("s", 6),
)


@contextlib.contextmanager
def promise_broken():
    """Within it, every expand is chosen as if launched just behind the package's own shrink
    (``after_own_shrink=True``); raises LookupError where the ops no longer look that way."""
    from punica_numba.ops import launching

    real = getattr(launching, "choose_expand", None)
    if real is None:
        raise LookupError("punica_numba.ops.launching.choose_expand is gone")

    def promised(inputs, weights, output, facts, offset_start, after_own_shrink=False):
        return real(inputs, weights, output, facts, offset_start, True)

    launching.choose_expand = promised
    try:
        yield
    finally:
        launching.choose_expand = real


def row(values) -> str:
    return " ".join(f"{v!s:>{w}}" for v, (_, w) in zip(values, COLUMNS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200, help="checked calls of each")
    parser.add_argument("--only", default="", help="scenarios whose name contains this")
    parser.add_argument("--writers", default="torch,slow,early", help="comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="eager, graph or both")
    parser.add_argument("--no-control", action="store_true", help="skip the stale-B rows")
    parser.add_argument(
        "--spin-us", type=float, default=SPIN_NS / 1000, help="the Numba writers' spin, in µs"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or punica_numba.SIMULATOR:
        print("fresh_weights_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    writers, modes = args.writers.split(","), args.modes.split(",")
    spin_ns = int(args.spin_us * 1000)
    WRITERS["early"] = NumbaWriter(True, *WRITER_GRID, spin_ns=spin_ns)
    WRITERS["slow"] = NumbaWriter(False, *WRITER_GRID, spin_ns=spin_ns)
    for name in writers:
        if name not in WRITERS:
            parser.error(f"unknown writer {name!r}; choose from {sorted(WRITERS)}")
    print(
        f"{torch.cuda.get_device_name()}, dependent launch: {punica_numba.dependent_launch()}, "
        f"torch {torch.__version__}; {args.iterations} iterations each (graph rows: "
        f"after 2 eager warm-ups, which are counted too); Numba writers spin {spin_ns} ns"
    )
    print(row(name for name, _ in COLUMNS))
    total_wrong = 0
    cases = [(sc, w, m, (), "") for sc in GPU_SCENARIOS for w in writers for m in modes]
    if not args.no_control:
        control = GPU_SCENARIOS[2]  # the bare r=64 expand that asks ahead
        cases += [(control, "early", m, ("B",), " (stale B)") for m in modes]
        cases += [(control, w, m, (), " (promise broken)") for w in writers for m in modes]
    for sc, writer, mode, skip, note in cases:
        if args.only not in sc.name:
            continue
        start = time.perf_counter()
        try:
            with promise_broken() if "promise" in note else contextlib.nullcontext():
                result = run(Rig(sc, seed=7), writer, mode, args.iterations, skip=skip)
        except (LookupError, TypeError) as error:  # the ops' internals changed
            print(f"    {sc.name}{note}: skipped ({error})")
            continue
        seconds = time.perf_counter() - start
        wrong = [o for o in result.outcomes if not o.ok]
        label = sc.name + note
        print(
            row(
                (
                    label,
                    sc.op,
                    result.build or "-",
                    writer,
                    mode,
                    len(result.outcomes),
                    len(wrong),
                    f"{max(o.max_error for o in result.outcomes):.3g}",
                    f"{max(o.worst for o in result.outcomes):.3g}",
                    sum(o.written for o in result.outcomes),
                    f"{seconds:.1f}",
                )
            ),
            flush=True,
        )
        if wrong and not note:
            total_wrong += len(wrong)
        if wrong and "stale" not in note:
            print(f"    first wrong: {wrong[0].describe()}", flush=True)
    print(f"wrong results outside the control rows: {total_wrong}")
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
