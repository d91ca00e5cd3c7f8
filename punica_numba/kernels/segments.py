"""Which tokens a block works on: from a block index to a tile of one segment.

A launch does not know, on the host, how many tokens each slot has (that lives
on the device, in ``LoRAKernelMeta``), and reading it back would cost a sync and
break CUDA-graph capture. So the grid is sized for the worst case and every block
finds its own work on the device:

* segment i (slot ``lora_ids[i]`` with ``counts[i]`` tokens) is cut into
  ``ceil(counts[i] / tile_m)`` tiles of up to ``tile_m`` tokens;
* the tiles of all segments, the ``-1`` segment left out, are numbered in order;
* block ``b`` takes tile number ``b``, or exits if there are fewer tiles.

Because ``sum_i ceil(c_i / tile_m) <= ceil(M / tile_m) + len(lora_ids)``, a grid of
:func:`tile_grid_bound` blocks always suffices.
"""

from __future__ import annotations

from .._cuda import cuda

__all__ = ["find_tile", "tile_grid_bound"]


def tile_grid_bound(num_tokens: int, num_segments: int, tile_m: int) -> int:
    """The number of blocks along the tile axis that covers any segmentation."""
    return -(-num_tokens // tile_m) + num_segments


@cuda.jit(device=True)
def find_tile(tile, lora_ids, counts, tile_m):
    """Return ``(segment, first)``: tile ``tile`` is tokens ``first .. first+tile_m`` of
    segment ``segment``, or ``(-1, 0)`` when there is no such tile."""
    tiles_before = 0
    for segment in range(lora_ids.shape[0]):  # segment in [0, L+1)
        if lora_ids[segment] == -1:
            continue  # no LoRA, or an unused entry: nothing to compute
        tiles_here = (counts[segment] + tile_m - 1) // tile_m
        if tile < tiles_before + tiles_here:
            return segment, (tile - tiles_before) * tile_m
        tiles_before += tiles_here
    return -1, 0
