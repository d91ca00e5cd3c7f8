"""The tensor-core shrink with two passes of loads ahead (``LaunchConfig(ahead=2)``,
:mod:`punica_numba.kernels.shrink_mma`, "Passes ahead"). Checked here:

1. against the float64 reference, over drawn ranks, slices, tiles of 16 and 32 tokens, groups
   of every rank or of 8, hidden sizes and runs of K, added into the buffer or stored;
2. the same bits as one pass ahead, where the passes are not a multiple of three (the walk
   ends on passes of zeros) and where K is split;
3. what a configuration may ask.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba.launch import LaunchConfig, config_name

from .op_cases import Problem, ShrinkCase
from .strategies import LARGE
from .test_joint_shrink import check_forced_shrink, outputs_under, tensor_core_shrink_cases

#: Threads a block: two warps on the simulator (64 Python threads a block).
THREADS = 256 if LARGE else 64


def ahead_config(tile_m: int, tile_n: int, splits: int = 1) -> LaunchConfig:
    spread = tile_n > 0  # (every rank: one group, walked in the block)
    return LaunchConfig(
        "mma", THREADS, tile_m, tile_n, spread=spread, splits=splits, ahead=2, tuned_only=True
    )


def ahead_cases() -> st.SearchStrategy:
    """1-3 slices; up to 40 tokens on 1-3 LoRAs; ranks up to 32 (64 on the GPU: a block of
    every rank takes up to 64)."""
    if LARGE:
        return tensor_core_shrink_cases(96, 1024, 64, 3)
    return tensor_core_shrink_cases(40, 24, 32, 3)


@given(
    ahead_cases(),
    st.sampled_from((16, 32)),
    st.sampled_from((0, 8)),
    st.sampled_from((1, 3)),
    st.booleans(),
)
def test_two_passes_ahead_match_the_reference(case, tile_m, tile_n, splits, accumulate):
    check_forced_shrink(ahead_config(tile_m, tile_n, splits), case, accumulate)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_same_bits_as_one_pass_ahead(splits):
    """K = 456 is 15 chunks of 32 (the last partly past K): with two warps and two chunks
    each a pass, 4 passes a block (2 in each of 3 runs), neither a multiple of three, so
    the walk of two passes ahead multiplies passes of zeros at its end. A rank of 8, one
    group of the blocks' 8 (the walk is the same in every group; each costs the simulator
    seconds)."""
    problem = Problem(slots=[1, 0, 2, -1, 0, 1] * 6, prepared=36, num_loras=3, seed=3)
    case = ShrinkCase(problem, 456, 8, 2, 0, torch.bfloat16, torch.float32, 0.5, False)
    two = ahead_config(16, 8, splits)
    one, two = outputs_under([dataclasses.replace(two, ahead=1), two], case)
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    "fields",
    [
        dict(kernel="mma", threads=128, tile_m=16, tile_n=16, ahead=3),
        dict(kernel="rows", threads=128, tile_m=1, tile_n=4, ahead=2),
        dict(kernel="mma", threads=128, tile_m=32, tile_n=64, staged=True, ahead=2),
        dict(kernel="mma", threads=128, tile_m=16, tile_n=24, joint=True, ahead=2),
    ],
    ids=["three", "rows", "staged", "joint"],
)
def test_only_a_tensor_core_shrink_walking_k_takes_two_passes_ahead(fields):
    with pytest.raises(ValueError, match="ahead"):
        LaunchConfig(**fields)
    assert config_name(ahead_config(16, 0)).endswith("_n0_a2")
    assert config_name(ahead_config(16, 8, 4)) == f"mma_t{THREADS}_m16_n8_k4_a2"
