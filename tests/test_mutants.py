"""Test the tests: every deliberately wrong kernel in :mod:`tests.mutants` must be caught."""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings

from . import tolerance
from .mutants import EXPAND_BUGS, SHRINK_BUGS, mutant_expand, mutant_shrink
from .op_cases import check_expand, check_shrink, expand_cases, shrink_cases

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
