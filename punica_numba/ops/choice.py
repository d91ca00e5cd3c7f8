"""Which kernel a checked call takes, and what is compiled into it.

The launch configuration comes from the heuristic of :mod:`punica_numba.launch`, which
reads host-side facts only (rows, tokens per active slot, rank, slices). This module
adds what depends on the call's tensors: whether the tensor cores can take them
(:mod:`.operands`), whether the weights hold one slot (then blocks need not look their
tokens up), and the flags a build compiles in. It returns the compiled kernel with
the operands it reads; :mod:`.launching` gives it its grid and launches it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._checks import Stack
from ..kernels import (
    COMPILED_WORDS,
    MAX_SLICES,
    MAX_WORDS_PER_THREAD,
    build_cluster_mma_shrink_kernel,
    build_expand_kernel,
    build_joint_mma_shrink_kernel,
    build_lanes_expand_kernel,
    build_mma_expand_kernel,
    build_mma_shrink_kernel,
    build_shrink_kernel,
    build_split_mma_shrink_kernel,
    build_split_shrink_kernel,
    build_split_staged_mma_shrink_kernel,
    build_staged_mma_expand_kernel,
    build_staged_mma_shrink_kernel,
    build_tiled_expand_kernel,
    build_token_shrink_kernel,
    splits,
    staged_expand_warps,
)
from ..kernels.dtypes import packing
from ..launch import LaunchConfig, choose_launch_config, launch_configs
from . import operands

__all__ = [
    "ASK_AHEAD_TOKENS",
    "ExpandChoice",
    "MAX_GRID_YZ",
    "ShrinkChoice",
    "choose_expand",
    "choose_shrink",
    "column_blocks",
]

#: CUDA's limit on gridDim.y and gridDim.z. The kernels stride over rank and column
#: groups by gridDim.z, so a capped grid still covers every group.
MAX_GRID_YZ = 65535

#: The most tokens of a launch that asks ahead: the largest measured (a launch of more has
#: more blocks, and where a kernel's blocks were many, saying launch_dependents first lost).
ASK_AHEAD_TOKENS = 256


class ShrinkChoice(NamedTuple):
    """A shrink's kernel and what it reads."""

    config: LaunchConfig
    kernel: object  # the compiled kernel
    x: torch.Tensor  # the activations as the kernel reads them (elements or int64 words)
    weights: list  # each slice's A as the kernel reads it
    rank_groups: int  # blocks along the rank axis (grid.y on tensor cores, else grid.z;
    # split K: rank groups x chunks; joint: groups of the slices' ranks side by side)
    tensor_cores: bool
    one_slot: bool  # blocks take tokens in their own order (:func:`one_slot`)


class ExpandChoice(NamedTuple):
    """An expand's kernel and what it reads."""

    config: LaunchConfig
    kernel: object  # the compiled kernel
    x: torch.Tensor  # the buffer as the kernel reads it
    weights: list  # each slice's B as the kernel reads it
    out: torch.Tensor  # the output as the kernel reads and writes it
    columns: list[int]  # each slice's first column, in the kernel's units (4-column words
    # on the tensor cores)
    per_block: int  # output columns one block covers per group
    one_slot: bool


