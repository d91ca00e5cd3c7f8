"""MoE LoRA's version 11: each block's pairs shrunk and expanded by one CUDA block, one
launch (:mod:`punica_numba.kernels.moe_fused`). Checked here:

1. the kernel against the float64 reference on every drawn call (its threshold of pairs
   raised, so that every call runs it): slots off and of no LoRA, experts -1, blocks of
   padding, add_inputs or not, the router's weights (w2) or a row of x a token (w13), every
   dtype;
2. sizes just past each of its tiles, from its own parameters (the simulator's or the
   GPU's): a rank of several shrink steps and no multiple of one, blocks of more pairs than
   a chunk, more columns than a CUDA block's group, K past one step of loads, odd (a word
   an element) or in whole int64 words; it is the one kernel launched;
3. version 11 takes version 9's kernels past its threshold of pairs: the same bits;
4. its compact grid and its grid of every block give the same bits;
5. the columns a thread owns, within its values of B;
6. version 13 takes the one launch up to ONE_LAUNCH_TO_PAIRS, where 12 takes the pairs path;
7. version 16 takes it past that, with 8 columns a thread (the simulator's 2), where the
   (slot, expert)s are SPARSE_SLOTS_A_PAIR times the pairs, where 14 takes the pairs path.
"""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
from hypothesis import given

from punica_numba.kernels import moe_fused
from punica_numba.moe_meta import align_pairs
from punica_numba.ops import moe as moe_ops
from punica_numba.ops.moe import fused_moe_lora

from .test_moe import (
    DTYPES,
    MOE_EXAMPLES,
    _one_block_call,
    check_against_reference,
    moe_cases,
)


def _run(case, d, blocks, block_size, version=11, add_inputs=True):
    """The op at ``version`` on a copy of the call's y: ``(y after, y before)``."""
    y, before = d["y"].clone(), d["y"]
    fused_moe_lora(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
        block_size=block_size, mul_routed_weight=case.mul, offset=case.offset,
        add_inputs=add_inputs, version=version,
    )  # fmt: skip
    return y, before


