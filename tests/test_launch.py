"""The launch heuristic and its configuration tables (pure host logic, both machines).

The GPU table is checked here too, on any machine: ``launch_configs`` reads which
table applies from ``punica_numba.launch.SIMULATOR``, which the tests switch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from unittest import mock

import pytest

from punica_numba import LoRAKernelMeta, launch
from punica_numba._cuda import device_of
from punica_numba.launch import (
    choose_launch_config,
    config_name,
    force_launch_config,
    launch_configs,
    tile_sizes,
)

OPS = ("shrink", "expand")


#: The widest slice of a call whose blocks reach any ``from_blocks``.
WIDE = 1 << 16


def _choose(*args, **kwargs):
    """The heuristic for a call that can use every kernel the tables name (lane-split
    expands included; tensor cores as the caller says)."""
    return choose_launch_config(*args, lane_split=True, **kwargs)


def _rows_for(config) -> int:
    """A row count within ``config``'s range of rows, 4096 where that allows."""
    rows = max(config.from_tokens, 1 << 12)
    return rows if config.to_tokens is None else min(rows, config.to_tokens)


def _rank_for(config) -> int:
    """A rank within ``config``'s range: its ``from_rank``, 16 where that is 0 (a rank of
    0 makes no products, so reaches no ``from_work``)."""
    return config.from_rank or 16


def _slices_for(config) -> int:
    """A slice count within ``config``'s range at which no later configuration for fewer
    slices takes over (one capped at ``to_slices=1`` takes one slice from those before
    it): the low end of its range where it has a ``to_slices``, else at least 2."""
    return config.from_slices if config.to_slices is not None else max(config.from_slices, 2)


@pytest.fixture(params=[True, False], ids=["simulator-table", "gpu-table"])
def table(request, monkeypatch):
    """Run a test against the simulator's table, then the GPU's."""
    monkeypatch.setattr(launch, "SIMULATOR", request.param)
    return request.param


@pytest.mark.parametrize("op", OPS)
def test_thresholds_start_at_zero_and_never_fall(op, table):
    """The FFMA configurations come first, the tensor-core ones after; within each kind
    the thresholds of those the heuristic may pick never fall (the ``tuned_only`` ones
    have none it reads)."""
    configs = launch_configs(op)
    assert configs[0].from_tokens_per_slot == 0 and configs[0].from_tokens == 0
    kinds = [c.kernel == "mma" for c in configs]
    assert kinds == sorted(kinds), "tensor-core configurations after the FFMA ones"
    for tensor_cores in (False, True):
        thresholds = [
            c.from_tokens_per_slot
            for c in configs
            if (c.kernel == "mma") == tensor_cores and not c.tuned_only
        ]
        assert thresholds == sorted(thresholds), thresholds
    names = [config_name(c) for c in configs]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("op", OPS)
def test_the_heuristic_picks_the_last_threshold_reached(op, table):
    configs = launch_configs(op)
    assert choose_launch_config(op, 1, 1) == configs[0]
    # a token per slot, foreign metadata, no active slot: one token per slot is assumed
    for slots in (64, None, 0):
        assert _choose(op, 64, slots).from_tokens_per_slot == 0, slots
    # every threshold reached: the last configuration whose rank range holds the rank
    for rank in (1, 1 << 10):
        for slices in (1, 3):
            fitting = [
                c
                for c in configs
                if c.from_rank <= rank <= (c.to_rank or rank)
                and c.from_slices <= slices
                and c.to_tokens is None
                and not c.tuned_only
                and not c.from_hidden  # (K not given: never reached)
                and c.to_blocks is None  # (a million tokens make more blocks than any cap)
            ]
            chosen = _choose(op, 1 << 20, 1, rank, True, slices, N=WIDE)
            assert chosen == fitting[-1], (rank, slices)
    # (not those gated on K or capped by blocks: reached by K and few blocks, not by rows)
    for config in (c for c in configs if not (c.tuned_only or c.from_hidden or c.to_blocks)):
        tokens = _rows_for(config)
        slots = max(1, int(tokens / max(config.from_tokens_per_slot, 1)))
        tensor_cores = config.kernel == "mma"
        chosen = _choose(op, tokens, slots, _rank_for(config), tensor_cores, config.from_slices)
        assert (chosen.kernel == "mma") == tensor_cores, (config, chosen)
        assert chosen.from_tokens_per_slot >= config.from_tokens_per_slot, (config, chosen)