def choose_shrink(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output: torch.Tensor,
    facts,
    accumulate: bool,
    config: LaunchConfig | None = None,
    x_rows: int = 1,
    row_scaled: bool = False,
) -> ShrinkChoice:
    """The kernel of a checked shrink (``facts``: the metadata's host-side facts, or None
    for metadata built some other way); ``accumulate=False`` builds one that stores its
    products instead of adding them. ``config``, where given, is taken instead of the
    heuristic's pick (as :func:`choose_expand` takes it). ``x_rows``: the output rows that
    share a row of x, row ``t`` reading row ``t // x_rows`` (MoE LoRA's pairs of a token,
    :mod:`.moe_dense`), and ``row_scaled``: a factor an output row in place of the scaling
    (MoE LoRA's router weights), which only the row shrink of one-token tiles takes."""
    num_tokens, rank = inputs.shape[0], weights[0].rows
    active = facts and facts.active_slots
    slices = len(weights)
    key = dict(dtype=weights[0].dtype, K=inputs.shape[1], N=rank)  # the tuned tables' key
    config = config or choose_launch_config("shrink", num_tokens, active, rank, True, slices, **key)
    if (x_rows != 1 or row_scaled) and (config.kernel != "rows" or config.tile_m != 1):
        asked = f"x_rows={x_rows}" + (", row_scaled" if row_scaled else "")
        raise ValueError(f"{asked} takes the row shrink of one-token tiles, not {config}")
    mma = None
    if config.kernel == "mma":
        mma = operands.mma_shrink_operands(inputs, weights, config.tile_n)
        if mma is None:  # the tensor cores cannot take this call
            config = choose_launch_config("shrink", num_tokens, active, rank, False, slices, **key)
    if mma is not None:
        x, packed, wide = mma
        if config.staged:  # x and A in shared memory, a block's ranks split among its warps
            warps = config.threads // 32
            # A block's ranks: one slice's, or (joint) the launch's slices' side by side.
            ranks = min(slices, MAX_SLICES) * rank if config.joint else rank
            per_warp = -(-min(ranks, config.tile_n) // (8 * warps))  # 8-rank tiles of a warp
            tiles = (inputs.dtype, output.dtype, config.threads, config.tile_m // 16, per_warp)
            if config.splits > 1:  # K in runs too, a block each along grid.z
                kernel = build_split_staged_mma_shrink_kernel(
                    *tiles, config.splits, accumulate, wide, stages=config.stages
                )
            else:
                kernel = build_staged_mma_shrink_kernel(
                    *tiles, config.joint, accumulate, wide, stages=config.stages
                )
            rank_groups = -(-ranks // (8 * per_warp * warps))
            return ShrinkChoice(config, kernel, x, packed, rank_groups, True, False)
        if config.joint:  # the slices' ranks side by side (a launch takes up to MAX_SLICES)
            ranks = min(slices, MAX_SLICES) * rank
            kernel = build_joint_mma_shrink_kernel(
                inputs.dtype,
                output.dtype,
                config.threads,
                config.tile_m // 16,
                -(-min(ranks, config.tile_n) // 8),  # 8-rank tiles of one group of joint ranks
                accumulate,
                wide,
            )
            return ShrinkChoice(config, kernel, x, packed, -(-ranks // config.tile_n), True, False)
        # One block per group of tile_n ranks (0: every rank), along grid.y.
        rank_groups = -(-rank // config.tile_n) if config.tile_n else 1
        tiles = (
            inputs.dtype,
            output.dtype,
            config.threads,
            config.tile_m // 16,
            -(-min(rank, config.tile_n or rank) // 8),  # 8-rank tiles of one rank group
        )
        if config.splits > 1:  # K in runs too, a block each along grid.z
            build = (
                build_cluster_mma_shrink_kernel if config.cluster else build_split_mma_shrink_kernel
            )
            kernel = build(*tiles, config.splits, accumulate, wide, ahead=config.ahead)
        else:
            kernel = build_mma_shrink_kernel(*tiles, accumulate, wide, ahead=config.ahead)
        return ShrinkChoice(config, kernel, x, packed, rank_groups, True, False)
    groups = -(-rank // config.tile_n)
    if config.kernel == "split" and groups * config.splits > MAX_GRID_YZ:
        config = launch_configs("shrink")[0]  # (a rank no layer has: the plain row shrink)
        groups = -(-rank // config.tile_n)
    # Rank groups over grid.z (the kernel strides by gridDim.z), or looped in a block.
    rank_groups = min(groups, MAX_GRID_YZ) if config.spread else 1
    # Packed 8-byte words when x and every A allow it; else one element at a time.
    x_words, w_words = operands.words(inputs), operands.weight_words(weights)
    packed = x_words is not None and w_words is not None
    x = x_words if packed else inputs
    alone = one_slot("shrink", config, weights[0].num_loras, facts)
    kernel_weights = (
        w_words if packed else [elements for _, elements in operands.weight_forms(weights)]
    )
    if config.kernel == "split":  # a block per (tile, slice, rank group, chunk of K)
        kernel = build_split_shrink_kernel(
            inputs.dtype,
            output.dtype,
            config.threads,
            config.tile_m,
            config.tile_n,
            config.splits,
            packed,
            accumulate,
        )
        return ShrinkChoice(config, kernel, x, kernel_weights, groups * config.splits, False, False)
    if alone and token_rows(packed, x.shape[1], config.threads, rank):
        # A token and a rank a block, the row's words compiled in (kernels.shrink_token).
        config = dataclasses.replace(config, tile_n=1, spread=True)
        kernel = build_token_shrink_kernel(
            inputs.dtype, output.dtype, config.threads, x.shape[1], accumulate
        )
        return ShrinkChoice(config, kernel, x, kernel_weights, rank, False, alone)
    kernel = build_shrink_kernel(
        inputs.dtype,
        output.dtype,
        config.threads,
        config.tile_m,
        config.tile_n,
        packed,
        accumulate,
        # A block a group, without a run-time loop step (shrink's "One pass"),
        # where the grid has a block for every group and a thread holds few words.
        config.spread and rank_groups == groups and config.tile_n <= 4,
        alone,
        x_rows,
        row_scaled,
    )
    return ShrinkChoice(config, kernel, x, kernel_weights, rank_groups, False, alone)


def choose_expand(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output: torch.Tensor,
    facts,
    offset_start: int,
    after_own_shrink: bool = False,
    config: LaunchConfig | None = None,
) -> ExpandChoice:
    """The kernel of a checked expand (``facts`` as in :func:`choose_shrink`); ``config``,
    where given, is taken instead of the one :func:`..launch.choose_launch_config` would
    pick (unless the tensor cores cannot take the call: then the heuristic's FFMA pick).

    ``after_own_shrink``: the caller's promise that the launch just ahead of this one on
    the stream is this package's shrink (the wrapper's ``add_lora_linear``), which waits
    for the kernels before it and writes neither B nor the metadata; only then may an
    expand that asks ahead load B before its wait (:mod:`..kernels.expand_mma`, "B before
    the wait"). The bare op knows nothing of what runs ahead of it, so it never does: a
    caller's kernel that says ``launch_dependents`` early and then writes the weights
    would be read half-written."""
    num_tokens = inputs.shape[1]
    widths = [w.rows for w in weights]
    dtype, rank = weights[0].dtype, weights[0].cols
    columns = [offset_start + sum(widths[:s]) for s in range(len(widths))]  # c_s
    active = facts and facts.active_slots
    w_words = operands.weight_words(weights)  # B in packed 8-byte words when every slice allows
    packed = w_words is not None
    words = rank // packing(dtype, packed)  # of one row of B
    choose = functools.partial(
        choose_launch_config,
        "expand",
        num_tokens,
        active,
        rank,
        slices=len(widths),  # (a configuration may stop at a slice count: ``to_slices``)
        lane_split=splits(words),
        dtype=dtype,  # the tuned tables' key: the weights' dtype, K = rank, N = widest slice
        K=rank,
        N=max(widths),
    )
    config = config or choose(tensor_cores=True)
    mma = None
    if config.kernel == "mma":
        mma = operands.mma_expand_operands(inputs, weights, w_words, output, columns)
        if mma is None:  # the tensor cores cannot take this call
            config = choose()
        elif config.staged and not all(mma[4:6]):  # (wide_x, wide_b: the staged kernel's)
            config = choose(tensor_cores=True, staged_expand=False)
            mma = mma if config.kernel == "mma" else None
    alone = one_slot("expand", config, weights[0].num_loras, facts)
    per_block = config.columns_per_block("expand", words)
    if mma is not None:
        x, b_words, out, wide, wide_x, wide_b = mma
        if config.staged:  # a large tile, its operands in shared memory
            n_tiles = staged_expand_warps(config.threads, config.tile_m, config.tile_n)[3]
            kernel = build_staged_mma_expand_kernel(
                config.threads,
                config.tile_m,
                config.tile_n,
                rank // 16,
                wide and n_tiles % 4 == 0,  # 16-byte words of output: 4 tiles each
                dtype,
                stages=config.stages,
            )
        else:
            n_tiles = config.tile_n // (8 * config.threads // 32)  # 8-column tiles per warp
            single_pass = one_pass(config, max(widths), per_block)
            asking = asks_ahead(widths, single_pass, alone, num_tokens)
            kernel = build_mma_expand_kernel(
                inputs.dtype,
                config.threads,
                config.tile_m // 16,
                n_tiles,
                -(-rank // 16),
                rank % 16 == 0,
                wide and n_tiles % 4 == 0,  # 16-byte words of output: 4 tiles each
                all(width % (8 * n_tiles) == 0 for width in widths),  # whole column groups
                wide_x,  # the buffer in 16-byte loads
                wide_b,  # B in 16-byte loads
                single_pass,
                alone,
                asking,
                asking and after_own_shrink,  # B before the wait
                dtype,  # of B and the output: bf16, or fp16 (two f16 products a tile)
                *((config.chunk // 16,) if config.chunk else ()),  # rank steps held at once
            )
        # (the tensor-core kernels place slices by 4-column words)
        return ExpandChoice(
            config, kernel, x, b_words, out, [c // 4 for c in columns], per_block, alone
        )
    wide = packed and all(operands.rows_start_at(w.view, 16) for w in weights)
    kernel_weights = (
        w_words if packed else [elements for _, elements in operands.weight_forms(weights)]
    )
    kernel = _ffma_expand_kernel(
        config, inputs.dtype, dtype, output.dtype, packed, words, wide, alone
    )
    return ExpandChoice(config, kernel, inputs, kernel_weights, output, columns, per_block, alone)


def _ffma_expand_kernel(
    config: LaunchConfig,
    x_dtype,
    w_dtype,
    out_dtype,
    packed: bool,
    words: int,
    wide: bool,
    alone: bool = False,
):
    """The FFMA expand kernel ``config`` names, compiled (once) for these dtypes, B packed
    or not, ``words`` per row of B, (packed) whether B's rows start at multiples of 16
    bytes, and (lane-split) whether it loads B before the slot (:func:`one_slot`). The row
    kernel compiles a row's length in only up to :data:`~..kernels.COMPILED_WORDS` words
    (past it, reads it at run time)."""
    if config.kernel == "lanes":
        return build_lanes_expand_kernel(
            x_dtype,
            w_dtype,
            out_dtype,
            config.threads,
            config.tile_m,
            config.vec,
            packed,
            words,
            wide,
            alone,
        )
    if config.kernel == "tiled":
        return build_tiled_expand_kernel(
            x_dtype,
            w_dtype,
            out_dtype,
            config.threads,
            config.tile_m,
            config.tile_n,
            *config.micro,
            config.chunk,
            packed,
        )
    words = words if words <= COMPILED_WORDS else 0
    return build_expand_kernel(
        x_dtype, w_dtype, out_dtype, config.threads, config.tile_m, packed, config.vec, words
    )


def one_slot(op: str, config: LaunchConfig, num_loras: int, facts) -> bool:
    """Whether blocks of ``config`` take their tokens in their own order and load the
    weights before they know the tokens' slots: where the weight stacks hold one slot
    (``kernels.shrink``, "One slot"), for the row shrink and the lane-split expand with
    a token a block and for the tensor-core expand but the staged one
    (``kernels.expand_mma``, "One slot"), and only on ``LoRAKernelMeta``'s metadata
    (``facts``), whose ``token_lora_mapping`` the kernel then reads: it agrees with the
    segments by construction, and holds -1 past the prepared tokens."""
    if facts is None or num_loras != 1:
        return False
    if op == "expand" and config.kernel == "mma":
        return not config.staged  # (the staged expand's blocks take the table's tiles)
    kernel = {"shrink": "rows", "expand": "lanes"}[op]
    return config.kernel == kernel and config.tile_m == 1


def token_rows(packed: bool, words: int, threads: int, rank: int) -> bool:
    """Whether a one-slot row shrink can take the one-token kernel
    (:mod:`..kernels.shrink_token`): rows of packed words, at most
    :data:`~..kernels.shrink_token.MAX_WORDS_PER_THREAD` of them a thread, and a block
    for every rank."""
    return packed and -(-words // threads) <= MAX_WORDS_PER_THREAD and rank <= MAX_GRID_YZ


def column_blocks(config: LaunchConfig, width: int, per_block: int) -> int:
    """Blocks along a slice of ``width`` columns (the grid's z): each walks ``passes``
    groups of ``per_block`` columns, and as many more as the grid is short of."""
    groups = -(-width // (per_block * config.passes))
    return min(groups, MAX_GRID_YZ) if config.spread else 1


def one_pass(config: LaunchConfig, width: int, per_block: int) -> bool:
    """Whether no block walks a second column group of a slice of ``width`` columns: the
    grid has a block for every group."""
    return column_blocks(config, width, per_block) * per_block >= width


def asks_ahead(widths: list[int], single_pass: bool, alone: bool, num_tokens: int) -> bool:
    """Whether a tensor-core expand lets the next launch be placed at once and asks L2 for
    its tile before its wait (:mod:`..kernels.expand_mma`, "Asking ahead"): where it was
    measured to pay, a launch of one slice whose grid has a block for every column group
    and whose blocks find their tokens in the tile table, of at most
    :data:`ASK_AHEAD_TOKENS` tokens. With three slices (the QKV layer) and under one slot
    it was slower, and those keep the plain wait; so do launches of more tokens, not
    measured."""
    return len(widths) == 1 and single_pass and not alone and num_tokens <= ASK_AHEAD_TOKENS