@MOE_EXAMPLES
@given(moe_cases())
def test_the_one_launch_matches_the_reference_on_every_drawn_call(case):
    d = case.data()
    blocks = align_pairs(d["topk_ids"], d["slots"], case.E, case.B, case.L, d["enabled"])
    with pytest.MonkeyPatch.context() as patch:  # (every call within the threshold)
        patch.setattr(moe_ops, "FUSED_TO_PAIRS", float("inf"))
        y, before = _run(case, d, blocks, case.B, add_inputs=case.add_inputs)
    check_against_reference(case, y, d, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("projection", ["w13", "w2"])
@pytest.mark.parametrize("whole_words", [False, True], ids=["K-odd", "K-in-int64-words"])
def test_version_11_crosses_its_rank_steps_chunks_of_pairs_and_column_groups(
    whole_words, projection, dtype, monkeypatch
):
    config = moe_ops.FUSED_PAIRS
    team = moe_fused.LANES * config.splits  # the threads that split a rank's K
    step = team * config.unroll  # words of K a team loads at once
    ranks = config.threads // team * config.tile_n  # the teams' ranks of a step
    # past one step, no multiple of one (and of 4 in whole words: B's rows in words too)
    rank = 4 * (ranks // 4 + 1) if whole_words else ranks + 1
    vec = moe_ops.fused_vec(rank)
    K = 4 * (step + 1) if whole_words else step + 5
    N = config.threads * vec + 1  # (one column past a group)
    B = 2 * config.tile_p + 1  # pairs a block
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=N, B=B, projection=projection,
                                      offset=1)  # fmt: skip
    ids, P = blocks.sorted_token_ids, d["topk_ids"].numel()
    real = torch.stack([(ids[:, i : i + B] < P).sum(1) for i in range(0, ids.shape[1], B)], 1)
    assert real.max() > config.tile_p and (real == 1).any()
    assert rank > ranks and rank % ranks and N > config.threads * vec
    monkeypatch.setattr(moe_ops, "FUSED_TO_PAIRS", float("inf"))
    real_build = moe_fused.build_moe_fused_kernel
    builds = mock.Mock(wraps=real_build)
    monkeypatch.setattr(moe_fused, "build_moe_fused_kernel", builds)
    launched = []
    real_launcher = moe_ops.launcher_of
    monkeypatch.setattr(moe_ops, "launcher_of", lambda k: launched.append(k) or real_launcher(k))
    y, before = _run(case, d, blocks, B)
    check_against_reference(case, y, d, before)
    assert len(launched) == 1 and builds.call_count == 1, "one kernel, one launch"
    built = inspect.signature(real_build).bind(*builds.call_args.args)
    assert built.arguments["packed_xa"] == built.arguments["packed_b"] == whole_words
    words = K // (8 // dtype.itemsize) if whole_words else K
    assert words > step and words % step, "K must end in a part of a step"


@pytest.mark.parametrize(
    "projection, add_inputs", [("w13", True), ("w2", False)], ids=["w13", "w2-stored"]
)
@pytest.mark.parametrize("mma_from", [1, 100], ids=["version-8s-kernels", "the-row-kernels"])
def test_past_its_threshold_version_11_gives_version_9s_bits(mma_from, projection, add_inputs,
                                                             monkeypatch):  # fmt: skip
    """A call of more pairs than FUSED_TO_PAIRS: versions 9 and 11 launch the same kernels,
    version 8's or, below MMA_SHRINK_FROM_PAIRS, the row kernels on the pairs."""
    case, d, blocks = _one_block_call(torch.bfloat16, rank=4, K=16, N=8, B=8,
                                      projection=projection, offset=0)  # fmt: skip
    assert d["topk_ids"].numel() > moe_ops.FUSED_TO_PAIRS
    case.add_inputs = add_inputs
    monkeypatch.setattr(moe_ops, "MMA_SHRINK_FROM_PAIRS", mma_from)
    results = [_run(case, d, blocks, 8, version, add_inputs)[0] for version in (9, 11)]
    check_against_reference(case, results[0], d, d["y"])
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


@pytest.mark.parametrize("projection", ["w13", "w2"])
def test_the_compact_grid_and_a_cuda_block_a_block_give_the_same_bits(projection, monkeypatch):
    """The walk over the slots finds the blocks in use that the grid of every block takes
    by its indices: the same sums, so the same bits (blocks of one pair and padding too)."""
    case, d, blocks = _one_block_call(torch.bfloat16, rank=5, K=9, N=7, B=3,
                                      projection=projection, offset=1)  # fmt: skip
    monkeypatch.setattr(moe_ops, "FUSED_TO_PAIRS", float("inf"))
    signature = inspect.signature(moe_fused.build_moe_fused_kernel)
    builds = mock.Mock(wraps=moe_fused.build_moe_fused_kernel)
    monkeypatch.setattr(moe_fused, "build_moe_fused_kernel", builds)
    results = []
    for most in (0, 1 << 20):  # the compact grid, then the grid of every block
        config = moe_ops.FUSED_PAIRS._replace(full_grid_blocks=most)
        monkeypatch.setattr(moe_ops, "FUSED_PAIRS", config)
        results.append(_run(case, d, blocks, 3)[0])
    compact = [signature.bind(*call.args).arguments["compact"] for call in builds.call_args_list]
    assert compact == [True, False]
    check_against_reference(case, results[0], d, d["y"])
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))


def test_version_11s_columns_a_thread_hold_at_most_its_values_of_b():
    config = moe_ops.FUSED_PAIRS._replace(vec=4, values=64)
    assert moe_ops.fused_vec(1, config) == 4
    assert moe_ops.fused_vec(16, config) == 4
    assert moe_ops.fused_vec(24, config) == 2
    assert moe_ops.fused_vec(64, config) == 1
    assert moe_ops.fused_vec(256, config) == 1  # at least 1


