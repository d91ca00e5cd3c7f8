"""``PunicaWrapperNumba`` driven the way vLLM drives ``PunicaWrapperGPU``, against the reference.

Every test builds its step the way vLLM's model runner does: a ``lora_index_to_id``
list of L slots (distinct positive adapter ids, some slots empty), requests that
each ask for an adapter id (0 for none), and a ``LoRAMapping`` with one id per
token and one per sampled row. ``update_metadata`` gets ``L + 1``, as vLLM's model
manager passes it. The slots the reference uses come from the wrapper's own
views, and each view is first checked against an id -> slot computation written
here, so the reference never just echoes the wrapper.

Sections:

1. properties of every method (dims drawn first, then the assignment mode, then
   values), plus the same checks on named corner-case mappings;
2. regressions, one per vLLM defect of SPEC §7 that touches the wrapper;
3. bad input: a clear error that names the argument, and nothing changed;
4. CUDA-graph capture and replay (real GPU only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from punica_numba import reference
from punica_numba import wrapper as wrapper_module
from punica_numba.mapping import LongContextLoRAContext, LoRAMapping
from punica_numba.wrapper import PunicaWrapperNumba

from .strategies import (
    DEVICE,
    DTYPES,
    KERNEL_LIMITS,
    MODES,
    assign_slots,
    in_shards,
    random_tensor,
)
from .tolerance import assert_close

LIM = KERNEL_LIMITS
VOCAB, EXTRA_VOCAB = 32000, 256  # what the linear-layer tests pass to update_metadata
LAYERS = ("qkv", "gate_up", "single")  # 3 GQA slices, 2 equal slices, row/column parallel
BIAS_MODES = ("none", "every slice", "some slices")


# -- one engine step, as vLLM's model runner describes it ---------------------------------


@dataclass
class Batch:
    """The adapters in the GPU slots and the requests of one step."""

    lora_index_to_id: list[int | None]  # [L] adapter id in each slot, None = empty slot
    request_ids: list[int]  # adapter id of each request, 0 = no LoRA
    request_lengths: list[int]  # tokens each request schedules this step
    prompts_per_token: bool  # V0 prompt logprobs: one sampled row per token, else per request

    @property
    def index_mapping(self) -> list[int]:
        return [i for i, n in zip(self.request_ids, self.request_lengths) for _ in range(n)]

    @property
    def prompt_mapping(self) -> list[int]:
        return self.index_mapping if self.prompts_per_token else list(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.request_lengths)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_mapping)

    def mapping(self) -> LoRAMapping:
        return LoRAMapping(
            index_mapping=tuple(self.index_mapping),
            prompt_mapping=tuple(self.prompt_mapping),
            is_prefill=True,
        )


def make_batch(
    request_slots: list[int],
    request_lengths: list[int],
    num_loras: int,
    prompts_per_token: bool,
    seed: int,
) -> Batch:
    """Give the slots distinct random adapter ids, leave some unused slots empty, and
    turn each request's slot into the adapter id the engine would send."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(1, 1000), size=num_loras, replace=False)  # distinct, >= 1
    used = {s for s in request_slots if s >= 0}
    lora_index_to_id = [
        int(ids[s]) if s in used or rng.random() < 0.5 else None for s in range(num_loras)
    ]
    request_ids = [lora_index_to_id[s] if s >= 0 else 0 for s in request_slots]
    return Batch(lora_index_to_id, request_ids, list(request_lengths), prompts_per_token)


def batch_of_token_slots(token_slots: list[int], num_loras: int, seed: int = 0) -> Batch:
    """One single-token request per slot in ``token_slots`` (a decode step)."""
    return make_batch(token_slots, [1] * len(token_slots), num_loras, False, seed)


@st.composite
def batches(draw, num_tokens: int, num_loras: int) -> Batch:
    """For dims already drawn: the request split and mode, then values from a seed."""
    num_requests = draw(st.integers(1, num_tokens), label="requests")
    mode = draw(st.sampled_from(MODES), label="mode")
    prompts_per_token = draw(st.booleans(), label="one sampled row per token")
    seed = draw(st.integers(0, 2**32 - 1), label="mapping seed")
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(1, num_tokens), num_requests - 1, replace=False).tolist())
    lengths = np.diff([0, *cuts, num_tokens]).tolist()  # [R], each >= 1
    request_slots = assign_slots(mode, num_requests, num_loras, seed)
    return make_batch(request_slots, lengths, num_loras, prompts_per_token, seed)


# -- the id -> slot computation of this file, and the wrapper's views checked against it --


def slots_of(ids: list[int], lora_index_to_id: list[int | None]) -> list[int]:
    """vLLM's rule: the slot that holds the id, -1 for an id <= 0."""
    slot_of = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id) if lora_id}
    return [slot_of[i] if i > 0 else -1 for i in ids]


def check_indices(wrapper: PunicaWrapperNumba, batch: Batch, vocab: int, extra: int) -> None:
    """Every index view of the wrapper equals what this file computes from the ids."""
    token_slots = slots_of(batch.index_mapping, batch.lora_index_to_id)  # [T]
    prompt_slots = slots_of(batch.prompt_mapping, batch.lora_index_to_id)  # [P]
    P, no_lora_block = len(prompt_slots), wrapper.max_loras  # update_metadata got L + 1
    embedding_slots = [max(s, 0) for s in token_slots]
    views = {
        "token_lora_indices": (wrapper.token_lora_indices, token_slots),
        "sampler_indices": (wrapper.sampler_indices, prompt_slots),
        "sampler_indices_padded": (
            wrapper.sampler_indices_padded,
            [p + (s if s >= 0 else no_lora_block) * P for p, s in enumerate(prompt_slots)],
        ),
        "embeddings_indices": (
            wrapper.embeddings_indices,
            [[e * extra for e in embedding_slots], [e * (vocab + extra) for e in embedding_slots]],
        ),
        "long_lora_indices": (wrapper.long_lora_indices, [0] * len(token_slots)),
    }
    for name, (got, want) in views.items():
        assert got.dtype == torch.int64, f"{name} is {got.dtype}"
        assert got.tolist() == want, f"{name}: got {got.tolist()}, want {want}"


def update(wrapper: PunicaWrapperNumba, batch: Batch, vocab=VOCAB, extra=EXTRA_VOCAB) -> None:
    wrapper.update_metadata(
        batch.mapping(), batch.lora_index_to_id, wrapper.max_loras + 1, vocab, extra
    )
    check_indices(wrapper, batch, vocab, extra)


def prepared_wrapper(
    batch: Batch, num_loras: int, capacity: int, vocab=VOCAB, extra=EXTRA_VOCAB
) -> PunicaWrapperNumba:
    wrapper = PunicaWrapperNumba(
        capacity, max(1, len(batch.request_ids)), DEVICE, max_loras=num_loras
    )
    update(wrapper, batch, vocab, extra)
    return wrapper


def padded(slots: torch.Tensor, rows: int) -> torch.Tensor:
    """The slots of ``rows`` activation rows: rows past the mapping (graph padding) are -1."""
    pad = torch.full((rows - slots.shape[0],), -1, dtype=torch.int64, device=slots.device)
    return torch.cat([slots, pad])


# -- shared helpers ---------------------------------------------------------------------


def stacked(shape, dtype, seed) -> torch.Tensor:
    """A weight stacked over slots as vLLM stores it: ``[L, 1, N, K]``."""
    L, *rest = shape
    return random_tensor((L, 1, *rest), dtype, seed)


def make_bias(mode: str, widths, num_loras: int, dtype, seed: int):
    """vLLM's ``lora_bias_stacked``: one ``[L, 1, N_s]`` per slice, or None entries."""
    if mode == "none":
        return None
    return tuple(
        None if mode == "some slices" and s % 2 == 1 else stacked((num_loras, n), dtype, seed + s)
        for s, n in enumerate(widths)
    )


def absolute(tensors):
    """The same tuple with every tensor replaced by its absolute value (for magnitudes)."""
    if tensors is None:
        return None
    return tuple(None if t is None else t.abs() for t in tensors)


def with_bias(y, bias, widths, slots, offset_start=0):
    if bias is None:
        return y.to(torch.float64)
    return reference.add_bias(y, bias, widths, slots, offset_start)


def assert_rows_untouched(got, before, slots, what: str) -> None:
    """Rows without a LoRA (including graph padding) keep their bits."""
    keep = slots == -1
    assert torch.equal(got[keep], before[keep]), f"{what}: rows without a LoRA changed"


