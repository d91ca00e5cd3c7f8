"""MoE LoRA metadata: every (token, expert) pair sorted by adapter and expert into blocks.

A mixture-of-experts layer sends each token to ``top_k`` experts: M tokens make
``P = M * top_k`` *pairs*, pair ``p = t * top_k + k`` being token t on its k-th expert
``topk_ids[t, k]``. A LoRA on the experts gives every (adapter, expert) its own A and B,
so a kernel wants the pairs grouped by both: all pairs of slot l on expert e side by
side, cut into blocks of ``block_size`` pairs, one (slot, expert) per block, so that a
block loads one A and one B.

The layout is vLLM's (the one ``moe_lora_align_block_size`` hands to
``add_lora_fused_moe``), one row per slot::

    sorted_token_ids[l, :]   the pairs of slot l, expert by expert (ascending), each
                             expert's run padded with the value P to a multiple of
                             block_size; P past the last run
    expert_ids[l, b]         the expert of block b of row l (-1 past the last block)
    num_tokens_post_padded[l]  the padded pairs of row l (a multiple of block_size)

Within a run the pairs keep their order (ascending p). A pair is in no row when its
token has no LoRA (slot -1), its slot is off (``adapter_enabled``) or out of range, or
its expert is -1 or out of range; an expert no pair of a slot uses gets no block there.

Everything is computed on the pairs' device with fixed-size tensors and no read-back to
the host (:func:`align_pairs`), so the step can be captured in a CUDA graph: the sizes
depend only on P, the expert count, the block size and the slot count
(:func:`aligned_sizes`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_bool, check_int, check_tensor

__all__ = ["MoEBlocks", "align_pairs", "aligned_sizes", "check_adapter_enabled"]


class MoEBlocks(NamedTuple):
    """The pairs of one MoE layer call, by slot and expert (module docstring)."""

    sorted_token_ids: torch.Tensor  # [L, padded_len] int32
    expert_ids: torch.Tensor  # [L, num_blocks] int32
    num_tokens_post_padded: torch.Tensor  # [L] int32


def aligned_sizes(
    num_pairs: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False
) -> tuple[int, int]:
    """``(padded_len, num_blocks)``: the longest a row of :class:`MoEBlocks` can be (every
    pair on one slot, each run padded by up to ``block_size - 1``, and there are at most
    as many runs as experts, or as pairs), rounded up to a whole block with
    ``pad_sorted_ids``, and its blocks."""
    padded_len = num_pairs + min(num_pairs, num_experts) * (block_size - 1)
    if pad_sorted_ids:
        padded_len = -(-padded_len // block_size) * block_size
    return padded_len, -(-padded_len // block_size)


def align_pairs(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    adapter_enabled: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    pad_sorted_ids: bool = False,
) -> MoEBlocks:
    """Sort the (token, expert) pairs by slot and expert into blocks (module docstring).

    ``expert_map`` (expert parallelism: ``topk_ids`` holds global experts, and
    ``expert_map[e]`` is expert e's local id, -1 where it is not local; then
    ``num_experts`` counts the global ones) renames the experts of the blocks in use; a
    block past a row's last stays -1.

    Semantics:
        topk_ids: [M, top_k] integer; token_lora_mapping: [>= M] integer (slot, -1 none)
        adapter_enabled: [>= max_loras] (0 / False: slot off); expert_map: [E] integer
        pair p = t * top_k + k is in row l = slot(t) when l in [0, max_loras),
            adapter_enabled[l], and e = topk_ids[t, k] in [0, num_experts)
        returns MoEBlocks, int32, shapes from aligned_sizes(M * top_k, ...)
        No host sync, no allocation whose size depends on the values.

    Raises:
        TypeError / ValueError: a wrong dtype, shape, device or size (before any work).
    """
    num_experts = check_int("num_experts", num_experts, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1)
    max_loras = check_int("max_loras", max_loras, minimum=1)
    pad_sorted_ids = check_bool("pad_sorted_ids", pad_sorted_ids)
    _check_index_tensor("topk_ids", topk_ids, ndim=2)
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    _check_index_tensor("token_lora_mapping", token_lora_mapping, ndim=1, device=device)
    if token_lora_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"token_lora_mapping has {token_lora_mapping.shape[0]} entries, fewer than the "
            f"{num_tokens} tokens of topk_ids"
        )
    check_adapter_enabled(adapter_enabled, max_loras, device)
    if expert_map is not None:
        _check_index_tensor("expert_map", expert_map, ndim=1, device=device)
        if expert_map.shape[0] != num_experts:
            raise ValueError(
                f"expert_map must have one entry per expert ({num_experts}), got "
                f"{expert_map.shape[0]}"
            )

    L, E, B = max_loras, num_experts, block_size
    P = num_tokens * top_k
    padded_len, num_blocks = aligned_sizes(P, E, B, pad_sorted_ids)
    i64 = dict(dtype=torch.int64, device=device)

    slot = token_lora_mapping[:num_tokens].to(torch.int64).repeat_interleave(top_k)  # [P]
    expert = topk_ids.reshape(-1).to(torch.int64)  # [P]
    on = adapter_enabled[:L].to(torch.bool)[slot.clamp(0, L - 1)]  # [P]
    valid = on & (slot >= 0) & (slot < L) & (expert >= 0) & (expert < E)  # [P]
    # Each pair's (slot, expert) as one key; L * E stands for "in no row".
    key = torch.where(valid, slot * E + expert, L * E)  # [P]
    counts = torch.zeros(L * E + 1, **i64).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[: L * E].view(L, E) + B - 1) // B * B  # [L, E] each run, padded
    ends = padded.cumsum(1)  # [L, E] where each expert's run ends in its row
    starts = torch.cat([(ends - padded).reshape(-1), torch.zeros(1, **i64)])  # [L * E + 1]

    order = torch.argsort(key, stable=True)  # [P] pairs by key, ascending p within one
    sorted_key = key[order]  # [P]
    first = torch.cumsum(counts, 0) - counts  # [L * E + 1] where each key's pairs start
    within = torch.arange(P, **i64) - first[sorted_key]  # [P] place in its run
    # Pairs in no row go to a scratch row L, which is cut off below: no boolean indexing
    # (its size would depend on the values, and need a sync).
    rows = torch.full((L + 1, padded_len), P, dtype=torch.int32, device=device)
    rows[sorted_key // E, starts[sorted_key] + within] = order.to(torch.int32)

    block_start = torch.arange(num_blocks, **i64) * B  # [NB]
    block_expert = torch.searchsorted(
        ends, block_start.expand(L, num_blocks).contiguous(), right=True
    )
    in_use = block_start[None, :] < ends[:, -1:]  # [L, NB]
    if expert_map is not None:
        block_expert = expert_map.to(torch.int64)[block_expert.clamp(max=E - 1)]
    expert_ids = torch.where(in_use, block_expert, -1).to(torch.int32)  # [L, NB]
    return MoEBlocks(rows[:L], expert_ids, ends[:, -1].to(torch.int32))


_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check_index_tensor(name: str, t, *, ndim: int, device=None) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=_INDEX_DTYPES, on_kernel_device=False)
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, but topk_ids is on {device}")


def check_adapter_enabled(
    adapter_enabled, slots: int, device, *, dtypes=_INDEX_DTYPES, beside: str = "topk_ids"
) -> None:
    """``adapter_enabled``: a 1-D tensor of integer (of ``dtypes``) or bool flags, at
    least one per slot, on ``device`` (where ``beside`` is)."""
    check_tensor(
        "adapter_enabled", adapter_enabled, ndim=1, dtypes=(*dtypes, torch.bool),
        on_kernel_device=False,
    )  # fmt: skip
    if adapter_enabled.shape[0] < slots:
        raise ValueError(
            f"adapter_enabled must have an entry per slot ({slots}), got {adapter_enabled.shape[0]}"
        )
    if adapter_enabled.device != device:
        raise ValueError(
            f"adapter_enabled is on {adapter_enabled.device}, but {beside} is on {device}"
        )
