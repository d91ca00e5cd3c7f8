"""Test the tests: every deliberately wrong kernel in :mod:`tests.mutants` must be caught.

The property checks must reject the ordinary bugs; the edge-case checks must reject the
bugs a careless kernel makes only at one extreme (and which pass the ordinary problem);
the determinism check must reject bits that depend on the launch configuration.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings

from punica_numba.launch import launch_configs
from punica_numba.ops import prepare_shrink

from . import test_determinism, tolerance
from .mutants import (
    EXPAND_BUGS,
    EXPAND_EDGE_BUGS,
    SHRINK_BUGS,
    SHRINK_EDGE_BUGS,
    mutant_expand,
    mutant_shrink,
)
from .op_cases import check_expand, check_shrink, expand_cases, shrink_cases
from .test_edge_cases import EDGES, ORDINARY, expand_case, shrink_case

# Enough examples to meet each bug's trigger (a -1 token, two segments, ...) without
# shrinking the counterexample, which would only cost time.
HUNT = settings(
    max_examples=60, phases=[Phase.explicit, Phase.generate], derandomize=True, print_blob=False
)


@pytest.fixture(autouse=True)
def _keep_error_report():
    """Mutants' near misses must not enter the report of the real kernels' errors."""
    saved = dict(tolerance.LARGEST_ERRORS)
    yield
    tolerance.LARGEST_ERRORS.clear()
    tolerance.LARGEST_ERRORS.update(saved)


@pytest.mark.parametrize("bug", SHRINK_BUGS)
def test_suite_rejects_wrong_shrink(bug):
    impl = mutant_shrink(bug)

    @HUNT
    @given(shrink_cases())
    def shrink_property(case):
        check_shrink(impl, case)

    with pytest.raises(AssertionError):
        shrink_property()


@pytest.mark.parametrize("bug", EXPAND_BUGS)
def test_suite_rejects_wrong_expand(bug):
    impl = mutant_expand(bug)

    @HUNT
    @given(expand_cases())
    def expand_property(case):
        check_expand(impl, case)

    with pytest.raises(AssertionError):
        expand_property()


def test_mutants_are_otherwise_right():
    """The mutants' machinery is sound: with no bug planted, the same checks pass."""

    @settings(max_examples=8, derandomize=True)
    @given(shrink_cases(), expand_cases())
    def both(s_case, e_case):
        check_shrink(mutant_shrink("none"), s_case)
        check_expand(mutant_expand("none"), e_case)

    both()


#: The edge case of test_edge_cases.py that each edge bug gets wrong.
EDGE_OF_BUG = {
    "launches nothing at full capacity": "T == max tokens",
    "assumes H >= 2": "hidden 1",
    "no-LoRA batch takes slot -1 as the last slot": "no token has a LoRA",
    "assumes r >= 2": "rank 1",
    "single-slot fast path ignores -1": "max_loras = 1",
    "skips a slice of width 1": "one slice of width 1",
    "treats an empty step as one token on slot 0": "T = 0, with padded rows",
}


def test_every_edge_case_has_a_mutant():
    assert set(EDGE_OF_BUG) == set(SHRINK_EDGE_BUGS) | set(EXPAND_EDGE_BUGS)
    assert set(EDGE_OF_BUG.values()) | {"T = 0"} == set(EDGES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bug", SHRINK_EDGE_BUGS)
def test_edge_checks_reject_wrong_shrink(bug, dtype):
    impl = mutant_shrink(bug)
    check_shrink(impl, shrink_case(ORDINARY, dtype))  # right where nothing is extreme
    with pytest.raises(AssertionError):
        check_shrink(impl, shrink_case(EDGES[EDGE_OF_BUG[bug]], dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bug", EXPAND_EDGE_BUGS)
def test_edge_checks_reject_wrong_expand(bug, dtype):
    impl = mutant_expand(bug)
    check_expand(impl, expand_case(ORDINARY, dtype))
    with pytest.raises(AssertionError):
        check_expand(impl, expand_case(EDGES[EDGE_OF_BUG[bug]], dtype))


def test_determinism_check_rejects_launch_dependent_bits(monkeypatch):
    """A shrink one ulp off at one element under one configuration only, one that shares
    its arithmetic key (and so its promised bits) with another. The problem is fp32, which
    the tensor cores do not take, so the target is an FFMA configuration."""
    configs = [c for c in launch_configs("shrink") if c.kernel != "mma"]
    keys = [c.arithmetic("shrink") for c in configs]
    target = next(c for c in reversed(configs) if keys.count(c.arithmetic("shrink")) > 1)

    def nudged(*args):  # prepare_shrink's signature; the launch it returns nudges
        launch = prepare_shrink(*args)

        def run():
            launch()
            if launch.config == target:
                out = args[2]  # [S, T, r]; token 0 has a LoRA in the ordinary problem
                out[0, 0, 0] = torch.nextafter(
                    out[0, 0, 0], torch.tensor(float("inf"), device=out.device)
                )

        run.config = launch.config
        return run

    ops = dict(test_determinism.OPS, shrink=(nudged, check_shrink))
    monkeypatch.setattr(test_determinism, "OPS", ops)
    with pytest.raises(AssertionError, match="different bits"):
        test_determinism.check_deterministic("shrink", shrink_case(ORDINARY, torch.float32))
