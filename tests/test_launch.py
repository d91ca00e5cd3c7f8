"""The launch heuristic and its configuration tables (pure host logic, both machines).

The GPU table is checked here too, on any machine: ``launch_configs`` reads which
table applies from ``punica_numba.launch.SIMULATOR``, which the tests switch.
"""

from __future__ import annotations

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


@pytest.fixture(params=[True, False], ids=["simulator-table", "gpu-table"])
def table(request, monkeypatch):
    """Run a test against the simulator's table, then the GPU's."""
    monkeypatch.setattr(launch, "SIMULATOR", request.param)
    return request.param


@pytest.mark.parametrize("op", OPS)
def test_thresholds_start_at_zero_and_never_fall(op, table):
    configs = launch_configs(op)
    assert configs[0].from_tokens_per_slot == 0 and configs[0].from_tokens == 0
    thresholds = [c.from_tokens_per_slot for c in configs]
    assert thresholds == sorted(thresholds), thresholds
    names = [config_name(c) for c in configs]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("op", OPS)
def test_the_heuristic_picks_the_last_threshold_reached(op, table):
    configs = launch_configs(op)
    assert choose_launch_config(op, 1, 1) == configs[0]
    # a token per slot, foreign metadata, no active slot: one token per slot is assumed
    for slots in (64, None, 0):
        assert choose_launch_config(op, 64, slots).from_tokens_per_slot == 0, slots
    assert choose_launch_config(op, 1 << 20, 1, 1 << 10, tensor_cores=True) == configs[-1]
    for config in configs:
        tokens = max(config.from_tokens, 1 << 12)
        slots = max(1, int(tokens / max(config.from_tokens_per_slot, 1)))
        chosen = choose_launch_config(op, tokens, slots, config.from_rank, tensor_cores=True)
        assert chosen.from_tokens_per_slot >= config.from_tokens_per_slot, (config, chosen)


def test_tensor_cores_only_for_calls_that_allow_them(table):
    """A call whose dtypes the tensor cores do not take never gets them, not even when a
    test forces them (it then gets what the heuristic picks without them)."""
    op = "shrink"
    tensor_core_configs = [c for c in launch_configs(op) if c.kernel == "mma"]
    assert tensor_core_configs, "each table has a tensor-core shrink"
    first = tensor_core_configs[0]
    slots = 4
    tokens = int(first.from_tokens_per_slot * slots) + max(first.from_tokens, 1)
    assert choose_launch_config(op, tokens, slots, tensor_cores=True).kernel == "mma"
    without = choose_launch_config(op, tokens, slots)
    assert without.kernel != "mma"
    for rows in (1, 16, 1 << 12, 1 << 20):
        assert choose_launch_config(op, rows, 1, 1 << 10).kernel != "mma"
    with force_launch_config(op, first):
        assert choose_launch_config(op, 1, 1, tensor_cores=True) == first
        assert choose_launch_config(op, tokens, slots) == without


def test_from_rank_holds_back_a_config(table):
    """The shared-memory tiles of expand pay off only at large ranks (on the H200: r=64
    yes, r=16 no); below, many tokens per slot go to the row kernel."""
    gated = [c for c in launch_configs("expand") if c.from_rank]
    assert gated, "the table gates a configuration on the rank"
    for config in gated:
        tokens = max(config.from_tokens, 1 << 12)
        slots = max(1, int(tokens // max(config.from_tokens_per_slot, 1)))
        assert choose_launch_config("expand", tokens, slots, config.from_rank) == config
        below = choose_launch_config("expand", tokens, slots, config.from_rank - 1)
        assert below != config and below.kernel == "rows", (config, below)


def test_from_tokens_holds_back_a_config(monkeypatch):
    """A configuration gated on the row count waits for that many rows, whatever the
    tokens per slot (e.g. the shrink's 128-thread blocks pay off only from T=128 on)."""
    monkeypatch.setattr(launch, "SIMULATOR", False)
    gated = [(op, c) for op in OPS for c in launch_configs(op) if c.from_tokens]
    assert gated, "the GPU table gates a configuration on the row count"
    for op, config in gated:
        rows = config.from_tokens
        # slots such that the tokens per slot just reach this configuration's threshold
        slots = max(1, int(rows // max(config.from_tokens_per_slot, 1)))
        assert choose_launch_config(op, rows, slots, tensor_cores=True) == config, config
        assert choose_launch_config(op, rows - 1, slots, tensor_cores=True) != config, config


def test_every_expand_shares_one_arithmetic_and_shrink_groups_by_threads(table):
    """The row and the tiled expand both promise one order: the heuristic may switch
    between them from one step to the next without changing a bit. The shrinks group
    by threads, the tensor-core ones apart (their sums run in an order of their own)."""
    assert {c.kernel for c in launch_configs("expand")} == {"rows", "tiled"}
    assert len({c.arithmetic("expand") for c in launch_configs("expand")}) == 1
    for c in launch_configs("shrink"):
        kind = "mma" if c.kernel == "mma" else "tree"
        assert c.arithmetic("shrink") == (kind, c.threads)


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
