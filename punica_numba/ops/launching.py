"""Where each block finds its work, and the launch of a chosen kernel.

Blocks walk *tiles*: up to ``tile_m`` sorted tokens of one slot. The tile table
(:mod:`..kernels.segments`) lists them; it is the metadata's own when it is a
``LoRAKernelMeta`` (refreshed as it prepares a mapping), or made now on the device
without a sync. A call's launch is returned as a closure that captures everything it
needs, so that it can be made ready before anything runs and then be run (or captured
in a CUDA graph) with no more Python work than the launches themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .._checks import Stack
from .._cuda import SIMULATOR, KernelLauncher, pack_tensors
from ..kernels import MAX_SLICES
from ..kernels.segments import tile_grid_bound, tile_table, tile_tokens
from ..kernels.shrink_split import split_workspace
from ..launch import LaunchConfig
from ..meta import host_facts_of
from .choice import choose_expand, choose_shrink, column_blocks

__all__ = ["expand_launch", "launcher_of", "nothing", "shrink_launch"]


@functools.cache
def launcher_of(kernel) -> KernelLauncher:
    """One launcher per compiled kernel: it remembers the kernel's raw parameter layout."""
    return KernelLauncher(kernel)


def nothing() -> None:
    """The launch of a call that has nothing to do (no LoRA token, or empty sizes)."""


def tiles(num_tokens: int, metadata: tuple, op: str, config: LaunchConfig, facts) -> tuple:
    """The tile table for ``config.tile_m``, each tile's tokens (``[B, tile_m]``,
    :func:`..kernels.segments.tile_tokens`; None unless the kernel reads them,
    :meth:`~punica_numba.launch.LaunchConfig.reads_tile_tokens`) and the number of blocks
    along the tile axis.

    The table is the metadata's own when it is a ``LoRAKernelMeta`` (refreshed when it
    prepared the mapping); otherwise it is made now, on the device, without a sync.
    On the GPU the grid is the bound of :func:`tile_grid_bound`, which needs no look
    at the device (a launch can be captured in a CUDA graph); surplus blocks exit at
    once (on the H200 a grid of exactly the tiles was no faster: at r=64, 256 tokens over
    16 LoRAs, 0.6-0.8 µs slower with v28's kernels at 46f9381: the benchmark lab notes).
    On the simulator the table sits in host memory and an idle block would still cost a
    Python thread per CUDA thread, so the grid is exact.
    """
    _, sorted_tokens, counts, starts, lora_ids, _ = metadata
    tile_m, with_tokens = config.tile_m, config.reads_tile_tokens(op)
    blocks = tile_grid_bound(num_tokens, lora_ids.shape[0], tile_m)
    table = facts.tile_tables.get(tile_m) if facts is not None else None
    tokens = facts.tile_tokens.get(tile_m) if facts is not None and with_tokens else None
    if table is None or table.shape[0] < blocks:
        table = tile_table(lora_ids, counts, starts, sorted_tokens, tile_m, blocks)
        tokens = tile_tokens(table, sorted_tokens, tile_m) if with_tokens else None
    if SIMULATOR:
        blocks = int((table[:blocks, 0] >= 0).sum())
    return table, tokens, blocks


def kernel_metadata(tensors: tuple, facts, key) -> tuple:
    """What the kernels read of the metadata: the tile table, and the sorted tokens or
    each tile's tokens (:func:`tiles`); ``key`` names the pair.

    A ``LoRAKernelMeta``'s tensors are fixed buffers (a step refills them in place), and
    the wrapper hands the same tensor objects to every call of a step; then they are
    described for the launcher once (:func:`~punica_numba._cuda.pack_tensors`) and
    reused while the same objects come back.
    """
    if SIMULATOR or facts is None:
        return tensors
    known = facts.kernel_metadata.get(key)
    if known is None or any(a is not b for a, b in zip(known.tensors, tensors)):
        known = facts.kernel_metadata[key] = pack_tensors(tensors)
    return (known,)


