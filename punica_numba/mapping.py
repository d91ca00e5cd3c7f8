"""From adapter ids to GPU slots: ``LoRAMapping`` and ``convert_mapping``.

A serving engine knows, for every token, which adapter (by its user-visible int id,
``>= 1``; ``0`` for none) the token's request asked for. The kernels know only GPU
*slots* ``0 .. L-1`` (``-1`` for none). ``lora_index_to_id[slot]`` says which
adapter sits in which slot. ``convert_mapping`` turns ids into slots, and derives
the index tensors the embedding, logits and long-context layers use (vLLM's
semantics, ../shared/SPEC.md §2.3), vectorised: no per-token Python loop.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ._checks import check_device, check_int

__all__ = ["LoRAMapping", "LongContextLoRAContext", "MappingIndices", "convert_mapping"]


@dataclass
class LoRAMapping:
    """Which adapter each token, and each sampled row, uses.

    Attributes:
        index_mapping: one adapter id per input token (``0`` = no LoRA).
        prompt_mapping: one adapter id per row that reaches the logits/sampler.
        is_prefill: stored for vLLM compatibility; the GPU path does not use it.
    """

    index_mapping: tuple[int, ...]
    prompt_mapping: tuple[int, ...]
    is_prefill: bool = False

    def __post_init__(self):
        self.index_mapping = tuple(int(i) for i in self.index_mapping)
        self.prompt_mapping = tuple(int(i) for i in self.prompt_mapping)


@dataclass
class LongContextLoRAContext:
    """The per-adapter offsets into a long-context RoPE cos/sin cache.

    Attributes:
        offsets_by_lora_id: adapter id -> offset; adapters not listed get 0.
    """

    offsets_by_lora_id: Mapping[int, int]


@dataclass
class MappingIndices:
    """What ``convert_mapping`` returns; every tensor is int64 on the requested device.

    Attributes:
        base_indices: ``[T]`` slot of each token, -1 for none.
        sampler_indices: ``[P]`` slot of each sampled row, -1 for none.
        sampler_indices_padded: ``[P]`` ``p + s'[p] * P`` where ``s'`` is
            ``sampler_indices`` with -1 replaced by ``max_loras - 1``.
        embeddings_indices: ``[2, T]`` with ``e`` = slot (0 for none): row 0 is
            ``e * extra_vocab_size``, row 1 is ``e * (vocab_size + extra_vocab_size)``.
        long_lora_indices: ``[T]`` RoPE-cache offset of each token, or None.
        indices_len: ``[T, P, P, T, T or None]``.
    """

    base_indices: torch.Tensor
    sampler_indices: torch.Tensor
    sampler_indices_padded: torch.Tensor
    embeddings_indices: torch.Tensor
    long_lora_indices: torch.Tensor | None
    indices_len: list[int | None]


def _ids_to_slots(ids: np.ndarray, lora_index_to_id: Sequence[int | None], what: str):
    """Vectorised ``lora_index_to_id.index(id)`` for ids > 0, -1 for ids <= 0."""
    slot_of_id: dict[int, int] = {}
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is not None and lora_id not in slot_of_id:  # the first slot wins
            slot_of_id[int(lora_id)] = slot
    known_ids = np.array(sorted(slot_of_id), dtype=np.int64)  # [k] ascending
    known_slots = np.array([slot_of_id[i] for i in known_ids.tolist()], dtype=np.int64)
    slots = np.full(ids.shape, -1, dtype=np.int64)
    wanted = ids > 0
    if wanted.any():
        asked = ids[wanted]
        if len(known_ids):
            where = np.minimum(np.searchsorted(known_ids, asked), len(known_ids) - 1)
            found = known_ids[where] == asked
        else:
            where = np.zeros_like(asked)
            found = np.zeros(asked.shape, dtype=bool)
        if not np.all(found):
            missing = sorted(set(asked[~found].tolist()))
            raise ValueError(
                f"{what} uses adapter id(s) {missing[:8]} that are not in lora_index_to_id "
                f"{list(lora_index_to_id)}; load the adapter into a slot first"
            )
        slots[wanted] = known_slots[where]
    return slots


def convert_mapping(
    mapping: LoRAMapping,
    lora_index_to_id: Sequence[int | None],
    max_loras: int,
    vocab_size: int,
    extra_vocab_size: int,
    device: torch.device | str = "cpu",
    long_lora_context: LongContextLoRAContext | None = None,
) -> MappingIndices:
    """Turn adapter ids into slots and the index tensors the LoRA layers use.

    Semantics:
        slot(id) = lora_index_to_id.index(id) if id > 0 else -1   (unknown id: ValueError)
        base_indices[t]       = slot(index_mapping[t])                         [T]
        sampler_indices[p]    = slot(prompt_mapping[p])                        [P]
        sampler_indices_padded[p] = p + s'[p] * P,  s' = sampler_indices, -1 -> max_loras - 1
        embeddings_indices    = [e * extra_vocab_size, e * (vocab_size + extra_vocab_size)],
                                e = base_indices with -1 -> 0                  [2, T]
        long_lora_indices[t]  = offsets_by_lora_id.get(index_mapping[t], 0), or None

    ``max_loras`` here is the one vLLM's model manager passes (the number of slots
    plus one), so no-LoRA sampled rows point at the extra "padding" block.
    """
    if not isinstance(mapping, LoRAMapping):
        raise TypeError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
    max_loras = check_int("max_loras", max_loras, minimum=1)
    vocab_size = check_int("vocab_size", vocab_size, minimum=0)
    extra_vocab_size = check_int("extra_vocab_size", extra_vocab_size, minimum=0)
    device = check_device("device", device, kernels=False)
    if long_lora_context is not None and not hasattr(long_lora_context, "offsets_by_lora_id"):
        raise TypeError(
            "long_lora_context must have an offsets_by_lora_id mapping (a "
            f"LongContextLoRAContext), got {type(long_lora_context).__name__}"
        )
    if isinstance(lora_index_to_id, (str, bytes)) or not isinstance(lora_index_to_id, Sequence):
        raise TypeError(
            f"lora_index_to_id must be a list of adapter ids or None, got "
            f"{type(lora_index_to_id).__name__}"
        )
    for slot, lora_id in enumerate(lora_index_to_id):
        if lora_id is not None and (
            isinstance(lora_id, bool) or not isinstance(lora_id, numbers.Integral)
        ):
            raise TypeError(
                f"lora_index_to_id[{slot}] must be an int adapter id or None, got "
                f"{type(lora_id).__name__}"
            )
    token_ids = np.asarray(mapping.index_mapping, dtype=np.int64).reshape(-1)  # [T]
    prompt_ids = np.asarray(mapping.prompt_mapping, dtype=np.int64).reshape(-1)  # [P]
    base = _ids_to_slots(token_ids, lora_index_to_id, "index_mapping")  # [T]
    sampler = _ids_to_slots(prompt_ids, lora_index_to_id, "prompt_mapping")  # [P]

    num_prompts = len(sampler)
    sampler_padded_slots = np.where(sampler == -1, max_loras - 1, sampler)
    sampler_padded = np.arange(num_prompts, dtype=np.int64) + sampler_padded_slots * num_prompts

    embedding_slots = np.where(base == -1, 0, base)  # [T]; no LoRA reads slot 0's rows
    embeddings = np.stack(
        [embedding_slots * extra_vocab_size, embedding_slots * (vocab_size + extra_vocab_size)]
    )  # [2, T]

    long_lora = None
    if long_lora_context is not None:
        offsets = long_lora_context.offsets_by_lora_id
        distinct, position = np.unique(token_ids, return_inverse=True)
        offset_of_distinct = np.array(
            [offsets.get(i, 0) for i in distinct.tolist()], dtype=np.int64
        )
        long_lora = offset_of_distinct[position.reshape(-1)]  # [T]

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    num_tokens = len(base)
    return MappingIndices(
        base_indices=to_device(base),
        sampler_indices=to_device(sampler),
        sampler_indices_padded=to_device(sampler_padded),
        embeddings_indices=to_device(embeddings).reshape(2, num_tokens),
        long_lora_indices=None if long_lora is None else to_device(long_lora),
        indices_len=[
            num_tokens,
            num_prompts,
            num_prompts,
            num_tokens,
            None if long_lora is None else num_tokens,
        ],
    )