@pytest.mark.parametrize("op", OPS)
def test_a_reached_tensor_core_configuration_wins(op, table):
    """Where the call allows the tensor cores and one of their thresholds is reached,
    they win over every FFMA configuration, even one with a higher threshold."""
    configs = launch_configs(op)
    first = next(c for c in configs if c.kernel == "mma")
    tokens = max(first.from_tokens, 1 << 12)
    slots = 1  # every threshold on tokens per slot reached
    without = choose_launch_config(op, tokens, slots, 1 << 10)
    assert without.kernel != "mma" and without.from_tokens_per_slot > 0
    assert choose_launch_config(op, tokens, slots, 1 << 10, tensor_cores=True).kernel == "mma"
    if first.from_tokens_per_slot:
        below = max(1, int(tokens / first.from_tokens_per_slot) + 1)  # just under its threshold
        if tokens / below < first.from_tokens_per_slot:
            assert choose_launch_config(op, tokens, below, tensor_cores=True).kernel != "mma"
    if first.from_tokens > 1:  # just under its rows
        fewer = choose_launch_config(op, first.from_tokens - 1, 1, 1 << 10, tensor_cores=True)
        assert fewer.kernel != "mma", fewer


@pytest.mark.parametrize("op", OPS)
def test_tensor_cores_only_for_calls_that_allow_them(op, table):
    """A call whose dtypes the tensor cores do not take never gets them, not even when a
    test forces them (it then gets what the heuristic picks without them)."""
    tensor_core_configs = [c for c in launch_configs(op) if c.kernel == "mma"]
    assert tensor_core_configs, "each table has a tensor-core configuration of each op"
    first = tensor_core_configs[0]
    slots, rank = 4, _rank_for(first)
    tokens = int(first.from_tokens_per_slot * slots) + max(first.from_tokens, 1)
    tokens = max(tokens, -(-first.from_work // rank))
    assert choose_launch_config(op, tokens, slots, rank, tensor_cores=True).kernel == "mma"
    without = choose_launch_config(op, tokens, slots, rank)
    assert without.kernel != "mma"
    for rows in (1, 16, 1 << 12, 1 << 20):
        assert choose_launch_config(op, rows, 1, 1 << 10).kernel != "mma"
    with force_launch_config(op, first):
        assert choose_launch_config(op, 1, 1, tensor_cores=True) == first
        assert choose_launch_config(op, tokens, slots, rank) == without


def test_from_rank_holds_back_a_config(monkeypatch):
    """Some configurations pay off only at large ranks (on the H200: the FFMA
    shared-memory tiles of the expand at r=64, not r=16; the tensor-core shrink's blocks
    of 8 or 16 ranks, and from 8 tokens per slot at all); below, the call goes
    elsewhere."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    # (Not those that a hidden size gates too: the tensor-core split shrinks, whose rank
    # ranges test_split_shrink checks with the rest of their thresholds; nor those the
    # heuristic never picks, test_a_tuned_only_config_is_never_the_heuristics_pick's.)
    gated = [
        (op, c)
        for op in OPS
        for c in launch_configs(op)
        if c.from_rank and not c.from_hidden and not c.tuned_only
    ]
    assert {op for op, _ in gated} == set(OPS), "each op gates a configuration on the rank"
    for op, config in gated:
        tensor_cores = config.kernel == "mma"
        rank = config.from_rank
        # rows at which it is the pick: a later configuration may gate on more rows, or on
        # more blocks (the shrink's 4 warps of every rank from 1024 of them)
        reaching = [
            (tokens, slots)
            for tokens in (config.from_tokens or 1 << 12, max(config.from_tokens, 1 << 10))
            for slots in [max(1, int(tokens // max(config.from_tokens_per_slot, 1)))]
            if _choose(op, tokens, slots, rank, tensor_cores) == config
        ]
        assert reaching, config
        tokens, slots = reaching[0]
        below = _choose(op, tokens, slots, rank - 1, tensor_cores)
        assert below != config and below.from_rank < rank, (config, below)


def test_to_rank_holds_back_a_config(monkeypatch):
    """A configuration that runs out of registers past a rank (the tensor-core shrink's
    16-warp blocks at r=64 on the H200) is never chosen there, not even when forced: the
    call then gets what the heuristic picks. (One the tuner alone times is never the
    heuristic's pick: forced, it is held back the same way.)"""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    capped = [(op, c) for op in OPS for c in launch_configs(op) if c.to_rank is not None]
    assert capped, "the GPU table caps a configuration's rank"
    for op, config in capped:
        tensor_cores = config.kernel == "mma"
        tokens = _rows_for(config)
        slots = max(1, int(tokens // max(config.from_tokens_per_slot, 1)))
        rank, slices = config.to_rank, _slices_for(config)
        past = _choose(op, tokens, slots, rank + 1, tensor_cores, slices)
        if not config.tuned_only:
            assert _choose(op, tokens, slots, rank, tensor_cores, slices) == config
        assert past != config and (past.to_rank is None or past.to_rank > rank), (config, past)
        with force_launch_config(op, config):
            assert _choose(op, tokens, slots, rank, tensor_cores, slices) == config
            assert _choose(op, tokens, slots, rank + 1, tensor_cores, slices) == past


def test_to_tokens_holds_back_a_config(monkeypatch):
    """A configuration for fewer rows than another takes (the tensor-core expand's one
    warp of 128 columns below T=1024 on the H200) is not chosen past its ``to_tokens``,
    however many tokens each slot has."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    capped = [(op, c) for op in OPS for c in launch_configs(op) if c.to_tokens is not None]
    assert capped, "the GPU table caps a configuration's rows"
    for op, config in capped:
        tensor_cores = config.kernel == "mma"
        rows, rank, slices = config.to_tokens, config.from_rank or 16, _slices_for(config)
        per_slot = max(config.from_tokens_per_slot, 1)
        assert _choose(op, rows, int(rows // per_slot), rank, tensor_cores, slices) == config
        past = _choose(op, rows + 1, int((rows + 1) // per_slot), rank, tensor_cores, slices)
        assert past != config, config
        assert _choose(op, rows + 1, 1, rank, tensor_cores, slices) != config


def test_from_slices_holds_back_a_config(monkeypatch):
    """A tensor-core shrink tile that pays off only where several slices share x (QKV on
    the H200) waits for that many slices."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    gated = [(op, c) for op in OPS for c in launch_configs(op) if c.from_slices > 1]
    assert gated, "the GPU table gates a configuration on the slices"
    for op, config in gated:
        tokens = max(config.from_tokens, 1 << 12)
        slots = max(1, int(tokens // max(config.from_tokens_per_slot, 1)))
        rank = config.from_rank or 16
        args = (op, tokens, slots, rank, config.kernel == "mma")
        assert _choose(*args, config.from_slices) == config
        assert _choose(*args, config.from_slices - 1) != config


def test_to_slices_holds_back_a_config(monkeypatch):
    """A configuration for one slice (the tensor-core expand's four warps of 128 columns
    on the H200, which would leave most blocks of a QKV layer's narrow slices idle) is
    not chosen for more: the call gets what it got before that configuration."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    capped = [(op, c) for op in OPS for c in launch_configs(op) if c.to_slices is not None]
    assert capped, "the GPU table caps a configuration's slices"
    for op, config in capped:
        tokens = _rows_for(config)
        slots = max(1, int(tokens // max(config.from_tokens_per_slot, 1)))
        args = (op, tokens, slots, config.from_rank or 16, config.kernel == "mma")
        assert _choose(*args, config.to_slices) == config
        past = _choose(*args, config.to_slices + 1)
        assert past != config and (past.to_slices or 1 << 10) > config.to_slices, past


def test_from_tokens_holds_back_a_config(monkeypatch):
    """A configuration gated on the row count waits for that many rows, whatever the
    tokens per slot (e.g. the shrink's 128-thread blocks pay off only from T=128 on)."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    gated = [
        (op, c) for op in OPS for c in launch_configs(op) if c.from_tokens and not c.tuned_only
    ]
    assert gated, "the GPU table gates a configuration on the row count"
    for op, config in gated:
        rows = config.from_tokens
        # slots such that the tokens per slot just reach this configuration's threshold
        slots = max(1, int(rows // max(config.from_tokens_per_slot, 1)))
        tensor_cores = config.kernel == "mma"
        # a rank at which it is the pick (a configuration with the same thresholds but a
        # rank range of its own may take the others)
        ranks = [r for r in (config.from_rank, 16, 64) if r >= config.from_rank]
        slices = config.from_slices
        wide = dict(N=WIDE) if config.from_blocks else {}  # (its blocks reached, or none)
        picked = [
            r for r in ranks if _choose(op, rows, slots, r, tensor_cores, slices, **wide) == config
        ]
        assert picked, config
        rank = picked[0]
        below = _choose(op, rows - 1, slots, rank, tensor_cores, slices, **wide)
        assert below != config, config


def test_from_blocks_holds_back_a_config(monkeypatch):
    """A configuration gated on its blocks (the H200's expand of two warps and two column
    groups a block from 1024 of them) waits for them: reached with a tile more, not at a
    tile fewer, and never where the widest slice's columns are not known."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    gated = [c for c in launch_configs("expand") if c.from_blocks and not c.tuned_only]
    assert gated, "the GPU table gates an expand on its blocks"
    for config in gated:
        width = 4096
        per_tile = -(-width // (config.tile_n * config.passes))  # blocks a tile, one slice
        tiles = -(-config.from_blocks // per_tile)
        tokens = max(tiles, config.from_tokens)  # a token a slot: a tile a token
        rank = config.from_rank or 16
        call = functools.partial(_choose, "expand", rank=rank, tensor_cores=True, N=width)
        assert call(num_tokens=tokens, active_slots=tokens) == config
        assert call(num_tokens=tokens - 1, active_slots=tokens - 1) != config
        assert _choose("expand", tokens, tokens, rank, True) != config  # N not known


def test_many_shrink_blocks_take_four_warps_of_every_rank(monkeypatch):
    """From 1024 blocks of 4 warps of every rank (tiles x slices), a tensor-core shrink up to
    r=64 takes those, at 16 tokens a slot and at 64 (where 8 warps of every rank took T=4096
    before); a slot fewer it does not, nor past r=64, whose outputs would not fit."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    four = [
        c
        for c in launch_configs("shrink")
        if c.kernel == "mma" and c.threads == 128 and c.from_blocks and not c.tile_n
    ]
    assert len(four) == 1, four
    (four,) = four
    for rank, slices, per_slot in itertools.product((16, 64), (1, 2), (16, 64)):
        tiles_a_slot = per_slot // four.tile_m
        slots = -(-four.from_blocks // (slices * tiles_a_slot))
        call = functools.partial(_choose, "shrink", rank=rank, tensor_cores=True, slices=slices)
        assert call(slots * per_slot, slots, K=4096) == four, (rank, slices, per_slot)
        fewer = slots - 1
        assert call(fewer * per_slot, fewer, K=4096) != four, (rank, slices, per_slot)
        assert call(slots * per_slot, slots, rank=four.to_rank + 1, K=4096) != four


def test_lanes_come_before_the_tensor_cores_where_a_slot_has_fewer_tokens_than_64_rank_chunks(
    monkeypatch,
):
    """An expand takes the lane-split kernel it reaches even where the tensor cores could
    take it, where its tokens a slot are fewer than its rank's chunks of 64: a token a LoRA
    past r=64, up to 3 past r=128; not at r=64, not with 2 tokens a LoRA at r=128, and not
    where its rows of B do not split among lanes."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    chunk = launch._LANES_FIRST_RANKS_A_TOKEN
    for tokens in (8, 32, 128, 1024):
        call = functools.partial(_choose, "expand", tokens, tensor_cores=True, N=4096)
        for rank, per_slot, lanes in (
            (chunk + 1, 1, True), (2 * chunk, 1, True), (2 * chunk, 2, False),
            (4 * chunk, 2, True), (4 * chunk, 4, False), (chunk, 1, False),
        ):  # fmt: skip
            got = call(tokens // per_slot, rank=rank).kernel
            assert got == ("lanes" if lanes else "mma"), (tokens, rank, per_slot)
        plain = choose_launch_config("expand", tokens, tokens, 2 * chunk, True, N=4096)
        assert plain.kernel == "mma", tokens


def test_from_work_holds_back_a_config(monkeypatch):
    """A configuration gated on the products' rows (tokens x rank x slices: the H200's
    8-rank tensor-core shrink from 3072) waits for them: reached at that work, not one
    row below it, at the same tokens per slot."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    # (Not the tensor-core split shrinks, which a hidden size gates too: test_split_shrink.)
    gated = [(op, c) for op in OPS for c in launch_configs(op) if c.from_work and not c.from_hidden]
    assert gated, "the GPU table gates a configuration on the products' rows"
    for op, config in gated:
        rank, slices = _rank_for(config), config.from_slices
        rows = -(-config.from_work // (rank * slices))  # the fewest tokens reaching it
        # slots that keep a row fewer at the tokens per slot it asks for
        slots = max(1, int((rows - 1) // max(config.from_tokens_per_slot, 1)))
        tensor_cores = config.kernel == "mma"
        assert _choose(op, rows, slots, rank, tensor_cores, slices) == config, config
        assert (rows - 1) / slots >= config.from_tokens_per_slot
        below = _choose(op, rows - 1, slots, rank, tensor_cores, slices)
        assert below != config, (config, below)
        # more slices reach it with fewer tokens
        assert _choose(op, -(-rows // 3), 1, rank, tensor_cores, 3) == config


def test_a_tuned_only_config_is_never_the_heuristics_pick(monkeypatch):
    """A configuration marked ``tuned_only`` (the H200's split shrinks, never the fastest
    there) is timed by the tuner (it is among the configurations) and taken when forced or
    named by a table, but the heuristic never picks it, even where every threshold of its
    own is reached."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    marked = [(op, c) for op in OPS for c in launch_configs(op) if c.tuned_only]
    assert marked, "the GPU table marks a configuration for the tuner alone"
    for op, config in marked:
        tokens = max(16, config.from_tokens)  # over slots that reach its own tokens-per-slot
        slots = max(
            1, int(tokens // (config.to_tokens_per_slot or max(config.from_tokens_per_slot, 4)))
        )
        hidden, rank = max(config.from_hidden, 1), max(config.from_rank, 16)
        chosen = choose_launch_config(op, tokens, slots, rank, True, K=hidden, N=16)
        assert not chosen.tuned_only, chosen
        with force_launch_config(op, config):
            assert choose_launch_config(op, tokens, slots, rank, True, K=hidden, N=16) == config
        unmarked = dataclasses.replace(config, tuned_only=False)
        table = tuple(unmarked if c == config else c for c in launch_configs(op))
        with mock.patch.dict(launch._GPU_CONFIGS, {op: table}):
            again = choose_launch_config(op, tokens, slots, rank, True, K=hidden, N=16)
            assert again == unmarked


def test_arithmetic_keys_group_what_adds_alike(table):
    """The row and the tiled expand both promise one order: the heuristic may switch
    between them from one step to the next without changing a bit; the tensor-core
    expands promise one order of their own, whatever their tiles. The shrinks group by
    threads, the tensor-core ones apart (their sums run in an order of their own); a staged
    tensor-core shrink's sums are each one warp's, as in a block of 32 threads."""
    assert {c.kernel for c in launch_configs("expand")} == {"rows", "tiled", "lanes", "mma"}
    for c in launch_configs("expand"):
        own = {"mma": ("mma",), "lanes": ("lanes",)}
        assert c.arithmetic("expand") == own.get(c.kernel, ("sequential",))
    for c in launch_configs("shrink"):
        if c.kernel == "split":  # each chunk's tree, then the chunks in order
            assert c.arithmetic("shrink") == ("split", c.threads, c.splits)
            continue
        threads = 32 if c.staged else c.threads
        if c.kernel == "mma" and c.splits > 1:  # the same, the chunks' sums in order after
            assert c.arithmetic("shrink") == ("mma", threads, c.splits)
            continue
        kind = "mma" if c.kernel == "mma" else "tree"
        assert c.arithmetic("shrink") == (kind, threads)


def test_meta_keeps_a_tile_table_for_every_tile_size():
    meta = LoRAKernelMeta.make(max_loras=3, max_num_tokens=8, device=device_of())
    assert set(tile_sizes()) <= set(meta.host.tile_tables)
    for op in OPS:
        for config in launch_configs(op):
            assert config.tile_m in meta.host.tile_tables, config


def test_forcing_a_configuration_is_scoped_and_checked():
    shrink_configs = launch_configs("shrink")
    last = shrink_configs[-1]
    with force_launch_config("shrink", last):
        assert choose_launch_config("shrink", 1, 1, tensor_cores=True) == last
        with force_launch_config("shrink", shrink_configs[0]):
            assert choose_launch_config("shrink", 1 << 20, 1) == shrink_configs[0]
        assert choose_launch_config("shrink", 1, 1, tensor_cores=True) == last
    assert choose_launch_config("shrink", 1, 1) == shrink_configs[0]
    foreign = next(c for c in launch_configs("expand") if c not in shrink_configs)
    with pytest.raises(ValueError, match="not one of the configurations"):
        with force_launch_config("shrink", foreign):
            pass
    with pytest.raises(ValueError, match="op must be one of"):
        launch_configs("gemm")


def test_lane_split_only_for_calls_that_allow_it(table):
    """A lane-split expand is picked, or taken when forced, only for a call whose rows of
    B split into at most ``MAX_LANE_WORDS`` words a lane; others get the row expands."""
    lanes = [c for c in launch_configs("expand") if c.kernel == "lanes"]
    assert lanes, "each table has a lane-split expand"
    for config in lanes:
        tokens, rank = max(config.from_tokens, 1), max(config.from_rank, 16)
        assert _choose("expand", tokens, tokens, rank) == config
        assert choose_launch_config("expand", tokens, tokens, rank).kernel == "rows"
        with force_launch_config("expand", config):
            assert _choose("expand", 1 << 12, 1, rank) == config
            assert choose_launch_config("expand", 1 << 12, 1, rank).kernel != "lanes"


def test_rows_of_b_split_among_lanes():
    """How many lanes share a row of ``words`` words, and which rows split at all."""
    from punica_numba.kernels.expand_lanes import MAX_LANE_WORDS, lanes_per_row, splits

    # bf16, packed: r=8, 16, 20, 32, 64, 128, 256, 512 -> 2, 4, 5, ... words a row
    assert [lanes_per_row(w) for w in (1, 2, 4, 5, 8, 16, 32, 64, 128)] == [
        1, 1, 2, 1, 4, 8, 16, 32, 32
    ]  # fmt: skip
    assert splits(4) and splits(16) and splits(128) and splits(MAX_LANE_WORDS)
    assert not splits(MAX_LANE_WORDS + 1) and not splits(17)  # odd: one lane, too many
