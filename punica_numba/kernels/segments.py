"""Which tokens a block works on: a table from block index to a tile of one segment.

A launch does not know, on the host, how many tokens each slot has (that lives on
the device, in ``LoRAKernelMeta``); reading it back would cost a sync and break
CUDA-graph capture. So the grid is sized for the worst case and each block looks
its work up in a *tile table*, made on the device by a few torch operations:

* segment i (slot ``lora_ids[i]`` with ``counts[i]`` tokens) is cut into
  ``ceil(counts[i] / tile_m)`` tiles of up to ``tile_m`` tokens;
* the tiles of all segments, the ``-1`` segment left out, are numbered in order;
* ``table[0, b]`` is the segment of tile ``b`` and ``table[1, b]`` the offset of its
  first token inside the segment; ``table[0, b] = -1`` when there is no tile ``b``.

Because ``sum_i ceil(c_i / tile_m) <= ceil(M / tile_m) + len(lora_ids)``, a grid of
:func:`tile_grid_bound` blocks always suffices. ``LoRAKernelMeta`` refreshes one
table per tile size the launch configurations use (``launch.tile_sizes()``) every
time it prepares a mapping, so a launch only reads it: one lookup per block instead
of a walk over all segments.
"""

from __future__ import annotations

import torch

__all__ = ["tile_grid_bound", "tile_table"]


def tile_grid_bound(num_tokens: int, num_segments: int, tile_m: int) -> int:
    """The number of blocks along the tile axis that covers any segmentation."""
    return -(-num_tokens // tile_m) + num_segments


def tile_table(
    lora_ids: torch.Tensor,
    counts: torch.Tensor,
    tile_m: int,
    num_blocks: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[2, num_blocks]`` int32 tile table for these segments (no host sync).

    Semantics:
        tiles[i] = ceil(counts[i] / tile_m) if lora_ids[i] != -1 else 0
        ends = cumsum(tiles)
        for b < num_blocks: i = the segment with ends[i-1] <= b < ends[i]
            table[:, b] = (i, (b - ends[i-1]) * tile_m), or (-1, 0) past the last tile
    """
    tiles = torch.where(lora_ids != -1, (counts.to(torch.int64) + tile_m - 1) // tile_m, 0)
    ends = torch.cumsum(tiles, 0)  # [L+1]
    block = torch.arange(num_blocks, device=counts.device)  # [B]
    segment = torch.searchsorted(ends, block, right=True)  # [B]
    real = segment < len(ends)
    segment = segment.clamp(max=len(ends) - 1)
    first = (block - (ends[segment] - tiles[segment])) * tile_m
    table = torch.stack([torch.where(real, segment, -1), torch.where(real, first, 0)])
    if out is None:
        return table.to(torch.int32)
    out.copy_(table)
    return out
