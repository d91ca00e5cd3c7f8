"""Which tokens a block works on: a table from block index to a tile of one segment.

A launch does not know, on the host, how many tokens each slot has (that lives on
the device, in ``LoRAKernelMeta``); reading it back would cost a sync and break
CUDA-graph capture. So the grid is sized for the worst case and each block looks
its work up in a *tile table*, made on the device by a few torch operations:

* segment i (slot ``lora_ids[i]`` with ``counts[i]`` tokens) is cut into
  ``ceil(counts[i] / tile_m)`` tiles of up to ``tile_m`` tokens;
* the tiles of all segments, the ``-1`` segment left out, are numbered in order;
* row ``b`` of the table describes tile ``b``: its slot, where its first token
  sits in the sorted order, how many tokens it has, and that first token's row.

Because ``sum_i ceil(c_i / tile_m) <= ceil(M / tile_m) + len(lora_ids)``, a grid of
:func:`tile_grid_bound` blocks always suffices. ``LoRAKernelMeta`` refreshes one
table per tile size the launch configurations use (``launch.tile_sizes()``) every
time it prepares a mapping, so a launch only reads it.

Why the table holds what it holds: a block's first steps are a chain of memory
reads, each waiting for the one before (at decode, with one token per block, the
chain *is* the kernel's time). Reading the segment number and then its slot, count
and start, then the sorted token, would be four trips to memory before the first
activation load; with the slot, position, row count and first token in the table
it is one (:func:`read_tile`), and a block of one token can load its
activation straight away (:func:`tile_token`).

One trip, that is, if the four fields arrive together. Read as four loads of a
``[4, B]`` table (v4 to v13), they did not: the compiler issued
the slot's load, waited for it to decide whether the block leaves, and only then
issued the other three, two trips in every kernel. So a tile is a row of the
``[B, 4]`` table, 16 bytes at a multiple of 16, read in one load.

A block of several tokens still had a second trip: its tokens, at ``position`` in the
sorted order. So ``LoRAKernelMeta`` also keeps each tile's tokens in a row of their
own (:func:`tile_tokens`) for the tile sizes of the tensor-core expand
(``launch.tile_token_sizes()``), which loads row ``b`` of the table and row ``b`` of
the tile tokens at once (v16; the other kernels read ``sorted_tokens``: in the
tensor-core shrink the same change measured 1-3 % slower at 256 tokens and 1-3 %
faster at 4096).
"""

from __future__ import annotations

import torch
from numba import int64

from .._cuda import cuda
from .dtypes import four_int32_loader

__all__ = [
    "TABLE_FIELDS",
    "clear_tile_table",
    "read_tile",
    "slice_of",
    "tile_and_slice",
    "tile_grid_bound",
    "tile_table",
    "tile_tokens",
    "tile_token",
    "token_of_block",
]

#: The table's columns: slot (-1: no tile), position of the tile's first token in the
#: sorted order, tokens in the tile, the first token's row.
TABLE_FIELDS = ("slot", "position", "rows", "first_token")


