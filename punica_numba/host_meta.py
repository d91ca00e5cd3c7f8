"""Sort and segment on the host, in NumPy: what ``prepare_tensors`` makes, from host slots.

:meth:`LoRAKernelMeta.prepare_tensors <punica_numba.meta.LoRAKernelMeta.prepare_tensors>`
computes the metadata with torch operations on the buffers' device, so that a mapping
already on the GPU never comes back to the host. A serving loop, though, holds its
slots on the host (the ``LoRAMapping``'s lists), and there the same computation is
better done by NumPy: on a few thousand tokens each NumPy call costs about a
microsecond of the host's time, where each torch operation on a CPU tensor costs
several, and a prepare with adapters in use is some two hundred of them. On the H200's
host, ``update_metadata`` of the demo's prefill (2015 tokens, 64 adapters) took 3.77 ms
with torch on the host at e02564e (1.15 ms without adapters), and 1.43 ms with this
module at 417e05f (0.94 ms without; docs/demo.md).

:func:`prepare_on_host` writes a host ``LoRAKernelMeta`` (a GPU meta's page-locked
twin, or on the simulator the meta itself) through NumPy views of its buffers. What it
writes is what ``prepare_tensors`` writes, buffer for buffer and fact for fact; the
tests hold the two to that on random mappings.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_slots", "prepare_on_host"]


def host_slots(slots, max_loras: int, max_num_tokens: int) -> tuple[np.ndarray, int, int]:
    """Checked slots as a 1-D int64 array, with their lowest and highest (-1, -1 if none).

    ``slots``: a CPU tensor, a NumPy array or a sequence of ints.

    Raises:
        ValueError: a tensor not on the CPU; slots that are not 1-D integers; more
            than ``max_num_tokens`` of them; a slot outside ``[-1, max_loras)``.
    """
    if isinstance(slots, torch.Tensor):
        if slots.device.type != "cpu":
            raise ValueError(
                f"prepare_slots takes slots the host holds, got a tensor on {slots.device}; "
                "use prepare_tensors for a mapping on the device"
            )
        array = slots.numpy()
    else:
        array = np.asarray(slots)
        if array.size == 0:
            array = array.astype(np.int64)  # ([] is float64 to NumPy)
    if array.ndim != 1 or array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"slots must be a 1-D sequence of integers, got {array.dtype} of shape "
            f"{tuple(array.shape)}"
        )
    n = array.size
    if n > max_num_tokens:
        raise ValueError(
            f"token_lora_mapping holds {n} tokens but this metadata was made for at most "
            f"max_num_tokens={max_num_tokens}"
        )
    if n == 0:
        return np.zeros(0, dtype=np.int64), -1, -1
    lowest, highest = int(array.min()), int(array.max())
    if lowest < -1 or highest >= max_loras:
        raise ValueError(
            f"token_lora_mapping holds slots from {lowest} to {highest}; slots must lie in "
            f"[-1, max_loras={max_loras})"
        )
    return array.astype(np.int64, copy=False), lowest, highest


def prepare_on_host(meta, mapping: np.ndarray, lowest: int, highest: int) -> None:
    """Write ``meta`` (its buffers on the CPU) for ``mapping``, checked by :func:`host_slots`.

    Semantics: those of ``prepare_tensors`` (module ``meta``), buffer for buffer:
        token_lora_mapping[:n] = mapping, rest -1; sorted[:n] = stable argsort, rest identity
        the present slots ascending (-1 first), their counts and starts; the rest -1/0
        every tile table and tile-token row (``kernels.segments``); the host's facts
    With no token on a LoRA the segments stay empty (as ``prepare_tensors`` leaves them).
    """
    n, L = len(mapping), meta.max_loras
    slots = meta.token_lora_mapping.numpy()
    order = meta.token_indices_sorted_by_lora_ids.numpy()
    ids, counts, starts = (
        t.numpy()
        for t in (meta.active_lora_ids, meta.num_tokens_per_lora, meta.lora_token_start_loc)
    )
    slots.fill(-1)
    slots[:n] = mapping
    order[:] = meta._positions.numpy()
    ids.fill(-1)
    counts.fill(0)
    starts.fill(0)
    for table in meta.host.tile_tables.values():
        rows = table.numpy()
        rows.fill(0)
        rows[:, 0] = -1
    for tokens in meta.host.tile_tokens.values():
        tokens.numpy().fill(0)

    per_slot = np.bincount(mapping + 1, minlength=L + 1)  # [L+1]: slots -1 .. L-1
    present = np.flatnonzero(per_slot)  # ascending, so slot -1 (entry 0) first
    used_slots = len(present) - int(n > 0 and lowest == -1)
    facts = meta.host
    facts.num_tokens, facts.max_slot_in_use = n, highest
    facts.active_slots = used_slots
    facts.segments = len(present)
    meta.num_active_loras_cpu.fill_(facts.segments)
    meta.no_lora_flag_cpu.fill_(highest == -1)
    if highest == -1:  # no token has a LoRA: every segment stays empty
        return

    order[:n] = np.argsort(mapping, kind="stable")
    k = len(present)
    ids[:k] = present - 1
    counts[:k] = per_slot[present]
    starts[1 : k + 1] = np.cumsum(counts[:k])
    for tile_m, table in meta.host.tile_tables.items():
        position, rows = _fill_tile_table(
            table.numpy(), ids[:k], counts[:k], starts[:k], order, tile_m
        )
        tokens = meta.host.tile_tokens.get(tile_m)
        if tokens is not None:
            _fill_tile_tokens(tokens.numpy(), position, rows, order)


def _fill_tile_table(table, ids, counts, starts, order, tile_m: int):
    """Rows ``0 .. tiles-1`` of a cleared ``[B, 4]`` tile table (``kernels.segments.tile_table``):
    segment i cut into ``ceil(counts[i] / tile_m)`` tiles, the -1 segment into none.
    Returns each tile's position and row count."""
    tiles = np.where(ids != -1, -(-counts // tile_m), 0)
    ends = np.cumsum(tiles)
    block = np.arange(ends[-1])
    segment = np.searchsorted(ends, block, side="right")
    first = (block - (ends[segment] - tiles[segment])) * tile_m  # the tile's offset in its segment
    position = starts[segment] + first
    rows = np.minimum(counts[segment] - first, tile_m)
    table[: len(block)] = np.stack([ids[segment], position, rows, order[position]], axis=1)
    return position, rows


def _fill_tile_tokens(out, position, rows, order) -> None:
    """Rows ``0 .. tiles-1`` of the ``[B, tile_m]`` tile tokens (``kernels.segments.tile_tokens``):
    tile b's tokens, its last repeated past its ``rows``."""
    j = np.arange(out.shape[1])
    out[: len(position)] = order[position[:, None] + np.minimum(j, rows[:, None] - 1)]
