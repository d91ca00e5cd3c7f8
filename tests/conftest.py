"""Test configuration: the machine, the hypothesis profiles and the ``gpu`` marker.

Profiles (choose with ``HYPOTHESIS_PROFILE``; the default is ``dev``):

* ``dev``  a quick local run: few examples, small shapes;
* ``ci``   what ``make test`` runs: derandomised (the same examples every run), small shapes;
* ``sim``  more examples, still at the simulator's tiny shapes;
* ``gpu``  the H200 run: >= 300 examples per property, shapes up to H=8192, T=4096;
* ``sanitize``  3 examples per property, for runs under compute-sanitizer (tests/sanitize.sh).

Shapes depend on the machine as well as the profile: on the simulator every CUDA
thread is a Python thread, so kernel tests always draw tiny shapes there.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from punica_numba._cuda import SIMULATOR  # first: it may switch the simulator on

from .gpu_memory import PEAKS, largest_peaks, note_peak, release_cached_memory

_SLOW_DRAWS = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("dev", max_examples=10, deadline=None, suppress_health_check=_SLOW_DRAWS)
settings.register_profile(
    "ci",
    max_examples=10,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_DRAWS,
)
#: Under compute-sanitizer every launch is instrumented and runs many times slower
#: (racecheck most): a few examples per property (tests/sanitize.sh).
settings.register_profile(
    "sanitize", max_examples=3, deadline=None, suppress_health_check=_SLOW_DRAWS
)
settings.register_profile("sim", max_examples=40, deadline=None, suppress_health_check=_SLOW_DRAWS)
settings.register_profile(
    "gpu", max_examples=300, deadline=None, print_blob=True, suppress_health_check=_SLOW_DRAWS
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(config, items):
    if not SIMULATOR:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device; running on the simulator")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # (after the test's fixtures are torn down)
def pytest_runtest_teardown(item):
    """On a GPU, the test's peak of torch's memory is noted, and a worker's cache past its
    limit goes back to the GPU (tests/gpu_memory.py)."""
    if not SIMULATOR:
        note_peak(item.nodeid)
        release_cached_memory()


def pytest_report_header(config):
    machine = "Numba CUDA simulator" if SIMULATOR else "CUDA GPU"
    return f"punica_numba: kernels on the {machine}; hypothesis profile {PROFILE!r}"


def pytest_sessionfinish(session):
    """On a pytest-xdist worker, hand this process's largest errors to the controller,
    which prints the report (:func:`pytest_testnodedown`)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from .tolerance import LARGEST_ERRORS

        workeroutput["largest_errors"] = dict(LARGEST_ERRORS)
        workeroutput["peak_bytes"] = dict(PEAKS)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown to pytest without it
def pytest_testnodedown(node, error):
    """On the pytest-xdist controller, take in a finished worker's largest errors and its
    tests' peaks of GPU memory."""
    from .tolerance import LARGEST_ERRORS

    output = getattr(node, "workeroutput", {})
    for what, err in output.get("largest_errors", {}).items():
        LARGEST_ERRORS[what] = max(LARGEST_ERRORS.get(what, 0.0), err)
    PEAKS.update(output.get("peak_bytes", {}))


def pytest_terminal_summary(terminalreporter):
    from .tolerance import LARGEST_ERRORS

    if LARGEST_ERRORS:
        terminalreporter.section("largest error relative to the magnitude, per check")
        for what, err in sorted(LARGEST_ERRORS.items()):
            terminalreporter.write_line(f"{what:<40} {err:.3e}")
    if PEAKS:
        terminalreporter.section("largest peaks of torch's GPU memory, per test")
        for line in largest_peaks(PEAKS):
            terminalreporter.write_line(line)
