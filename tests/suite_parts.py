"""Resume a pytest run that a time limit stopped: the tests an earlier log reports done.

The gpu profile of the whole suite takes longer than one call to a lent GPU may run
(``tests/gpu_check.sh``, the ``suite`` step). Run verbosely (``-v``), pytest prints a line
for each test as it ends; this module reads such a log and names the tests it reports
passed or skipped, so that the next run can leave them out (``--deselect``) and take up
the rest: the failed ones, and those that had not ended when the limit came.

    python tests/suite_parts.py LOG     # prints "--deselect" and a node id, a line each

Both forms of pytest's verbose line are read: ``tests/test_a.py::test_b[x] PASSED [ 3%]``
(one process) and ``[gw4] [ 3%] PASSED tests/test_a.py::test_b[x]`` (pytest-xdist); a
node id may hold spaces. The ids are printed one a line, so that a shell reads each whole
(``mapfile -t``).
A test reported more than once counts once. Only a log of the same commit and profile
says anything about the next run: the caller keeps that promise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: The outcomes after which a test need not run again.
DONE = ("PASSED", "SKIPPED", "XFAIL", "XPASS")

_OUTCOME = "(" + "|".join(DONE) + ")"
# A node id may hold spaces (a parameter's id): the outcome and the progress mark it off.
_ONE_PROCESS = re.compile(rf"^(\S+\.py::.*?) {_OUTCOME}(?: \(.*\))?\s+\[\s*\d+%\]$")
_XDIST = re.compile(rf"^(?:\[gw\d+\] )?\[\s*\d+%\] {_OUTCOME} (\S+\.py::.*)$")


def done_tests(log: str) -> list[str]:
    """The node ids ``log`` reports passed, skipped, xfailed or xpassed, in first-seen
    order, each once."""
    seen: dict[str, None] = {}
    for line in log.splitlines():
        line = line.strip()
        one = _ONE_PROCESS.match(line)
        if one:
            seen.setdefault(one.group(1))
            continue
        many = _XDIST.match(line)
        if many:
            seen.setdefault(many.group(2))
    return list(seen)


def deselect_arguments(log: str) -> list[str]:
    """``["--deselect", id, ...]`` for every test :func:`done_tests` finds in ``log``."""
    return [part for node in done_tests(log) for part in ("--deselect", node)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/suite_parts.py LOG", file=sys.stderr)
        return 2
    for part in deselect_arguments(Path(argv[0]).read_text(errors="replace")):
        print(part)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