def block_work(
    op: str, config: LaunchConfig, num_tokens: int, metadata: tuple, facts, one_slot: bool
) -> tuple:
    """``(blocks, meta)``: the blocks along the grid's x and the metadata arguments a
    kernel of ``config`` reads to find its work. Under one slot
    (:func:`.choice.one_slot`) a block per ``config.tile_m`` tokens in their own order,
    which reads their slots from ``token_lora_mapping``; else the tile table
    (:func:`tiles`) with the sorted tokens, or with each tile's tokens for the kernels
    that read those."""
    if one_slot:
        blocks = -(-num_tokens // config.tile_m)
        return blocks, kernel_metadata((metadata[0], metadata[1]), facts, "mapping")
    table, tokens, blocks = tiles(num_tokens, metadata, op, config, facts)
    if config.reads_tile_tokens(op):  # each tile's tokens, from a row of their own
        return blocks, kernel_metadata((table, tokens), facts, (config.tile_m, "rows"))
    return blocks, kernel_metadata((table, metadata[1]), facts, config.tile_m)


def shrink_launch(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output_tensor: torch.Tensor,
    metadata: tuple,
    scaling: float,
    accumulate: bool = True,
) -> Callable[[], None]:
    """The launch of a shrink whose arguments are already checked (by
    :func:`.checks.check_shrink` or the wrapper): ``inputs`` [T, H] contiguous,
    ``weights`` Stacks of [L, r, H] of its dtype, ``output_tensor`` [>= S, T, r],
    ``metadata`` vLLM's six tensors fitting T rows and L slots, at least one token with a
    LoRA, T > 0 and r > 0. ``scaling`` is a float.

    ``accumulate=False`` stores the products instead of adding them: for a buffer the
    wrapper made for one call (``torch.empty``), which saves filling it with zeros.

    A split-K shrink also reads and writes a workspace
    (:func:`..kernels.shrink_split.split_workspace`): its partial sums and per-group
    counters, sized for this call now, but taken at each launch, that of the stream the
    launch runs on (a launch made ready on one stream and run on another, such as a
    warm-up before a CUDA graph capture on a side stream, never shares counters with
    the first stream's launches)."""
    num_tokens = inputs.shape[0]
    facts = host_facts_of(metadata[4])
    chosen = choose_shrink(inputs, weights, output_tensor, facts, accumulate)
    config, x, kernel_weights = chosen.config, chosen.x, chosen.weights
    blocks, meta = block_work("shrink", config, num_tokens, metadata, facts, chosen.one_slot)
    launcher = launcher_of(chosen.kernel)
    scaling32 = np.float32(scaling)
    sizes = None  # a split-K shrink's workspace sizes (its pair is taken at each launch)
    # (one whose runs add up in a cluster takes none: kernels.shrink_mma_cluster)
    if (config.kernel == "split" or config.splits > 1) and blocks and not config.cluster:
        slices = min(len(kernel_weights), MAX_SLICES)  # (the most one launch covers)
        rank = weights[0].rows
        # Rank groups along y on the tensor cores (the chunks along z), else with the
        # chunks along z.
        groups = chosen.rank_groups // (1 if chosen.tensor_cores else config.splits)
        sizes = (config.splits, slices, num_tokens, rank, blocks, groups)

    def launch() -> None:
        if blocks == 0:
            return
        workspace = () if sizes is None else split_workspace(inputs.device, *sizes)
        for base in range(0, len(kernel_weights), MAX_SLICES):
            chunk = list(kernel_weights[base : base + MAX_SLICES])
            count = len(chunk)
            chunk += [chunk[0]] * (MAX_SLICES - count)  # unused slots: never read
            if config.joint:  # a tile's slices in each block, their ranks side by side
                grid = (blocks, chosen.rank_groups, 1)
                args = (x, *chunk, output_tensor, base, count)
            elif chosen.tensor_cores:  # a tile's slices side by side along x
                grid = (blocks * count, chosen.rank_groups, config.splits)
                args = (x, *chunk, output_tensor, base, count, *workspace)
            else:
                grid = (blocks, count, chosen.rank_groups)
                args = (x, *chunk, output_tensor, base, *workspace)
            launcher(grid, config.threads, (*args, *meta, scaling32))

    launch.config = config  # what was chosen (the benchmark reports it)
    return launch


def expand_launch(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output_tensor: torch.Tensor,
    metadata: tuple,
    offset_start: int,
    add_inputs: bool,
    after_own_shrink: bool = False,
) -> Callable[[], None]:
    """The launch of an expand whose arguments are already checked (by
    :func:`.checks.check_expand` or the wrapper): ``inputs`` [>= S, T, r], ``weights``
    Stacks of [L, N_s, r], ``output_tensor`` [T, >= offset_start + sum(N_s)] contiguous,
    ``metadata`` vLLM's six tensors fitting T rows and L slots, at least one token with a
    LoRA, T > 0 and sum(N_s) > 0. ``after_own_shrink``: the launch just ahead of this one
    on the stream is this package's shrink (:func:`.choice.choose_expand`)."""
    num_tokens = inputs.shape[1]
    widths = [w.rows for w in weights]
    facts = host_facts_of(metadata[4])
    chosen = choose_expand(inputs, weights, output_tensor, facts, offset_start, after_own_shrink)
    config, kernel_weights, columns = chosen.config, chosen.weights, chosen.columns
    x, out, per_block = chosen.x, chosen.out, chosen.per_block
    blocks, meta = block_work("expand", config, num_tokens, metadata, facts, chosen.one_slot)
    launcher = launcher_of(chosen.kernel)

    def launch() -> None:
        if blocks == 0:
            return
        for base in range(0, len(kernel_weights), MAX_SLICES):
            chunk = list(kernel_weights[base : base + MAX_SLICES])
            starts = columns[base : base + MAX_SLICES]
            widest = max(widths[base : base + MAX_SLICES])
            grid = (blocks, len(chunk), column_blocks(config, widest, per_block))
            chunk += [chunk[0]] * (MAX_SLICES - len(chunk))
            starts += [0] * (MAX_SLICES - len(starts))
            args = (x, *chunk, out, base, *starts, *meta, add_inputs)
            launcher(grid, config.threads, args)

    launch.config = config  # what was chosen (the benchmark reports it)
    return launch