def qkv_widths(head_dim: int, kv_heads: int, group: int) -> list[int]:
    """GQA: q has ``group`` times as many heads as k and v."""
    return [kv_heads * group * head_dim, kv_heads * head_dim, kv_heads * head_dim]


@st.composite
def layer_widths(draw, layer: str) -> list[int]:
    if layer == "qkv":
        head_dim = draw(st.integers(1, max(1, LIM.width // 6)), label="head_dim")
        kv_heads = draw(st.integers(1, 2), label="kv heads")
        group = draw(st.integers(2, 3), label="q heads per kv head")
        return qkv_widths(head_dim, kv_heads, group)
    if layer == "gate_up":
        n = draw(st.integers(1, LIM.width), label="intermediate size")
        return [n, n]
    return [draw(st.integers(1, LIM.width), label="N")]


# -- 1. properties: add_lora_linear -----------------------------------------------------


def _poisoned_buffer(*shape: int, device, one_slot: bool) -> torch.Tensor:
    """The wrapper's own buffer (a call that gives none) filled with NaN, in place of
    whatever memory held: any element read before the shrink wrote it shows in y. (Also
    where the wrapper fills it with zeros, ``one_slot``: the kernels read rows there that
    the shrink did not write, and must not use them.)"""
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)


def poisoned_own_buffers():
    return mock.patch.object(wrapper_module, "_new_buffer", _poisoned_buffer)


@dataclass
class LinearCase:
    batch: Batch
    num_loras: int
    padding: int  # activation rows past the mapped tokens (CUDA-graph padding)
    spare: int  # max_num_batched_tokens beyond the rows
    hidden: int
    rank: int
    widths: list[int]
    bias: str
    dtype: torch.dtype
    scale: float
    buffer: str  # "none" (the wrapper allocates), "zeros" or "given" (random values)
    three_d: bool  # [1, T, H] activations, as some layers hold them
    seed: int


@st.composite
def linear_cases(draw) -> LinearCase:
    num_tokens = draw(st.integers(1, LIM.tokens), label="T")
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    padding = draw(st.integers(0, 2), label="padded rows")
    spare = draw(st.integers(0, 2), label="spare capacity")
    hidden = draw(st.integers(1, LIM.hidden), label="H")
    rank = draw(st.integers(1, LIM.rank), label="r")
    layer = draw(st.sampled_from(LAYERS), label="layer")
    widths = draw(layer_widths(layer))
    return LinearCase(
        batch=draw(batches(num_tokens, num_loras)),
        num_loras=num_loras,
        padding=padding,
        spare=spare,
        hidden=hidden,
        rank=rank,
        widths=widths,
        bias=draw(st.sampled_from(BIAS_MODES), label="bias"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        scale=draw(st.sampled_from((1.0, 0.5, -2.0)), label="scale"),
        buffer=draw(st.sampled_from(("none", "zeros", "given")), label="buffer"),
        three_d=draw(st.booleans(), label="3-D activations"),
        seed=draw(st.integers(0, 2**31 - 1), label="data seed"),
    )


def check_linear(case: LinearCase) -> None:
    L, H, r, dt, seed = case.num_loras, case.hidden, case.rank, case.dtype, case.seed
    rows, widths, S = case.batch.num_tokens + case.padding, case.widths, len(case.widths)
    wrapper = prepared_wrapper(case.batch, L, rows + case.spare)
    slots = padded(wrapper.token_lora_indices, rows)  # [rows]
    x = random_tensor((rows, H), dt, seed)  # [T, H]
    lora_a = tuple(stacked((L, r, H), dt, seed + 1 + s) for s in range(S))  # [L, 1, r, H]
    lora_b = tuple(stacked((L, n, r), dt, seed + 4 + s) for s, n in enumerate(widths))
    bias = make_bias(case.bias, widths, L, dt, seed + 7)  # [L, 1, N_s] or None
    y = random_tensor((rows, sum(widths)), dt, seed + 10)  # [T, sum N_s]
    buffer = {
        "none": None,
        "zeros": torch.zeros(S, rows, r, dtype=torch.float32, device=DEVICE),
        "given": random_tensor((S, rows, r), torch.float32, seed + 11),
    }[case.buffer]  # [S, T, r] fp32
    x_before, y_before = x.clone(), y.clone()
    buffer_before = None if buffer is None else buffer.clone()

    x_arg, y_arg = (x.view(1, rows, H), y.view(1, rows, -1)) if case.three_d else (x, y)
    with poisoned_own_buffers():
        wrapper.add_lora_linear(
            y_arg, x_arg, lora_a, lora_b, bias, case.scale, widths, buffer=buffer
        )

    assert torch.equal(x, x_before), "x changed"
    assert_rows_untouched(y, y_before, slots, "add_lora_linear")
    if buffer is None:
        want = reference.add_lora_linear(
            y_before, x, lora_a, lora_b, bias, case.scale, widths, slots
        )
        magnitude = reference.add_lora_linear(
            y_before.abs(),
            x.abs(),
            absolute(lora_a),
            absolute(lora_b),
            absolute(bias),
            abs(case.scale),
            widths,
            slots,
        )
    else:  # a caller's buffer is added to: y += bias + (buffer + scale * x A^T) B^T
        want_buffer = reference.lora_shrink(x, lora_a, buffer_before, slots, case.scale)
        magnitude_buffer = reference.lora_shrink(
            x.abs(), absolute(lora_a), buffer_before.abs(), slots, abs(case.scale)
        )
        assert_rows_untouched(buffer.transpose(0, 1), buffer_before.transpose(0, 1), slots, "buf")
        assert_close(buffer, want_buffer, magnitude_buffer, terms=H, what="add_lora_linear buffer")
        want = reference.lora_expand(
            want_buffer, lora_b, with_bias(y_before, bias, widths, slots), slots, 0, True
        )
        magnitude = reference.lora_expand(
            magnitude_buffer,
            absolute(lora_b),
            with_bias(y_before.abs(), absolute(bias), widths, slots),
            slots,
            0,
            True,
        )
    assert_close(y, want, magnitude, terms=H + r, what=f"add_lora_linear {dt}")


@in_shards()
@given(linear_cases())
def test_add_lora_linear_matches_reference(shard, case):
    check_linear(case)


# -- 1. properties: add_shrink and add_expand -------------------------------------------


@dataclass
class ShrinkCase:
    batch: Batch
    num_loras: int
    padding: int
    hidden: int
    rank: int
    num_slices: int
    dtype: torch.dtype
    scale: float
    add_inputs: bool
    seed: int


@st.composite
def shrink_cases(draw) -> ShrinkCase:
    num_tokens = draw(st.integers(1, LIM.tokens), label="T")
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    return ShrinkCase(
        padding=draw(st.integers(0, 2), label="padded rows"),
        hidden=draw(st.integers(1, LIM.hidden), label="H"),
        rank=draw(st.integers(1, LIM.rank), label="r"),
        num_slices=draw(st.integers(1, 3), label="S"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        scale=draw(st.sampled_from((1.0, 0.5, -2.0)), label="scale"),
        add_inputs=draw(st.booleans(), label="add_inputs"),
        batch=draw(batches(num_tokens, num_loras)),
        num_loras=num_loras,
        seed=draw(st.integers(0, 2**31 - 1), label="data seed"),
    )


def check_shrink(case: ShrinkCase) -> None:
    L, H, r, S, dt, seed = (
        case.num_loras,
        case.hidden,
        case.rank,
        case.num_slices,
        case.dtype,
        case.seed,
    )
    rows = case.batch.num_tokens + case.padding
    wrapper = prepared_wrapper(case.batch, L, rows)
    slots = padded(wrapper.token_lora_indices, rows)
    x = random_tensor((rows, H), dt, seed)  # [T, H]
    lora_a = tuple(stacked((L, r, H), dt, seed + 1 + s) for s in range(S))
    y = random_tensor((S, rows, r), torch.float32, seed + 9)  # [S, T, r] fp32, as vLLM's buffer
    before = y.clone()

    wrapper.add_shrink(y, x, lora_a, case.scale, add_inputs=case.add_inputs)

    # Storing: as adding to zeros in the rows of tokens with a LoRA.
    base = before if case.add_inputs else before * (slots == -1)[None, :, None]
    want = reference.lora_shrink(x, lora_a, base, slots, case.scale)
    magnitude = reference.lora_shrink(x.abs(), absolute(lora_a), base.abs(), slots, abs(case.scale))
    assert_rows_untouched(y.transpose(0, 1), before.transpose(0, 1), slots, "add_shrink")
    assert_close(y, want, magnitude, terms=H, what=f"add_shrink {dt}")


@in_shards()
@given(shrink_cases())
def test_add_shrink_matches_reference(shard, case):
    check_shrink(case)


@dataclass
class ExpandCase:
    batch: Batch
    num_loras: int
    padding: int
    rank: int
    widths: list[int]
    bias: str
    offset_start: int
    extra_columns: int
    add_inputs: bool
    dtype: torch.dtype  # weights and y
    x_dtype: torch.dtype  # the fp32 buffer, or the weights' dtype
    seed: int


@st.composite
def expand_cases(draw) -> ExpandCase:
    num_tokens = draw(st.integers(1, LIM.tokens), label="T")
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    padding = draw(st.integers(0, 2), label="padded rows")
    rank = draw(st.integers(1, LIM.rank), label="r")
    widths = draw(layer_widths(draw(st.sampled_from(LAYERS), label="layer")))
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    return ExpandCase(
        num_loras=num_loras,
        padding=padding,
        rank=rank,
        widths=widths,
        bias=draw(st.sampled_from(BIAS_MODES), label="bias"),
        offset_start=draw(st.integers(0, 4), label="offset_start"),
        extra_columns=draw(st.integers(0, 2), label="columns past the slices"),
        add_inputs=draw(st.booleans(), label="add_inputs"),
        dtype=dtype,
        x_dtype=draw(st.sampled_from((torch.float32, dtype)), label="x dtype"),
        batch=draw(batches(num_tokens, num_loras)),
        seed=draw(st.integers(0, 2**31 - 1), label="data seed"),
    )


def check_expand(case: ExpandCase) -> None:
    L, r, dt, seed, widths = case.num_loras, case.rank, case.dtype, case.seed, case.widths
    rows, S, first = case.batch.num_tokens + case.padding, len(widths), case.offset_start
    last = first + sum(widths)
    wrapper = prepared_wrapper(case.batch, L, rows)
    slots = padded(wrapper.token_lora_indices, rows)
    x = random_tensor((S, rows, r), case.x_dtype, seed)  # [S, T, r]
    lora_b = tuple(stacked((L, n, r), dt, seed + 1 + s) for s, n in enumerate(widths))
    bias = make_bias(case.bias, widths, L, dt, seed + 4)
    y = random_tensor((rows, last + case.extra_columns), dt, seed + 8)  # [T, W]
    before = y.clone()

    wrapper.add_expand(y, x, lora_b, bias, widths, first, case.add_inputs)

    want = with_bias(
        reference.lora_expand(x, lora_b, before, slots, first, case.add_inputs),
        bias,
        widths,
        slots,
        first,
    )
    magnitude = with_bias(
        reference.lora_expand(
            x.abs(), absolute(lora_b), before.abs(), slots, first, case.add_inputs
        ),
        absolute(bias),
        widths,
        slots,
        first,
    )
    assert_rows_untouched(y, before, slots, "add_expand")
    assert torch.equal(y[:, :first], before[:, :first]), "columns before offset_start changed"
    assert torch.equal(y[:, last:], before[:, last:]), "columns past the slices changed"
    assert_close(y, want, magnitude, terms=r, what=f"add_expand {case.x_dtype}->{dt}")


@in_shards()
@given(expand_cases())
def test_add_expand_matches_reference(shard, case):
    check_expand(case)


# -- 1. properties: add_lora_embedding --------------------------------------------------


@dataclass
class EmbeddingCase:
    batch: Batch
    num_loras: int
    padding: int
    vocab: int  # the base model's vocabulary
    extra: int  # rows each LoRA may add
    rank: int
    width: int  # the embedding dim D
    dtype: torch.dtype
    add_inputs: bool
    seed: int


@st.composite
def embedding_cases(draw) -> EmbeddingCase:
    num_tokens = draw(st.integers(1, LIM.tokens), label="T")
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    return EmbeddingCase(
        padding=draw(st.integers(0, 2), label="padded rows"),
        vocab=draw(st.integers(1, 6), label="V"),
        extra=draw(st.integers(0, 4), label="E"),
        rank=draw(st.integers(1, LIM.rank), label="r"),
        width=draw(st.integers(1, LIM.width), label="D"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        add_inputs=draw(st.booleans(), label="add_inputs"),
        batch=draw(batches(num_tokens, num_loras)),
        num_loras=num_loras,
        seed=draw(st.integers(0, 2**31 - 1), label="data seed"),
    )


def lookup_lora_a(wrapper, token_ids, lora_a):
    """What vLLM's ``VocabParallelEmbeddingWithLoRA.forward`` does before the wrapper call:
    read the raw index buffer for as many rows as there are tokens, and look each token's
    LoRA-A row up in the ``[L * (V + E), r]`` view of A."""
    rows, rank = token_ids.shape[0], lora_a.shape[-1]
    offsets = torch.narrow(wrapper._embeddings_indices[1], 0, 0, rows)  # [rows]
    return F.embedding(token_ids + offsets, lora_a.view(-1, rank))  # [rows, r]


def check_embedding(case: EmbeddingCase) -> None:
    L, V, E, r, D, dt, seed = (
        case.num_loras,
        case.vocab,
        case.extra,
        case.rank,
        case.width,
        case.dtype,
        case.seed,
    )
    rows = case.batch.num_tokens + case.padding
    wrapper = prepared_wrapper(case.batch, L, rows, vocab=V, extra=E)
    slots = padded(wrapper.token_lora_indices, rows)
    rng = np.random.default_rng(seed)
    # A token with a LoRA may be one of its adapter's added tokens; others are base tokens.
    token_ids = torch.tensor(
        [int(rng.integers(0, V + E if s >= 0 else V)) for s in slots.tolist()],
        dtype=torch.int64,
        device=DEVICE,
    )  # [rows]
    lora_a = random_tensor((L, V + E, r), dt, seed + 1)  # vLLM's embedding A: [L, V + E, r]
    lora_b = stacked((L, D, r), dt, seed + 2)  # [L, 1, D, r]

    x = lookup_lora_a(wrapper, token_ids, lora_a)
    own_rows = [lora_a[max(s, 0), i] for s, i in zip(slots.tolist(), token_ids.tolist())]
    assert torch.equal(x, torch.stack(own_rows)), "the lookup did not find each token's own row"
    y = random_tensor((rows, D), dt, seed + 3)  # [T, D], the base embedding
    before = y.clone()

    wrapper.add_lora_embedding(y, x, lora_b, add_inputs=case.add_inputs)

    want = reference.add_lora_embedding(before, x, lora_b, slots, case.add_inputs)
    magnitude = reference.add_lora_embedding(
        before.abs(), x.abs(), lora_b.abs(), slots, case.add_inputs
    )
    assert_rows_untouched(y, before, slots, "add_lora_embedding")
    assert_close(y, want, magnitude, terms=r, what=f"add_lora_embedding {dt}")


@given(embedding_cases())
def test_add_lora_embedding_matches_reference(case):
    check_embedding(case)


# -- 1. properties: add_lora_logits -----------------------------------------------------


@dataclass
class LogitsCase:
    batch: Batch
    num_loras: int
    padding: int
    hidden: int
    rank: int
    lora_vocab: int  # rows of B
    vocab_padding: int  # y's columns past B's rows (the padded LM head), >= 1
    dtype: torch.dtype
    scale: float
    seed: int


@st.composite
def logits_cases(draw) -> LogitsCase:
    num_tokens = draw(st.integers(1, LIM.tokens), label="T")
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    return LogitsCase(
        padding=draw(st.integers(0, 1), label="padded rows"),
        hidden=draw(st.integers(1, LIM.hidden), label="Hd"),
        rank=draw(st.integers(1, LIM.rank), label="r"),
        lora_vocab=draw(st.integers(1, LIM.width), label="V_b"),
        vocab_padding=draw(st.integers(1, 4), label="V_pad - V_b"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        scale=draw(st.sampled_from((1.0, 0.5, -2.0)), label="scale"),
        batch=draw(batches(num_tokens, num_loras)),
        num_loras=num_loras,
        seed=draw(st.integers(0, 2**31 - 1), label="data seed"),
    )


def check_logits(case: LogitsCase) -> None:
    L, H, r, dt, seed = case.num_loras, case.hidden, case.rank, case.dtype, case.seed
    rows, vb = case.batch.num_prompts + case.padding, case.lora_vocab
    wrapper = prepared_wrapper(case.batch, L, max(rows, case.batch.num_tokens))
    slots = padded(wrapper.sampler_indices, rows)  # the sampler mapping, not the tokens'
    x = random_tensor((rows, H), dt, seed)  # [P, Hd]
    lora_a = stacked((L, r, H), dt, seed + 1)  # [L, 1, r, Hd]
    lora_b = stacked((L, vb, r), dt, seed + 2)  # [L, 1, V_b, r]
    y = random_tensor((rows, vb + case.vocab_padding), dt, seed + 3)  # [P, V_pad]
    before = y.clone()

    with poisoned_own_buffers():
        wrapper.add_lora_logits(y, x, lora_a, lora_b, case.scale)

    want = reference.add_lora_logits(before, x, lora_a, lora_b, case.scale, slots)
    magnitude = reference.add_lora_logits(
        before.abs(), x.abs(), lora_a.abs(), lora_b.abs(), abs(case.scale), slots
    )
    assert_rows_untouched(y, before, slots, "add_lora_logits")
    assert torch.equal(y[:, vb:], before[:, vb:]), "logits past B's rows changed"
    assert_close(y, want, magnitude, terms=H + r, what=f"add_lora_logits {dt}")


@given(logits_cases())
def test_add_lora_logits_matches_reference(case):
    check_logits(case)


# -- 1. the same checks on named mappings, so each corner is met every run ---------------

NAMED_BATCHES = {
    # slots of the requests, tokens of each request, one sampled row per token?
    "every token on its own LoRA": ([2, 0, 3, 1], [1, 1, 1, 1], False),
    "no token on any LoRA": ([-1, -1, -1], [2, 1, 3], False),
    "prompt mapping shorter than the token mapping": ([1, -1, 3], [3, 2, 4], False),
    "tokens without a LoRA between others": ([3, -1, 0, -1, 3], [2, 1, 2, 3, 1], True),
}


@pytest.mark.parametrize("name", list(NAMED_BATCHES))
def test_named_mappings(name):
    request_slots, lengths, per_token = NAMED_BATCHES[name]
    L, dt = 4, torch.bfloat16
    batch = make_batch(request_slots, lengths, L, per_token, seed=len(name))
    if name == "every token on its own LoRA":
        assert len(set(slots_of(batch.index_mapping, batch.lora_index_to_id))) == batch.num_tokens
    if name == "prompt mapping shorter than the token mapping":
        assert batch.num_prompts < batch.num_tokens
    qkv = qkv_widths(head_dim=3, kv_heads=1, group=2)  # [6, 3, 3]
    common = dict(batch=batch, num_loras=L, dtype=dt)
    for buffer, bias, layer in (("none", "every slice", qkv), ("given", "none", [5, 5])):
        check_linear(
            LinearCase(
                **common, padding=1, spare=1, hidden=9, rank=3, widths=layer, bias=bias,
                scale=0.5, buffer=buffer, three_d=buffer == "given", seed=1,
            )
        )  # fmt: skip
    for add_inputs in (True, False):
        check_shrink(
            ShrinkCase(
                **common, padding=1, hidden=9, rank=3, num_slices=3, scale=-2.0,
                add_inputs=add_inputs, seed=3,
            )
        )  # fmt: skip
    for add_inputs in (True, False):
        check_expand(
            ExpandCase(
                **common, padding=1, rank=3, widths=qkv, bias="some slices", offset_start=2,
                extra_columns=1, add_inputs=add_inputs, x_dtype=torch.float32, seed=4,
            )
        )  # fmt: skip
    for add_inputs in (True, False):
        check_embedding(
            EmbeddingCase(
                **common, padding=1, vocab=5, extra=3, rank=2, width=7, add_inputs=add_inputs,
                seed=5,
            )
        )  # fmt: skip
    check_logits(
        LogitsCase(
            **common, padding=0, hidden=9, rank=3, lora_vocab=7, vocab_padding=3, scale=1.0, seed=6
        )
    )


# -- 1. one wrapper reused over steps of changing size ----------------------------------


def wrapper_state(wrapper: PunicaWrapperNumba) -> dict:
    """Copies of every buffer and host fact the wrapper keeps between calls."""
    state = {
        name: getattr(wrapper, name).clone()
        for name in (
            "_token_lora_indices",
            "_sampler_indices",
            "_sampler_indices_padded",
            "_embeddings_indices",
            "_long_lora_indices",
        )
    }
    for meta_name in ("token_mapping_meta", "prompt_mapping_meta"):
        meta = getattr(wrapper, meta_name)
        for field in (
            "token_lora_mapping",
            "token_indices_sorted_by_lora_ids",
            "active_lora_ids",
            "num_tokens_per_lora",
            "lora_token_start_loc",
            "no_lora_flag_cpu",
            "num_active_loras_cpu",
        ):
            state[f"{meta_name}.{field}"] = getattr(meta, field).clone()
        facts = meta.host
        for tile_m, table in facts.tile_tables.items():
            state[f"{meta_name}.tile_table[{tile_m}]"] = table.clone()
        for tile_m, tokens in facts.tile_tokens.items():
            state[f"{meta_name}.tile_tokens[{tile_m}]"] = tokens.clone()
        state[f"{meta_name}.host"] = (
            facts.num_tokens,
            facts.max_slot_in_use,
            facts.active_slots,
            facts.segments,
        )
    state["indices_len"] = list(wrapper.indices_len)
    return state


def assert_same_state(got: dict, want: dict, context: str) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        same = (
            torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
        )
        assert same, f"{context}: {name} differs: {got[name]} vs {value}"


@dataclass
class ReuseCase:
    num_loras: int
    capacity: int
    hidden: int
    rank: int
    widths: list[int]
    dtype: torch.dtype
    steps: list[Batch]
    rows: list[int]  # activation rows of each step (>= its tokens: graph padding)
    seed: int


@st.composite
def reuse_cases(draw) -> ReuseCase:
    num_loras = draw(st.integers(1, LIM.loras), label="L")
    capacity = draw(st.integers(3, LIM.tokens), label="max_num_batched_tokens")
    hidden = draw(st.integers(1, LIM.hidden), label="H")
    rank = draw(st.integers(1, LIM.rank), label="r")
    widths = draw(layer_widths("qkv"))
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    sizes = draw(
        st.lists(st.integers(1, capacity), min_size=2, max_size=3, unique=True),
        label="tokens of each step",
    )
    rows = [draw(st.integers(n, capacity), label="rows") for n in sizes]
    steps = [draw(batches(n, num_loras)) for n in sizes]
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    return ReuseCase(num_loras, capacity, hidden, rank, widths, dtype, steps, rows, seed)


@given(reuse_cases())
def test_reused_wrapper_equals_a_fresh_one_at_every_step(case):
    """Nothing of an earlier step (bigger or smaller) leaks into the next one."""
    L, H, r, dt, widths = case.num_loras, case.hidden, case.rank, case.dtype, case.widths
    S = len(widths)
    lora_a = tuple(stacked((L, r, H), dt, case.seed + s) for s in range(S))
    lora_b = tuple(stacked((L, n, r), dt, case.seed + 3 + s) for s, n in enumerate(widths))
    bias = make_bias("every slice", widths, L, dt, case.seed + 6)
    logits_a, logits_b = stacked((L, r, H), dt, case.seed + 9), stacked((L, 5, r), dt, case.seed)
    reused = PunicaWrapperNumba(case.capacity, 2, DEVICE, max_loras=L)
    for step, (batch, rows) in enumerate(zip(case.steps, case.rows)):
        update(reused, batch)
        fresh = prepared_wrapper(batch, L, case.capacity)
        assert_same_state(wrapper_state(reused), wrapper_state(fresh), f"step {step}")

        x = random_tensor((rows, H), dt, case.seed + 20 + step)
        y0 = random_tensor((rows, sum(widths)), dt, case.seed + 30 + step)
        hidden = random_tensor((batch.num_prompts, H), dt, case.seed + 40 + step)
        logits0 = random_tensor((batch.num_prompts, 7), dt, case.seed + 50 + step)
        results = []
        for wrapper in (reused, fresh):
            y, logits = y0.clone(), logits0.clone()
            wrapper.add_lora_linear(y, x, lora_a, lora_b, bias, 1.0, widths)
            wrapper.add_lora_logits(logits, hidden, logits_a, logits_b, 1.0)
            results.append((y, logits))
        (y, logits), (y_fresh, logits_fresh) = results
        assert torch.equal(y, y_fresh), f"step {step}: add_lora_linear differs from a fresh wrapper"
        assert torch.equal(logits, logits_fresh), f"step {step}: logits differ from a fresh wrapper"

        slots = padded(reused.token_lora_indices, rows)
        want = reference.add_lora_linear(y0, x, lora_a, lora_b, bias, 1.0, widths, slots)
        magnitude = reference.add_lora_linear(
            y0.abs(),
            x.abs(),
            absolute(lora_a),
            absolute(lora_b),
            absolute(bias),
            1.0,
            widths,
            slots,
        )
        assert_rows_untouched(y, y0, slots, f"step {step}")
        assert_close(y, want, magnitude, terms=H + r, what=f"reused add_lora_linear {dt}")
        sampler = reused.sampler_indices
        want = reference.add_lora_logits(logits0, hidden, logits_a, logits_b, 1.0, sampler)
        magnitude = reference.add_lora_logits(
            logits0.abs(), hidden.abs(), logits_a.abs(), logits_b.abs(), 1.0, sampler
        )
        assert_close(logits, want, magnitude, terms=H + r, what=f"reused add_lora_logits {dt}")


@pytest.mark.skipif(
    DEVICE.type != "cpu",
    reason="on a GPU every buffer has a host twin: no wrapper writes its buffers in place",
)
@given(reuse_cases())
def test_metadata_sent_from_host_twins_equals_metadata_written_in_place(case):
    """update_metadata computes on host twins of the wrapper's buffers and sends them (on
    a GPU; here the same copying path runs on the CPU): step after step, the wrapper holds
    what a wrapper that writes its buffers in place holds, and its calls give the same
    bits. (On a GPU, test_meta holds prepare_slots, sent, to prepare_tensors.)"""
    L, H, r, dt, widths = case.num_loras, case.hidden, case.rank, case.dtype, case.widths
    lora_a = tuple(stacked((L, r, H), dt, case.seed + s) for s in range(len(widths)))
    lora_b = tuple(stacked((L, n, r), dt, case.seed + 3 + s) for s, n in enumerate(widths))
    wrappers = {}
    for twins in (True, False):
        with mock.patch.object(wrapper_module, "separate_twins", lambda device, twins=twins: twins):
            wrappers[twins] = PunicaWrapperNumba(case.capacity, 2, DEVICE, max_loras=L)
    assert wrappers[True].token_mapping_meta._twin is not None
    assert wrappers[False].token_mapping_meta._twin is None
    for step, (batch, rows) in enumerate(zip(case.steps, case.rows)):
        x = random_tensor((rows, H), dt, case.seed + 20 + step)
        y0 = random_tensor((rows, sum(widths)), dt, case.seed + 30 + step)
        ys = []
        for wrapper in wrappers.values():
            update(wrapper, batch)
            ys.append(y0.clone())
            wrapper.add_lora_linear(ys[-1], x, lora_a, lora_b, None, 1.0, widths)
        staged, in_place = (wrapper_state(w) for w in wrappers.values())
        assert_same_state(staged, in_place, f"step {step}")
        assert torch.equal(ys[0], ys[1]), f"step {step}: add_lora_linear differs"


# -- 2. regressions: one per vLLM defect of SPEC §7 that touches the wrapper -------------

T_REG, H_REG, R_REG, L_REG = 6, 8, 3, 3
SLOTS_REG = [2, -1, 0, -1, 1, 2]  # the last slot present, and tokens without a LoRA


def regression_wrapper(token_slots=SLOTS_REG, capacity=8) -> tuple[PunicaWrapperNumba, Batch]:
    batch = batch_of_token_slots(token_slots, L_REG)
    return prepared_wrapper(batch, L_REG, capacity), batch


def test_add_expand_honours_add_inputs_false():
    """vLLM's ``add_expand`` passes ``add_inputs=True`` to the kernel whatever it is given,
    so y's old values stay in the sum. Here y holds 100 and must be overwritten."""
    wrapper, _ = regression_wrapper()
    slots = wrapper.token_lora_indices
    x = random_tensor((2, T_REG, R_REG), torch.float32, 1)  # [S, T, r]
    lora_b = (
        stacked((L_REG, 4, R_REG), torch.bfloat16, 2),
        stacked((L_REG, 2, R_REG), torch.bfloat16, 3),
    )
    y = torch.full((T_REG, 6), 100.0, dtype=torch.bfloat16, device=DEVICE)
    before = y.clone()

    wrapper.add_expand(y, x, lora_b, None, (4, 2), add_inputs=False)

    want = reference.lora_expand(x, lora_b, before, slots, 0, add_inputs=False)
    magnitude = reference.lora_expand(x.abs(), absolute(lora_b), before.abs(), slots, 0, False)
    assert_rows_untouched(y, before, slots, "add_expand(add_inputs=False)")
    assert_close(y, want, magnitude, terms=R_REG, what="add_expand add_inputs=False")


def test_bias_respects_offset_start():
    """vLLM's ``_apply_bias`` starts at column 0 whatever ``offset_start`` is, so with
    ``offset_start=3`` the bias lands on columns 0..N-1. Here columns 0..2 must stay."""
    wrapper, _ = regression_wrapper()
    slots = wrapper.token_lora_indices
    widths, offset = (4, 2), 3
    x = random_tensor((2, T_REG, R_REG), torch.float32, 1)
    lora_b = tuple(stacked((L_REG, n, R_REG), torch.bfloat16, 2 + s) for s, n in enumerate(widths))
    bias = tuple(stacked((L_REG, n), torch.bfloat16, 5 + s) for s, n in enumerate(widths))
    y = random_tensor((T_REG, offset + 6 + 1), torch.bfloat16, 7)
    before = y.clone()

    wrapper.add_expand(y, x, lora_b, bias, widths, offset_start=offset)

    want = with_bias(
        reference.lora_expand(x, lora_b, before, slots, offset, True), bias, widths, slots, offset
    )
    magnitude = with_bias(
        reference.lora_expand(x.abs(), absolute(lora_b), before.abs(), slots, offset, True),
        absolute(bias),
        widths,
        slots,
        offset,
    )
    assert torch.equal(y[:, :offset], before[:, :offset]), "the bias was added before offset_start"
    assert torch.equal(y[:, -1:], before[:, -1:]), "a column past the slices changed"
    assert_close(y, want, magnitude, terms=R_REG, what="add_expand bias with offset_start")


@pytest.mark.parametrize("method", ["add_expand", "add_lora_linear"])
def test_bias_goes_only_to_rows_of_its_slot(method):
    """vLLM gathers ``bias[indices]``, where -1 picks the *last* slot's row, and then has to
    mask those rows out; rows past the mapping read stale or uninitialised indices. Here
    every row gets exactly its own slot's bias, and rows with -1 (and padding) get none.
    The LoRA weights are zero, so the bias is all that is added."""
    wrapper, _ = regression_wrapper()
    rows = T_REG + 2  # two padding rows
    slots = padded(wrapper.token_lora_indices, rows)
    widths = (3, 2)
    bias = tuple(stacked((L_REG, n), torch.bfloat16, 5 + s) for s, n in enumerate(widths))
    lora_b = tuple(
        torch.zeros(L_REG, 1, n, R_REG, dtype=torch.bfloat16, device=DEVICE) for n in widths
    )
    y = random_tensor((rows, 5), torch.bfloat16, 7)
    before = y.clone()
    if method == "add_expand":
        x = random_tensor((2, rows, R_REG), torch.float32, 1)
        wrapper.add_expand(y, x, lora_b, bias, widths)
    else:
        lora_a = tuple(stacked((L_REG, R_REG, H_REG), torch.bfloat16, 8 + s) for s in range(2))
        x = random_tensor((rows, H_REG), torch.bfloat16, 1)
        wrapper.add_lora_linear(y, x, lora_a, lora_b, bias, 1.0, widths)

    assert_rows_untouched(y, before, slots, f"{method} with a bias")
    want = reference.add_bias(before, bias, widths, slots)
    assert_close(y, want, want.abs() + before.abs(), terms=1, what="bias only")


def test_index_buffers_initialised_and_reset_past_each_batch():
    """vLLM allocates its index buffers with ``torch.empty`` and copies each step into
    their front only: before the first full-size update the tail is garbage, later it
    holds the previous step's slots, and the bias path (which reads the raw buffer for
    as many rows as y has) adds biases to CUDA-graph padding rows or gathers out of
    bounds. Here the tail reads -1 / 0 and padding rows stay untouched."""
    capacity, widths = 8, (4, 2)
    wrapper = PunicaWrapperNumba(capacity, 4, DEVICE, max_loras=L_REG)
    assert wrapper._token_lora_indices.tolist() == [-1] * capacity
    assert wrapper._sampler_indices.tolist() == [-1] * capacity
    assert wrapper.token_mapping_meta.token_lora_mapping.tolist() == [-1] * capacity
    assert not wrapper._embeddings_indices.any() and not wrapper._long_lora_indices.any()
    lora_b = tuple(stacked((L_REG, n, R_REG), torch.bfloat16, 2 + s) for s, n in enumerate(widths))
    bias = tuple(stacked((L_REG, n), torch.bfloat16, 5 + s) for s, n in enumerate(widths))

    def expand_on_padded_rows(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = random_tensor((2, rows, R_REG), torch.float32, seed)
        y = random_tensor((rows, 6), torch.bfloat16, seed + 1)
        before = y.clone()
        wrapper.add_expand(y, x, lora_b, bias, widths)
        slots = padded(wrapper.token_lora_indices, rows)
        want = with_bias(
            reference.lora_expand(x, lora_b, before, slots, 0, True), bias, widths, slots
        )
        magnitude = with_bias(
            reference.lora_expand(x.abs(), absolute(lora_b), before.abs(), slots, 0, True),
            absolute(bias),
            widths,
            slots,
        )
        assert_close(y, want, magnitude, terms=R_REG, what="add_expand with padding rows")
        return y, before

    y, before = expand_on_padded_rows(4, 10)  # before any update_metadata: no row has a LoRA
    assert torch.equal(y, before), "rows changed before any update_metadata"

    update(wrapper, batch_of_token_slots([0, 1, 2, 2, 1, 0, 1, 2], L_REG))  # a full batch
    update(wrapper, batch_of_token_slots([2, 0, 1], L_REG))  # then a small one
    assert wrapper._token_lora_indices[3:].tolist() == [-1] * (capacity - 3)
    assert wrapper._sampler_indices[3:].tolist() == [-1] * (capacity - 3)
    assert wrapper.token_mapping_meta.token_lora_mapping[3:].tolist() == [-1] * (capacity - 3)
    assert wrapper.prompt_mapping_meta.token_lora_mapping[3:].tolist() == [-1] * (capacity - 3)
    assert not wrapper._embeddings_indices[:, 3:].any()
    y, before = expand_on_padded_rows(capacity, 20)
    assert torch.equal(y[3:], before[3:]), "CUDA-graph padding rows changed"


def test_more_sampled_rows_than_max_batches():
    """vLLM V1 sized the prompt metadata ``max_batches`` (``max_num_seqs``), so a step with
    more sampled rows than requests (prompt logprobs, speculative decoding) overflowed its
    ``copy_``. Here 2 requests sample 7 rows with ``max_batches=2``."""
    L, capacity, H, r, vb = 3, 8, 6, 2, 5
    batch = make_batch([1, 2], [3, 4], L, prompts_per_token=True, seed=3)
    wrapper = PunicaWrapperNumba(capacity, 2, DEVICE, max_loras=L)
    update(wrapper, batch)
    assert batch.num_prompts == 7 > wrapper.max_batches
    slots = wrapper.sampler_indices
    x = random_tensor((7, H), torch.bfloat16, 1)
    lora_a, lora_b = stacked((L, r, H), torch.bfloat16, 2), stacked((L, vb, r), torch.bfloat16, 3)
    y = random_tensor((7, vb + 3), torch.bfloat16, 4)
    before = y.clone()

    wrapper.add_lora_logits(y, x, lora_a, lora_b, 1.0)

    want = reference.add_lora_logits(before, x, lora_a, lora_b, 1.0, slots)
    magnitude = reference.add_lora_logits(
        before.abs(), x.abs(), lora_a.abs(), lora_b.abs(), 1.0, slots
    )
    assert torch.equal(y[:, vb:], before[:, vb:])
    assert_close(y, want, magnitude, terms=H + r, what="logits with many sampled rows")


def test_no_stale_pointer_tables():
    """vLLM caches its pointer tables by ``data_ptr()`` alone, so the same B with another
    ``offset_start``, or a freed weight's address reused by a tensor of another shape,
    gets the old table. Here both give the right result."""
    wrapper, _ = regression_wrapper()
    slots = wrapper.token_lora_indices
    dt = torch.bfloat16

    # The same weights, twice, with different offset_start.
    lora_b = (stacked((L_REG, 4, R_REG), dt, 1), stacked((L_REG, 2, R_REG), dt, 2))
    x = random_tensor((2, T_REG, R_REG), torch.float32, 3)
    for offset in (0, 3, 0):
        y = random_tensor((T_REG, 9), dt, 4 + offset)
        before = y.clone()
        wrapper.add_expand(y, x, lora_b, None, (4, 2), offset_start=offset)
        want = reference.lora_expand(x, lora_b, before, slots, offset, True)
        magnitude = reference.lora_expand(
            x.abs(), absolute(lora_b), before.abs(), slots, offset, True
        )
        assert torch.equal(y[:, :offset], before[:, :offset])
        assert torch.equal(y[:, offset + 6 :], before[:, offset + 6 :])
        assert_close(y, want, magnitude, terms=R_REG, what=f"expand reused B, offset {offset}")

    # Weights that start at the address of earlier, freed weights of another shape: views
    # of one storage make the reuse certain rather than up to the allocator.
    memory_a = torch.empty(4096, dtype=dt, device=DEVICE)
    memory_b = torch.empty(4096, dtype=dt, device=DEVICE)
    for step, (H, r, widths) in enumerate([(8, 3, (6, 3, 3)), (5, 2, (4, 4)), (11, 4, (9,))]):
        lora_a = tuple(memory_a[: L_REG * r * H].view(L_REG, 1, r, H) for _ in widths)
        lora_b = []
        column = 0
        for n in widths:  # slice 0 of every step starts at the same address
            lora_b.append(memory_b[column : column + L_REG * n * r].view(L_REG, 1, n, r))
            column += L_REG * n * r
        memory_a.copy_(random_tensor((4096,), dt, 10 + step))
        memory_b.copy_(random_tensor((4096,), dt, 20 + step))
        assert lora_a[0].data_ptr() == memory_a.data_ptr() == lora_a[-1].data_ptr()
        assert lora_b[0].data_ptr() == memory_b.data_ptr()
        x = random_tensor((T_REG, H), dt, 30 + step)
        y = random_tensor((T_REG, sum(widths)), dt, 40 + step)
        before = y.clone()
        wrapper.add_lora_linear(y, x, lora_a, tuple(lora_b), None, 1.0, widths)
        want = reference.add_lora_linear(before, x, lora_a, lora_b, None, 1.0, widths, slots)
        magnitude = reference.add_lora_linear(
            before.abs(), x.abs(), absolute(lora_a), absolute(lora_b), None, 1.0, widths, slots
        )
        assert_close(y, want, magnitude, terms=H + r, what="linear on reused addresses")


@pytest.mark.parametrize("max_loras", [1, 2])
def test_the_wrappers_own_buffer_is_filled_where_the_expand_reads_every_row(max_loras, monkeypatch):
    """Where the stacks hold one slot, the expand loads every token's buffer row before it
    knows the token's slot (``kernels.expand_lanes`` / ``expand_mma``, "One slot"), rows
    of tokens without a LoRA too: the buffer the wrapper makes for the call must hold no
    memory nothing wrote (compute-sanitizer's initcheck reported such reads on the H200
    at 5d81db4). With ``torch.empty`` poisoned with NaN, the buffer the expand is given
    has no NaN there; with two slots the expand reads only rows the shrink wrote, so the
    buffer is left unfilled and the poison stays in the rows of tokens without a LoRA."""
    H, r, widths = 16, 8, (16, 8)
    ids = list(range(7, 7 + max_loras))
    wrapper = PunicaWrapperNumba(16, 4, DEVICE, max_loras=max_loras)
    index_mapping = (ids[0], 0, ids[-1], 0, ids[0])  # tokens 1 and 3: no LoRA
    wrapper.update_metadata(LoRAMapping(index_mapping, index_mapping), ids, max_loras + 1, 100, 0)
    x = random_tensor((5, H), torch.bfloat16, 1)
    a = tuple(random_tensor((max_loras, r, H), torch.bfloat16, 2 + s) for s in range(2))
    b = tuple(random_tensor((max_loras, n, r), torch.bfloat16, 4 + s) for s, n in enumerate(widths))
    y = random_tensor((5, sum(widths)), torch.bfloat16, 6)
    before = y.clone()

    real_empty, real_expand = torch.empty, wrapper_module.expand_launch
    buffers = []

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def spying_expand(buffer, *args, **kwargs):
        buffers.append(buffer)
        return real_expand(buffer, *args, **kwargs)

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(wrapper_module, "expand_launch", spying_expand)
    wrapper.add_lora_linear(y, x, a, b, 0.5, widths)
    monkeypatch.undo()

    slots = wrapper.token_lora_indices
    assert slots.tolist() == [0, -1, max_loras - 1, -1, 0]
    want = reference.add_lora_linear(before, x, a, b, None, 0.5, widths, slots)
    magnitude = reference.add_lora_linear(
        before.abs(), x.abs(), absolute(a), absolute(b), None, 0.5, widths, slots
    )
    assert_close(y, want, magnitude, terms=H + r, what="linear with a poisoned torch.empty")
    (buffer,) = buffers
    unmapped = buffer[:, slots == -1]
    if max_loras == 1:
        assert not unmapped.isnan().any(), "a row the expand reads was never written"
    else:
        assert unmapped.isnan().all(), "the buffer is filled although no kernel reads it"


def test_long_lora_indices_have_one_entry_per_token():
    """Without a long-LoRA context vLLM's ``long_lora_indices`` returned the whole zeroed
    buffer (``max_num_batched_tokens`` entries). Here it has T entries: zeros without a
    context, each adapter's offset with one; and a later step without one resets them."""
    wrapper, batch = regression_wrapper(capacity=8)
    assert wrapper.long_lora_indices.tolist() == [0] * T_REG
    lora_id = batch.lora_index_to_id[2]
    context = LongContextLoRAContext({lora_id: 4096})
    wrapper.update_metadata(
        batch.mapping(), batch.lora_index_to_id, L_REG + 1, VOCAB, EXTRA_VOCAB, context
    )
    want = [4096 if i == lora_id else 0 for i in batch.index_mapping]
    assert wrapper.long_lora_indices.tolist() == want
    update(wrapper, batch_of_token_slots([1, 0], L_REG))
    assert wrapper.long_lora_indices.tolist() == [0, 0]
    assert not wrapper._long_lora_indices.any(), "an offset of the earlier step stayed"


# -- 3. bad input: a clear error naming the argument, and nothing changed ----------------


@dataclass
class LinearArgs:
    """A valid add_lora_linear call (3 GQA slices with bias) on a prepared wrapper."""

    wrapper: PunicaWrapperNumba
    y: torch.Tensor
    x: torch.Tensor
    lora_a: tuple
    lora_b: tuple
    bias: tuple
    widths: tuple
    buffer: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.y, self.x, *self.lora_a, *self.lora_b, *self.bias, self.buffer]


def linear_args() -> LinearArgs:
    wrapper, _ = regression_wrapper()
    widths, dt = (6, 3, 3), torch.bfloat16
    return LinearArgs(
        wrapper=wrapper,
        y=random_tensor((T_REG, sum(widths)), dt, 1),
        x=random_tensor((T_REG, H_REG), dt, 2),
        lora_a=tuple(stacked((L_REG, R_REG, H_REG), dt, 3 + s) for s in range(3)),
        lora_b=tuple(stacked((L_REG, n, R_REG), dt, 6 + s) for s, n in enumerate(widths)),
        bias=tuple(stacked((L_REG, n), dt, 9 + s) for s, n in enumerate(widths)),
        widths=widths,
        buffer=random_tensor((3, T_REG, R_REG), torch.float32, 12),
    )


class ArgumentNotNamed(AssertionError):
    """The call was rejected and changed nothing, but its message names another argument."""


def assert_rejected(exc, name: str, call, tensors, wrapper) -> None:
    """``call()`` raises ``exc``, changes no tensor and no state of the wrapper, and its
    message names the argument (the regex ``name``), checked in that order."""
    snapshots = [t.clone() for t in tensors]
    state = wrapper_state(wrapper)
    with pytest.raises(exc) as caught:
        call()
    for i, (t, snap) in enumerate(zip(tensors, snapshots)):
        assert torch.equal(t, snap), f"tensor {i} changed by a rejected call"
    assert_same_state(wrapper_state(wrapper), state, "a rejected call")
    message = str(caught.value)
    if not re.search(name, message):
        raise ArgumentNotNamed(f"the message does not name {name!r}: {message!r}")


@pytest.mark.parametrize("what", ["index_mapping", "prompt_mapping"])
def test_update_metadata_rejects_more_tokens_than_the_buffers_hold(what):
    wrapper, batch = regression_wrapper(capacity=8)
    ids = [batch.lora_index_to_id[0]] * 9  # one more than max_num_batched_tokens
    mapping = LoRAMapping(
        index_mapping=ids if what == "index_mapping" else batch.index_mapping,
        prompt_mapping=ids if what == "prompt_mapping" else batch.prompt_mapping,
    )
    before = (
        wrapper._token_lora_indices.clone(),
        wrapper.token_mapping_meta.active_lora_ids.clone(),
    )

    assert_rejected(
        ValueError,
        what,
        lambda: wrapper.update_metadata(mapping, batch.lora_index_to_id, L_REG + 1, VOCAB, 256),
        [],
        wrapper,
    )
    assert torch.equal(wrapper._token_lora_indices, before[0])
    assert torch.equal(wrapper.token_mapping_meta.active_lora_ids, before[1])


def test_update_metadata_rejects_an_adapter_id_not_in_a_slot():
    wrapper, batch = regression_wrapper()
    unknown = max(i for i in batch.lora_index_to_id if i) + 1
    mapping = LoRAMapping(index_mapping=[unknown, 0], prompt_mapping=[unknown])
    assert_rejected(
        ValueError,
        "lora_index_to_id",
        lambda: wrapper.update_metadata(mapping, batch.lora_index_to_id, L_REG + 1, VOCAB, 256),
        [],
        wrapper,
    )


def test_update_metadata_rejects_a_slot_past_max_loras():
    """``lora_index_to_id`` longer than the wrapper's slots, and its last slot in use."""
    wrapper, batch = regression_wrapper()
    ids = [*batch.lora_index_to_id, 999]
    mapping = LoRAMapping(index_mapping=[999, 0], prompt_mapping=[0])
    assert_rejected(
        ValueError,
        "max_loras",
        lambda: wrapper.update_metadata(mapping, ids, L_REG + 2, VOCAB, 256),
        [],
        wrapper,
    )


@pytest.mark.parametrize(
    "short", ["lora_a_stacked", "lora_b_stacked", "lora_bias_stacked", "output_slices"]
)
def test_add_lora_linear_rejects_tuples_of_different_lengths(short):
    a = linear_args()
    args = dict(
        lora_a_stacked=a.lora_a,
        lora_b_stacked=a.lora_b,
        lora_bias_stacked=a.bias,
        output_slices=a.widths,
    )
    args[short] = args[short][:2]
    assert_rejected(
        ValueError,
        short,
        lambda: a.wrapper.add_lora_linear(a.y, a.x, scale=1.0, buffer=a.buffer, **args),
        a.tensors(),
        a.wrapper,
    )


@pytest.mark.parametrize("method", ["add_lora_linear", "add_expand"])
def test_a_slice_width_that_differs_from_its_b_is_rejected(method):
    a = linear_args()
    widths = (6, 3, 4)
    call = {
        "add_lora_linear": lambda: a.wrapper.add_lora_linear(
            a.y, a.x, a.lora_a, a.lora_b, None, 1.0, widths, buffer=a.buffer
        ),
        "add_expand": lambda: a.wrapper.add_expand(a.y, a.buffer, a.lora_b, None, widths),
    }[method]
    assert_rejected(ValueError, r"output_slices\[2\]", call, a.tensors(), a.wrapper)


METHODS = ("add_lora_linear", "add_shrink", "add_expand", "add_lora_embedding", "add_lora_logits")


@pytest.mark.parametrize(
    "method",
    METHODS,
)
def test_y_with_other_rows_than_x_is_rejected(method):
    a = linear_args()
    y = random_tensor((T_REG + 1, sum(a.widths)), torch.bfloat16, 20)  # one row too many
    shrink_y = torch.zeros(3, T_REG + 1, R_REG, dtype=torch.float32, device=DEVICE)
    call = {
        "add_lora_linear": lambda: a.wrapper.add_lora_linear(
            y, a.x, a.lora_a, a.lora_b, a.bias, 1.0, a.widths
        ),
        "add_shrink": lambda: a.wrapper.add_shrink(shrink_y, a.x, a.lora_a, 1.0),
        "add_expand": lambda: a.wrapper.add_expand(y, a.buffer, a.lora_b, a.bias, a.widths),
        "add_lora_embedding": lambda: a.wrapper.add_lora_embedding(y, a.buffer[0], a.lora_b[0]),
        "add_lora_logits": lambda: a.wrapper.add_lora_logits(y, a.x, a.lora_a[0], a.lora_b[0], 1.0),
    }[method]
    assert_rejected(ValueError, r"\by\b", call, [*a.tensors(), y, shrink_y], a.wrapper)


DTYPE_CASES = [(method, bad) for method in METHODS for bad in ("float64 x", "int y")]


@pytest.mark.parametrize("method, bad", DTYPE_CASES)
def test_a_dtype_the_kernels_do_not_take_is_rejected(method, bad):
    a = linear_args()
    x, y, buffer = a.x, a.y, a.buffer  # buffer: the x of add_expand (and of the embedding)
    if bad == "float64 x":
        x, buffer = a.x.double(), a.buffer.double()
    else:
        y = a.y.to(torch.int32)
    shrink_y = a.buffer.to(torch.int32) if bad == "int y" else a.buffer
    call = {
        "add_lora_linear": lambda: a.wrapper.add_lora_linear(
            y, x, a.lora_a, a.lora_b, a.bias, 1.0, a.widths
        ),
        "add_shrink": lambda: a.wrapper.add_shrink(shrink_y, x, a.lora_a, 1.0),
        "add_expand": lambda: a.wrapper.add_expand(y, buffer, a.lora_b, a.bias, a.widths),
        "add_lora_embedding": lambda: a.wrapper.add_lora_embedding(y, buffer[0], a.lora_b[0]),
        "add_lora_logits": lambda: a.wrapper.add_lora_logits(y, x, a.lora_a[0], a.lora_b[0], 1.0),
    }[method]
    name = r"\bx\b" if bad == "float64 x" else r"\by\b"
    assert_rejected(TypeError, name, call, [*a.tensors(), x, y, buffer, shrink_y], a.wrapper)


@pytest.mark.parametrize("bad", ["rank", "slots", "dtype"])
def test_add_lora_linear_checks_b_before_the_shrink_runs(bad):
    """A B that only the expand step would reject: the caller's buffer and y stay as they
    were (shrink must not have added into the buffer)."""
    a = linear_args()
    wrong = {
        "rank": stacked((L_REG, 3, R_REG + 1), torch.bfloat16, 30),
        "slots": stacked((L_REG + 1, 3, R_REG), torch.bfloat16, 30),
        "dtype": a.lora_b[1].half(),
    }[bad]
    lora_b = (a.lora_b[0], wrong, a.lora_b[2])
    assert_rejected(
        TypeError if bad == "dtype" else ValueError,
        r"lora_b_stacked\[1\]",
        lambda: a.wrapper.add_lora_linear(
            a.y, a.x, a.lora_a, lora_b, a.bias, 1.0, a.widths, buffer=a.buffer
        ),
        [*a.tensors(), wrong],
        a.wrapper,
    )


# -- 4. CUDA graphs (real GPU only) ------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Capture add_lora_linear (3 GQA slices with bias), add_lora_logits and
    add_lora_embedding (with vLLM's lookup) once, with every token on a LoRA; then
    replay for new mappings of the same or fewer tokens, one with no LoRA at all."""
    device, dt = DEVICE, torch.bfloat16
    T, requests, H, r, L = 48, 12, 256, 16, 4
    widths = qkv_widths(head_dim=32, kv_heads=1, group=4)  # [128, 32, 32]
    V, E, D, vb, v_pad = 500, 12, 96, 300, 384
    lengths = [T // requests] * requests  # 12 requests of 4 tokens

    wrapper = PunicaWrapperNumba(64, 16, device, max_loras=L)
    capture_batch = make_batch([i % L for i in range(requests)], lengths, L, False, seed=1)
    ids = capture_batch.lora_index_to_id  # every slot filled: every request has a LoRA
    assert None not in ids

    lora_a = tuple(stacked((L, r, H), dt, 10 + s) for s in range(3))
    lora_b = tuple(stacked((L, n, r), dt, 20 + s) for s, n in enumerate(widths))
    bias = tuple(stacked((L, n), dt, 30 + s) for s, n in enumerate(widths))
    logits_a, logits_b = stacked((L, r, H), dt, 40), stacked((L, vb, r), dt, 41)
    embed_a, embed_b = random_tensor((L, V + E, r), dt, 42), stacked((L, D, r), dt, 43)

    x = random_tensor((T, H), dt, 1)  # static inputs and outputs of the graph
    y = torch.zeros(T, sum(widths), dtype=dt, device=device)
    hidden = random_tensor((requests, H), dt, 2)
    logits = torch.zeros(requests, v_pad, dtype=dt, device=device)
    token_ids = torch.zeros(T, dtype=torch.int64, device=device)
    embedded = torch.zeros(T, D, dtype=dt, device=device)

    def layers():
        wrapper.add_lora_linear(y, x, lora_a, lora_b, bias, 1.0, widths)
        wrapper.add_lora_logits(logits, hidden, logits_a, logits_b, 1.0)
        a_rows = lookup_lora_a(wrapper, token_ids, embed_a)  # [T, r]
        wrapper.add_lora_embedding(embedded, a_rows, embed_b)

    update(wrapper, capture_batch, V, E)
    layers()  # outside capture: compiles, and warms the caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()

    rounds = [  # request slots and tokens per request; the same or fewer tokens than captured
        ([0, -1, 1, 2, 3, -1, 0, 1, -1, 2, 3, 0], lengths),
        ([3, 3, -1, 1, 0, -1, 2], [5, 1, 3, 4, 2, 6, 1]),
        ([-1, -1, -1, -1, -1], [4, 4, 4, 4, 4]),
    ]
    for round_, (request_slots, round_lengths) in enumerate(rounds):
        request_ids = [ids[s] if s >= 0 else 0 for s in request_slots]
        batch = Batch(ids, request_ids, round_lengths, False)  # the same adapters stay loaded
        update(wrapper, batch, V, E)
        n, p = batch.num_tokens, batch.num_prompts
        slots = padded(wrapper.token_lora_indices, T)
        sampler = padded(wrapper.sampler_indices, requests)
        rng = np.random.default_rng(round_)  # LoRA tokens may be their adapter's added tokens
        new_ids = [int(rng.integers(0, V + E if s >= 0 else V)) for s in slots.tolist()]
        x.copy_(random_tensor((T, H), dt, 100 + round_))
        hidden.copy_(random_tensor((requests, H), dt, 200 + round_))
        token_ids.copy_(torch.tensor(new_ids, device=device))
        y0 = random_tensor((T, sum(widths)), dt, 300 + round_)
        logits0 = random_tensor((requests, v_pad), dt, 400 + round_)
        embedded0 = random_tensor((T, D), dt, 500 + round_)
        y.copy_(y0)
        logits.copy_(logits0)
        embedded.copy_(embedded0)

        graph.replay()
        torch.cuda.synchronize()

        want = reference.add_lora_linear(y0, x, lora_a, lora_b, bias, 1.0, widths, slots)
        magnitude = reference.add_lora_linear(
            y0.abs(),
            x.abs(),
            absolute(lora_a),
            absolute(lora_b),
            absolute(bias),
            1.0,
            widths,
            slots,
        )
        assert torch.equal(y[n:], y0[n:]), f"round {round_}: padding rows changed"
        assert_rows_untouched(y, y0, slots, f"round {round_} linear")
        assert_close(y, want, magnitude, terms=H + r, what="graph add_lora_linear")

        want = reference.add_lora_logits(logits0, hidden, logits_a, logits_b, 1.0, sampler)
        magnitude = reference.add_lora_logits(
            logits0.abs(), hidden.abs(), logits_a.abs(), logits_b.abs(), 1.0, sampler
        )
        assert torch.equal(logits[p:], logits0[p:]), f"round {round_}: padding logits changed"
        assert torch.equal(logits[:, vb:], logits0[:, vb:])
        assert_close(logits, want, magnitude, terms=H + r, what="graph add_lora_logits")

        a_rows = torch.stack([embed_a[max(s, 0), i] for s, i in zip(slots.tolist(), new_ids)])
        want = reference.add_lora_embedding(embedded0, a_rows, embed_b, slots)
        magnitude = reference.add_lora_embedding(
            embedded0.abs(), a_rows.abs(), embed_b.abs(), slots
        )
        assert torch.equal(embedded[n:], embedded0[n:]), f"round {round_}: padding rows changed"
        assert_close(embedded, want, magnitude, terms=r, what="graph add_lora_embedding")
