"""``tests/suite_parts.py``: a run that a time limit stopped is taken up where it stopped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .suite_parts import deselect_arguments, done_tests, main

ONE_PROCESS_LOG = """\
tests/test_a.py::test_one PASSED                                         [ 10%]
tests/test_a.py::test_two[a b] PASSED                                    [ 20%]
tests/test_a.py::test_three FAILED                                       [ 30%]
tests/test_a.py::test_four SKIPPED (on a GPU only)                       [ 40%]
tests/test_a.py::test_five ERROR                                         [ 50%]
tests/test_a.py::test_one PASSED                                         [ 60%]
"""

XDIST_LOG = "\n".join(
    [
        "[gw1] [ 10%] PASSED tests/test_a.py::test_one",
        "[gw0] [ 20%] FAILED tests/test_a.py::test_three",
        "[gw3] [ 30%] SKIPPED tests/test_b.py::test_six[K zero] ",  # (xdist's trailing space)
        "tests/test_b.py::test_seven",
        "[gw2] [ 40%] XFAIL tests/test_b.py::test_eight",
    ]
)


def test_the_tests_reported_done_in_either_form():
    """Passed and skipped tests are done, each once, parameters with spaces whole;
    failed, erred and unfinished ones (a node id alone on its line) are not."""
    assert done_tests(ONE_PROCESS_LOG) == [
        "tests/test_a.py::test_one",
        "tests/test_a.py::test_two[a b]",
        "tests/test_a.py::test_four",
    ]
    assert done_tests(XDIST_LOG) == [
        "tests/test_a.py::test_one",
        "tests/test_b.py::test_six[K zero]",
        "tests/test_b.py::test_eight",
    ]
    assert deselect_arguments(XDIST_LOG)[:2] == ["--deselect", "tests/test_a.py::test_one"]


def test_the_command_line(tmp_path, capsys):
    log = tmp_path / "suite.log"
    log.write_text(ONE_PROCESS_LOG)
    assert main([str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == deselect_arguments(ONE_PROCESS_LOG) and len(lines) == 6
    assert main([]) == 2


TINY = """\
import pytest

def test_passes():
    pass

@pytest.mark.parametrize("name", ["a b", "c"])
def test_passes_too(name):
    pass

def test_fails():
    assert False

def test_skipped():
    pytest.skip("not here")
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_second_run_runs_only_what_the_first_did_not_finish(tmp_path, workers):
    """A real pytest log of five tests: the second run, given the first's deselections,
    runs the failed test alone."""
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(TINY))
    run = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *workers]
    first = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert "1 failed, 3 passed, 1 skipped" in first.stdout, first.stdout[-2000:]
    arguments = deselect_arguments(first.stdout)
    assert len(arguments) == 8, arguments
    second = subprocess.run([*run, *arguments], cwd=tmp_path, capture_output=True, text=True)
    summary = second.stdout.splitlines()[-1]  # (xdist's leaves the deselected out)
    assert "1 failed" in summary and "passed" not in summary, second.stdout[-2000:]
    assert done_tests(second.stdout) == [] and "test_tiny.py::test_fails" in second.stdout