def _path_taken(projection, version, table, limits, monkeypatch):
    """The one-block call (bf16, r=4, K=16, N=8, blocks of 8) at ``version`` with the pairs path
    below MMA_SHRINK_FROM_PAIRS (raised to 100) and ``limits`` set on the op's module (a
    value ``None``: the call's pairs), checked against the reference: ``(builds, tables)``,
    mocks of the one launch's builder and of the module's ``table`` function."""
    case, d, blocks = _one_block_call(torch.bfloat16, rank=4, K=16, N=8, B=8,
                                      projection=projection, offset=0)  # fmt: skip
    pairs = d["topk_ids"].numel()
    for name, value in {**limits, "MMA_SHRINK_FROM_PAIRS": 100}.items():
        monkeypatch.setattr(moe_ops, name, pairs if value is None else value)
    builds = mock.Mock(wraps=moe_fused.build_moe_fused_kernel)
    monkeypatch.setattr(moe_fused, "build_moe_fused_kernel", builds)
    tables = mock.Mock(wraps=getattr(moe_ops, table))
    monkeypatch.setattr(moe_ops, table, tables)
    y, before = _run(case, d, blocks, 8, version)
    check_against_reference(case, y, d, before)
    return builds, tables


@pytest.mark.parametrize("version, one", [(12, False), (13, True)])
def test_version_13_takes_the_one_launch_where_12_takes_the_pairs_path(version, one, monkeypatch):
    """A call of more pairs than FUSED_TO_PAIRS (lowered to 1) and at most
    ONE_LAUNCH_TO_PAIRS (set to its pairs): version 13 launches the one kernel, version 12 the
    table of pairs and the row kernels. Each gives the reference."""
    limits = dict(FUSED_TO_PAIRS=1, ONE_LAUNCH_TO_PAIRS=None)
    builds, table = _path_taken("w13", version, "moe_pairs", limits, monkeypatch)
    assert (builds.call_count > 0, table.call_count) == ((True, 0) if one else (False, 1))


@pytest.mark.parametrize(
    "version, slots_a_pair, one",
    [(14, 0, False), (16, 0, True), (16, 100, False)],
    ids=["version-14", "version-16-sparse", "version-16-dense"],
)
@pytest.mark.parametrize("projection", ["w13", "w2"])
def test_version_16_takes_the_sparse_one_launch_past_version_14s(
    projection, version, slots_a_pair, one, monkeypatch
):
    """A call of more pairs than ONE_LAUNCH_TO_PAIRS (lowered to 1), at most
    SPARSE_ONE_LAUNCH_TO_PAIRS (set to its pairs): version 16 launches the one kernel with
    FUSED_PAIRS_SPARSE's columns where the (slot, expert)s are at least SPARSE_SLOTS_A_PAIR
    times the pairs (set to 0: always; to 100: never), else, as version 14 always, the table of
    pairs and the row kernels. Each gives the reference."""
    signature = inspect.signature(moe_fused.build_moe_fused_kernel)
    limits = dict(FUSED_TO_PAIRS=1, ONE_LAUNCH_TO_PAIRS=1, SPARSE_ONE_LAUNCH_TO_PAIRS=None,
                  SPARSE_SLOTS_A_PAIR=slots_a_pair)  # fmt: skip
    builds, table = _path_taken(projection, version, "claimed_pairs", limits, monkeypatch)
    assert (builds.call_count > 0, table.call_count) == ((True, 0) if one else (False, 1))
    if one:
        built = signature.bind(*builds.call_args.args).arguments
        assert built["vec"] == moe_ops.fused_vec(4, moe_ops.FUSED_PAIRS_SPARSE)
        assert moe_ops.FUSED_PAIRS_SPARSE.vec > moe_ops.FUSED_PAIRS.vec