def tile_grid_bound(num_tokens: int, num_segments: int, tile_m: int) -> int:
    """The number of blocks along the tile axis that covers any segmentation."""
    return -(-num_tokens // tile_m) + num_segments


def tile_table(
    lora_ids: torch.Tensor,
    counts: torch.Tensor,
    starts: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tile_m: int,
    num_blocks: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[num_blocks, 4]`` int32 tile table for these segments (no host sync); a
    new table is contiguous, so each row starts at a multiple of 16 bytes, as
    :func:`read_tile` needs of ``out`` too.

    Semantics:
        tiles[i] = ceil(counts[i] / tile_m) if lora_ids[i] != -1 else 0
        ends = cumsum(tiles)
        for b < num_blocks: i = the segment with ends[i-1] <= b < ends[i],
            first = (b - ends[i-1]) * tile_m       (offset of the tile in its segment)
            position = starts[i] + first
            table[b] = (lora_ids[i], position, min(tile_m, counts[i] - first),
                        sorted_tokens[position])
        past the last tile: table[b] = (-1, 0, 0, 0)
    """
    tiles = torch.where(lora_ids != -1, (counts.to(torch.int64) + tile_m - 1) // tile_m, 0)
    ends = torch.cumsum(tiles, 0)  # [L+1]
    block = torch.arange(num_blocks, device=counts.device)  # [B]
    segment = torch.searchsorted(ends, block, right=True)  # [B]
    real = segment < len(ends)
    segment = segment.clamp(max=len(ends) - 1)
    first = (block - (ends[segment] - tiles[segment])) * tile_m
    position = torch.where(real, starts[segment] + first, 0)
    rows = torch.clamp(counts[segment] - first, max=tile_m)
    if len(sorted_tokens):
        token = sorted_tokens[position.clamp(0, len(sorted_tokens) - 1)]
    else:  # no rows, so no tile either
        token = torch.zeros_like(position)
    table = torch.stack(
        [
            torch.where(real, lora_ids[segment].to(torch.int64), -1),
            position,
            torch.where(real, rows, 0),
            torch.where(real, token.to(torch.int64), 0),
        ],
        dim=1,
    )
    if out is None:
        return table.to(torch.int32)
    out.copy_(table)
    return out


def tile_tokens(
    table: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tile_m: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[B, tile_m]`` int32 rows of each tile's tokens (no host sync): row ``b`` holds
    tile ``b``'s tokens as :func:`tile_token` reads them, so that a block can load
    them from its own index, at once, instead of after the table's ``position``.

    Semantics:
        for each tile b of ``table`` with (slot, position, rows, first) and j < tile_m:
            out[b, j] = sorted_tokens[position + min(j, rows - 1)]   (rows > 0)
            out[b, j] = 0                                             (no tile)
    """
    position, rows = table[:, 1:2].to(torch.int64), table[:, 2:3].to(torch.int64)
    j = torch.arange(tile_m, device=table.device)
    index = position + torch.minimum(j, (rows - 1).clamp(min=0))  # [B, tile_m]
    if len(sorted_tokens):
        tokens = sorted_tokens[index.clamp(0, len(sorted_tokens) - 1)]
    else:  # no rows, so no tile either
        tokens = torch.zeros_like(index)
    tokens = torch.where(rows > 0, tokens.to(torch.int64), 0)
    if out is None:
        return tokens.to(torch.int32)
    out.copy_(tokens)
    return out


def clear_tile_table(table: torch.Tensor) -> torch.Tensor:
    """Mark every block of ``table`` as having no tile, ``(-1, 0, 0, 0)``; in place."""
    table.zero_()
    table[:, 0].fill_(-1)
    return table


_load_four = four_int32_loader()


@cuda.jit(device=True)
def read_tile(tiles, block):
    """Tile ``block``'s ``(slot, position, rows, first_token)``: row ``block`` of the
    table, in one 16-byte load on the GPU (module notes). ``slot`` is -1 when there is
    no tile."""
    return _load_four(tiles[block])


@cuda.jit(device=True, inline="always")
def token_of_block(token_lora_mapping, block):
    """What :func:`read_tile` gives, for blocks of one token on weight stacks of one slot
    (``kernels.shrink``, "One slot"): block ``block`` takes that token, whose slot (-1:
    no LoRA) comes from the mapping; position 0 (unused), one row. No table."""
    return int64(token_lora_mapping[block]), int64(0), int64(1), int64(block)


@cuda.jit(device=True)
def tile_and_slice(block, slices):
    """``(tile, slice)`` of a block of a grid that puts the ``slices`` (1 to 3) blocks of
    one tile next to each other: ``block = tile * slices + slice``. Neighbouring blocks
    run at the same time, so the slices of a tile that read the same rows of x find them
    in L2 after the first. (Dividing by 1, 2 or 3 as a constant costs a multiply, not a
    division routine.)"""
    if slices == 1:
        return block, 0
    if slices == 2:
        return block >> 1, block & 1
    tile = block // 3
    return tile, block - 3 * tile


@cuda.jit(device=True, inline="always")
def joint_place(n, rank):
    """``(s, j)``: of a launch's slices' ranks side by side (``rank`` each), joint rank
    ``n`` (below ``3 * rank``) is rank ``j`` of slice ``s``."""
    if n < rank:
        return 0, n
    if n < 2 * rank:
        return 1, n - rank
    return 2, n - 2 * rank


@cuda.jit(device=True)
def tile_token(sorted_tokens, position, rows, first_token, j):
    """The row of token ``j`` of a tile (as int64). Past the tile's ``rows`` tokens it
    repeats the last one, so that every load a kernel makes with it stays in bounds
    (those rows are never stored). Token 0 comes from the table: no load."""
    if j == 0:
        return int64(first_token)
    return int64(sorted_tokens[position + min(j, rows - 1)])


@cuda.jit(device=True, inline="always")
def slice_of(s_local, w0, w1, w2, start0, start1, start2):
    """The weights and first output column (or word) of slice ``s_local`` (0, 1 or 2) of
    a launch: Numba kernels take no arrays of arrays, so each slice's weights arrive as
    an argument of their own."""
    if s_local == 0:
        w, start = w0, start0
    elif s_local == 1:
        w, start = w1, start1
    else:
        w, start = w2, start2
    return w, start
