"""The tensor-core shrink with x and A staged in shared memory (``LaunchConfig(staged=True)``,
:mod:`punica_numba.kernels.shrink_mma_staged` and its split twin): a block's warps split its
ranks, copying each chunk of K into stages of shared memory ahead of its products. Checked here:

1. against the float64 reference, over drawn ranks (a block's ranks more or fewer than the
   rank's), slices, tiles of 16 and 32 tokens, hidden sizes (K's last chunk partly past the
   end, where the copies write zeros), runs of K, the slices' ranks side by side or not, and
   dtypes, added into a nonzero buffer or stored; the staged configuration is the one that
   ran;
2. the grid: a block per tile and slice, groups of the block's ranks along y, runs along z;
   side by side, a block per tile and group of joint ranks;
3. the same bits as one warp of the tensor-core shrink walking the same runs of K (their
   arithmetic key);
4. what a configuration may ask, and the stages a block's shared memory holds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba.kernels.shrink_mma_staged import staged_stages
from punica_numba.launch import LaunchConfig, config_name

from .op_cases import Problem, ShrinkCase, check_shrink
from .strategies import LARGE
from .test_joint_shrink import (
    _recording,
    check_forced_shrink,
    outputs_under,
    recorded_grids,
    tensor_core_shrink_cases,
)
from .test_split_shrink import forced

#: Threads a block and ranks a block: on the simulator two warps (64 Python threads a block)
#: of 8 or 16 ranks each; on the GPU the configurations' sizes.
THREADS = 128 if LARGE else 64
BLOCK_RANKS = (64, 128) if LARGE else (16, 32)
#: Stages drawn: 0, what 48 KB declared in the kernel hold, or a deeper ring in dynamic shared
#: memory (3 on the simulator, 8 on the GPU, as the launch tables' deeper rings).
DEEP = 8 if LARGE else 3


def staged_config(
    tile_m: int,
    tile_n: int,
    splits: int = 1,
    threads: int = THREADS,
    joint: bool = False,
    stages: int = 0,
) -> LaunchConfig:
    return LaunchConfig(
        "mma",
        threads,
        tile_m,
        tile_n,
        splits=splits,
        joint=joint,
        staged=True,
        stages=stages,
        tuned_only=True,
    )


def staged_cases() -> st.SearchStrategy:
    """1-3 slices; up to 40 tokens on 1-3 LoRAs (one to three tiles a slot); ranks up to 40
    (256 on the GPU)."""
    if LARGE:
        return tensor_core_shrink_cases(96, 512, 256, 3)
    return tensor_core_shrink_cases(40, 10, 40, 3)


@given(
    staged_cases(),
    st.sampled_from((16, 32, 64)),
    st.sampled_from(BLOCK_RANKS),
    st.sampled_from(((1, False), (3, False), (1, True))),  # (runs of K, side by side)
    st.booleans(),
    st.sampled_from((0, DEEP)),
)
def test_staged_shrink_matches_reference(case, tile_m, tile_n, runs, accumulate, stages):
    splits, joint = runs
    config = staged_config(tile_m, tile_n, splits, joint=joint, stages=stages)
    check_forced_shrink(config, case, accumulate)


@pytest.mark.parametrize(
    "rank, tile_n, splits, joint, groups",
    [
        (20, 16, 1, False, 2),
        (5, 16, 1, False, 1),
        (20, 32, 3, False, 1),
        (40, 32, 3, False, 2),
        (12, 16, 1, True, 2),
        (5, 16, 1, True, 1),
    ],
)
def test_a_block_per_tile_and_slice_its_ranks_along_y_its_runs_along_z(
    rank, tile_n, splits, joint, groups, monkeypatch
):
    """The grid is ``(tiles x slices, groups of the block's ranks, runs of K)``: 20 ranks in
    blocks of 16 make 2 groups, 5 make 1 (a block of 16 ranks whose warps hold 8 each, the
    second warp's past the rank), 40 in blocks of 32 make 2. Side by side it is ``(tiles,
    groups of joint ranks, 1)``: two slices of 12 ranks in blocks of 16 make 2 groups (the
    first straddling the slices), of 5 ranks 1."""
    grids = recorded_grids(monkeypatch)
    problem = Problem(slots=[0] * 20 + [1] * 3, prepared=23, num_loras=2, seed=4)
    case = ShrinkCase(problem, 48, rank, 2, 0, torch.bfloat16, torch.float32, 0.5, False)
    with forced(staged_config(16, tile_n, splits, 64, joint=joint)):
        check_shrink(_recording([]), case)
    (grid,) = grids
    assert grid[1:] == (groups, splits), grid
    slices_along_x = 1 if joint else 2
    assert grid[0] >= 3 * slices_along_x  # (the tiles: two of slot 0, one of slot 1)


@pytest.mark.parametrize(
    "threads, rank, accumulate, splits",
    [(32, 16, True, 1), (32, 11, False, 1), (64, 16, True, 1), (32, 16, False, 3)],
)
def test_a_small_block_of_64_tokens(threads, rank, accumulate, splits):
    """Blocks of 64 tokens x 16 ranks in one warp (the lane's four 16-token tiles, ten copies
    a stage) or in two of 8 (the GPU's launch table offers two warps of 16): 80 tokens on
    two LoRAs make a full tile, a short one and a tile of one token; r=11 leaves the block's
    last ranks past the rank. K = 136 is 5 chunks, the last partly past K; in 3 runs, of 2, 2
    and 1 chunks."""
    problem = Problem(slots=[0, 1] * 3 + [0] * 70 + [-1] * 4, prepared=80, num_loras=2, seed=6)
    case = ShrinkCase(problem, 136, rank, 2, 0, torch.bfloat16, torch.float32, 0.5, False)
    check_forced_shrink(staged_config(64, 16, splits, threads), case, accumulate)


@pytest.mark.parametrize("accumulate", [True, False])
def test_a_long_k_goes_round_the_stages_twice(accumulate):
    """K of twice the stages' chunks and a partial one more, walked by one block (the drawn
    cases' K fits the stages once): each stage is copied into again only after every warp
    has multiplied what it held, and the last chunk's copies past K write zeros."""
    stages = staged_stages(16, 16)
    hidden = 32 * (2 * stages + 1) + 8
    problem = Problem(slots=[0, -1, 0, 0], prepared=4, num_loras=1, seed=11)
    case = ShrinkCase(problem, hidden, 16, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
    check_forced_shrink(staged_config(16, 16, 1, 64), case, accumulate)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_same_bits_as_one_warp_walking_k(splits):
    """A staged block's outputs are each one warp's sums over its run of K, in the order of
    one warp of the tensor-core shrink (the key ``("mma", 32)``, or with ``splits``), so the
    outputs are equal bit for bit, whatever the staged block's warps and tiles. K = 104: its
    fourth chunk of 32 is partly past the end; in 3 runs, of 2, 2 and no chunks. Two slices
    in one run (the side-by-side block's 16 joint ranks then straddle them), one in three
    (a slice's blocks are any other's but for its weights)."""
    problem = Problem(slots=[1, 0, 1, 1, -1, 0, 0] * 5, prepared=35, num_loras=2, seed=8)
    slices = 2 if splits == 1 else 1
    case = ShrinkCase(problem, 104, 24, slices, 0, torch.bfloat16, torch.float32, 0.5, False)
    one_warp = LaunchConfig("mma", 32, 16, 8, splits=splits, tuned_only=True)
    configs = [staged_config(32, 16, splits, 64), staged_config(16, 32, splits, 64)]
    configs.append(staged_config(64, 16, splits, 32))  # (one warp of 16 ranks, 64 tokens)
    if splits == 1:  # the slices' ranks side by side (16 of their 48 joint ranks a block)
        configs.append(staged_config(16, 16, 1, 64, joint=True))
    configs.append(one_warp)
    key = ("mma", 32) if splits == 1 else ("mma", 32, splits)
    assert all(config.arithmetic("shrink") == key for config in configs)
    outputs = outputs_under(configs, case)
    for output in outputs[:-1]:
        assert torch.equal(output, outputs[-1])


@pytest.mark.parametrize(
    "fields",
    [
        dict(kernel="rows", threads=128, tile_m=1, tile_n=4),
        dict(kernel="mma", threads=128, tile_m=16, tile_n=0, spread=False),
        dict(kernel="mma", threads=128, tile_m=16, tile_n=48),  # 12 ranks a warp
        dict(kernel="mma", threads=128, tile_m=8, tile_n=64),
    ],
    ids=["rows", "every-rank", "ranks-of-no-8-rank-tiles", "tile-of-8"],
)
def test_only_a_tensor_core_shrink_of_whole_warp_tiles_is_staged(fields):
    with pytest.raises(ValueError, match="staged"):
        LaunchConfig(**fields, staged=True)
    with pytest.raises(ValueError, match="joint"):  # side by side, K is not split
        staged_config(32, 128, 4, 128, joint=True)
    assert config_name(staged_config(32, 128, 1, 128)) == "mma_t128_m32_n128_s"
    assert config_name(staged_config(32, 128, 4, 128)) == "mma_t128_m32_n128_k4_s"
    assert config_name(staged_config(32, 64, 1, 128, joint=True)) == "mma_t128_m32_n64_j_s"


@pytest.mark.parametrize("splits", [1, 3])
def test_a_deep_ring_gives_the_bits_of_the_declared_one(splits):
    """Three stages in dynamic shared memory, over a K of 7 chunks, the last one partly past
    K, that goes round them twice (as the GPU's deeper rings, 8-16 stages, go round theirs),
    alone and in 3 runs of K: the bits of the ring that 48 KB declared in the kernel hold
    (8 stages here)."""
    problem = Problem(slots=[0, -1, 1, 0, 1, 0], prepared=6, num_loras=2, seed=12)
    case = ShrinkCase(problem, 32 * 6 + 8, 16, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
    deep = staged_config(16, 16, splits, 64, stages=3)
    assert config_name(deep).endswith("_s3")
    outputs = outputs_under([deep, staged_config(16, 16, splits, 64)], case)
    assert torch.equal(outputs[0], outputs[1])


def test_stages_asked_for_are_kept_up_to_what_a_block_may_have():
    """Asked for, a block keeps that many stages in dynamic shared memory, past 8 and past
    48 KB (64 x 128: 12 KB a stage, 18 of them in Hopper's 227 KB), never fewer than two."""
    assert staged_stages(64, 128, 12) == 12
    assert staged_stages(64, 128, 18) == 18
    for stages in (1, 19):
        with pytest.raises(ValueError, match="at most"):
            staged_stages(64, 128, stages)


def test_a_block_keeps_the_most_stages_that_fit_48_kb():
    """A stage is 64 bytes a row (32 elements of 16 bits), a row a token and a rank."""
    assert staged_stages(32, 128) == 4  # 10 KB a stage
    assert staged_stages(32, 256) == 2  # 18 KB
    assert staged_stages(32, 64) == 8  # 6 KB: 48 KB in 8 stages
    assert staged_stages(16, 32) == 8  # 3 KB: no more than 8 stages
    assert staged_stages(64, 16) == 8  # 5 KB: 40 KB, the small-rank blocks of 64 tokens
    assert staged_stages(64, 32) == 8  # 6 KB: 48 KB
    with pytest.raises(ValueError, match="shared memory"):
        staged_stages(128, 512)  # 40 KB a stage
