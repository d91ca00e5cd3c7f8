"""The tensor-core shrink with a layer's slices side by side (``LaunchConfig(joint=True)``,
:mod:`punica_numba.kernels.shrink_mma_joint`): a block takes ``tile_n`` of the slices' ranks
side by side, its groups straddling the slices where ``tile_n`` is not a multiple of the
rank. Checked here:

1. against the float64 reference, over drawn ranks, slices (up to five: two launches, the
   second of fewer slices, whose last groups have no rank), groups, hidden sizes and
   dtypes, added into a nonzero buffer or stored; the joint configuration is the one that
   ran;
2. the grid: a block per tile and group of joint ranks, no block per slice;
3. the same bits as the tensor-core shrink of one slice a block at the same warps (their
   arithmetic key);
4. what a configuration may ask: only the unsplit tensor-core shrink, with a group size.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba.launch import LaunchConfig, config_name
from punica_numba.ops import launching

from .op_cases import Problem, ShrinkCase, check_shrink
from .strategies import LARGE
from .test_split_shrink import forced, stored_shrink

#: Threads a block and groups of joint ranks: on the simulator two warps (each 64 Python
#: threads a block) and groups of 8 to 24; on the GPU the sizes of the configurations.
THREADS = 256 if LARGE else 64
GROUPS = (24, 48, 40) if LARGE else (8, 16, 24)


def joint_config(tile_n: int, threads: int = THREADS) -> LaunchConfig:
    return LaunchConfig("mma", threads, 16, tile_n, joint=True, tuned_only=True)


def _recording(ran: list):
    """``lora_shrink``-like calls whose launches' configurations go into ``ran``."""
    from punica_numba.ops import prepare_shrink

    def shrink(*args):
        launch = prepare_shrink(*args)
        launch()
        ran.append(getattr(launch, "config", None))

    return shrink


@st.composite
def tensor_core_shrink_cases(
    draw, most_tokens: int, most_words: int, most_rank: int, most_slices: int
) -> ShrinkCase:
    """A shrink the tensor cores take: 16-bit x and A, K a multiple of 8 (up to
    ``most_words`` pairs of 4-element words); 1 to ``most_slices`` slices; 1 to
    ``most_tokens`` tokens on 1-3 LoRAs; ranks 1 to ``most_rank``."""
    num_tokens = draw(st.integers(1, most_tokens), label="T")
    num_loras = draw(st.integers(1, 3), label="L")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    slots = draw(
        st.lists(st.integers(-1, num_loras - 1), min_size=num_tokens, max_size=num_tokens),
        label="slots",
    )
    return ShrinkCase(
        problem=Problem(slots, num_tokens, num_loras, seed),
        hidden=8 * draw(st.integers(1, most_words), label="H / 8"),
        rank=draw(st.integers(1, most_rank), label="r"),
        num_slices=draw(st.integers(1, most_slices), label="S"),
        extra_slices=draw(st.integers(0, 1), label="extra buffer slices"),
        dtype=draw(st.sampled_from((torch.bfloat16, torch.float16)), label="dtype"),
        out_dtype=draw(st.sampled_from((torch.float32, torch.bfloat16)), label="buffer dtype"),
        scaling=draw(st.sampled_from((1.0, 0.5, -0.25)), label="scaling"),
        four_d=draw(st.booleans(), label="4-D weights"),
    )


def joint_cases() -> st.SearchStrategy:
    """Up to five slices (two launches); 1-20 tokens (one or two tiles a slot)."""
    return tensor_core_shrink_cases(
        64 if LARGE else 20, 512 if LARGE else 6, 64 if LARGE else 12, 5
    )


def recorded_grids(monkeypatch) -> list:
    """The grid of every launch made from now on (within the test), in order."""
    grids = []
    real = launching.launcher_of

    def recording(kernel):
        inner = real(kernel)

        def launch(grid, threads, args):
            grids.append(grid)
            inner(grid, threads, args)

        return launch

    monkeypatch.setattr(launching, "launcher_of", recording)
    return grids


def outputs_under(configs, case: ShrinkCase) -> list:
    """The buffer ``case``'s shrink leaves under each of ``configs`` (forced), in order."""
    outputs = []

    def keep(x, weights, out, *rest):
        _recording([])(x, weights, out, *rest)
        outputs.append(out.clone())

    for config in configs:
        with forced(config):
            check_shrink(keep, case)
    return outputs


def check_forced_shrink(config: LaunchConfig, case: ShrinkCase, accumulate: bool) -> None:
    """``case`` against the reference under ``config``, added into the buffer or stored;
    ``config`` is the configuration that ran (where anything ran)."""
    ran = []
    with forced(config):
        if accumulate:
            check_shrink(_recording(ran), case)
        else:
            check_shrink(stored_shrink, case, stores=True)
    if ran and ran[0] is not None:  # (None: no token had a LoRA, nothing was launched)
        assert ran == [config], ran


@given(joint_cases(), st.sampled_from(GROUPS), st.booleans())
def test_joint_shrink_matches_reference(case, tile_n, accumulate):
    check_forced_shrink(joint_config(tile_n), case, accumulate)


@pytest.mark.parametrize(
    "slices, rank, tile_n, groups", [(3, 8, 16, 2), (3, 5, 16, 1), (2, 12, 8, 3)]
)
def test_a_block_takes_a_group_of_every_slices_ranks(slices, rank, tile_n, groups, monkeypatch):
    """The grid is ``(tiles, groups of joint ranks, 1)``: 24 joint ranks in groups of 16
    make 2 (the second straddling k and v's ranks), 15 make 1, 24 in groups of 8 make 3."""
    grids = recorded_grids(monkeypatch)
    problem = Problem(slots=[0] * 20 + [1] * 3, prepared=23, num_loras=2, seed=4)
    case = ShrinkCase(problem, 16, rank, slices, 0, torch.bfloat16, torch.float32, 0.5, False)
    with forced(joint_config(tile_n, 64)):
        check_shrink(_recording([]), case)
    (grid,) = grids
    assert grid[1:] == (groups, 1), grid
    assert grid[0] >= 3  # (the tiles: two of slot 0, one of slot 1; more on the GPU's bound)


def test_the_same_bits_as_one_slice_a_block():
    """Ranks side by side or a slice a block, at the same warps: each output's sum is the
    same (the key ``("mma", threads)``), so the outputs are equal bit for bit."""
    problem = Problem(slots=[2, 0, 1, 1, -1, 0, 2] * 4, prepared=28, num_loras=3, seed=8)
    case = ShrinkCase(problem, 40, 7, 3, 0, torch.bfloat16, torch.float32, 0.5, False)
    configs = (joint_config(16, 64), LaunchConfig("mma", 64, 16, 8, tuned_only=True))
    assert all(config.arithmetic("shrink") == ("mma", 64) for config in configs)
    joint, one_slice = outputs_under(configs, case)
    assert torch.equal(joint, one_slice)


@pytest.mark.parametrize(
    "fields",
    [
        dict(kernel="rows", threads=128, tile_m=1, tile_n=4),
        dict(kernel="mma", threads=128, tile_m=16, tile_n=8, splits=4),
        dict(kernel="mma", threads=128, tile_m=16, tile_n=0, spread=False),
    ],
    ids=["rows", "split-K", "every-rank"],
)
def test_only_an_unsplit_tensor_core_shrink_of_groups_takes_its_slices_side_by_side(fields):
    with pytest.raises(ValueError, match="joint"):
        LaunchConfig(**fields, joint=True)
    assert config_name(joint_config(48, 256)) == "mma_t256_m16_n48_j"
