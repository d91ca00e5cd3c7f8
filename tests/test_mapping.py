"""Property tests of ``convert_mapping``, checked against SPEC §2.3 read literally.

The model below is the loop the SPEC describes: one ``lora_index_to_id.index(id)``
per token, then plain list arithmetic for every output. ``convert_mapping`` is
vectorised; the two must agree on every output, dtype and length. Dims are drawn
first (slots L, tokens T, sampled rows P), then the assignment mode, then values
from a seeded generator.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba.mapping import LongContextLoRAContext, LoRAMapping, convert_mapping

from .strategies import DEVICE, META_LIMITS

VOCAB_SIZES = (512, 32000)
EXTRA_VOCAB_SIZES = (256, 512)  # lora_extra_vocab_size's allowed values
ID_MODES = ("uniform", "none", "identical", "requests")


# -- the plain-Python model (SPEC §2.3, literally) ---------------------------------------


def plain_convert(
    index_mapping, prompt_mapping, lora_index_to_id, max_loras, vocab_size, extra, offsets
):
    """Every output of ``convert_mapping`` as plain lists; ``offsets`` None = no context."""
    base, embedding_slots, long_lora = [], [], []
    for lora_id in index_mapping:
        slot = lora_index_to_id.index(lora_id) if lora_id > 0 else -1
        base.append(slot)
        embedding_slots.append(slot if lora_id > 0 else 0)
        if offsets is not None:
            long_lora.append(offsets.get(lora_id, 0))
    sampler = []
    for lora_id in prompt_mapping:
        sampler.append(lora_index_to_id.index(lora_id) if lora_id > 0 else -1)
    P = len(sampler)
    padded = []
    for p, slot in enumerate(sampler):
        if slot == -1:
            slot = max_loras - 1
        padded.append(p + slot * P)
    T = len(base)
    return {
        "base_indices": base,
        "sampler_indices": sampler,
        "sampler_indices_padded": padded,
        "embeddings_indices": [
            [e * extra for e in embedding_slots],
            [e * (vocab_size + extra) for e in embedding_slots],
        ],
        "long_lora_indices": None if offsets is None else long_lora,
        "indices_len": [T, P, P, T, None if offsets is None else T],
    }


# -- strategies: dims first, then the mode, then values ---------------------------------


@dataclass
class Case:
    mapping: LoRAMapping
    lora_index_to_id: list[int | None]
    max_loras: int
    vocab_size: int
    extra_vocab_size: int
    offsets: dict[int, int] | None

    def run(self):
        context = None if self.offsets is None else LongContextLoRAContext(self.offsets)
        return convert_mapping(
            self.mapping,
            self.lora_index_to_id,
            self.max_loras,
            self.vocab_size,
            self.extra_vocab_size,
            DEVICE,
            context,
        )

    def expected(self):
        return plain_convert(
            self.mapping.index_mapping,
            self.mapping.prompt_mapping,
            self.lora_index_to_id,
            self.max_loras,
            self.vocab_size,
            self.extra_vocab_size,
            self.offsets,
        )


@st.composite
def slot_tables(draw, distinct: bool = True):
    """``lora_index_to_id``: L slots, each a positive id or None (some None)."""
    L = draw(st.integers(1, META_LIMITS.loras), label="L")
    ids = draw(
        st.lists(
            st.integers(1, 10_000 if distinct else 4), min_size=L, max_size=L, unique=distinct
        ),
        label="ids",
    )
    empty = draw(st.lists(st.booleans(), min_size=L, max_size=L), label="empty slots")
    return [None if e else i for i, e in zip(ids, empty)]


def draw_ids(mode: str, loaded: list[int], T: int, rng: np.random.Generator):
    """T adapter ids (0 = none) and the sampled rows' ids, for one mode."""
    choices = [0] + loaded
    if mode == "none":
        return [0] * T, None
    if mode == "identical":
        return [int(rng.choice(choices))] * T, None
    if mode == "uniform":
        return [int(i) for i in rng.choice(choices, T)], None
    # "requests", as vLLM V1 fills it: one id per request, repeated per scheduled token,
    # and one sampled row per request.
    if T == 0:
        return [], []
    cuts = rng.choice(np.arange(1, T), size=min(T - 1, int(rng.integers(0, 33))), replace=False)
    bounds = [0, *sorted(int(c) for c in cuts), T]
    per_request = [int(rng.choice(choices)) for _ in bounds[1:]]
    tokens = [i for i, a, b in zip(per_request, bounds, bounds[1:]) for _ in range(b - a)]
    return tokens, per_request


@st.composite
def mapping_cases(draw, tables=None, mode: str | None = None):
    table = draw(tables if tables is not None else slot_tables(), label="lora_index_to_id")
    L = len(table)
    T = draw(st.integers(0, META_LIMITS.tokens), label="T")
    P = draw(st.integers(0, T), label="P")
    max_loras = draw(st.sampled_from([L, L + 1]), label="max_loras")  # vLLM passes L + 1
    vocab_size = draw(st.sampled_from(VOCAB_SIZES), label="vocab_size")
    extra = draw(st.sampled_from(EXTRA_VOCAB_SIZES), label="extra_vocab_size")
    long_context = draw(st.booleans(), label="long-context LoRA")
    if mode is None:
        mode = draw(st.sampled_from(ID_MODES), label="mode")
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    loaded = [i for i in table if i is not None]
    index_mapping, per_request = draw_ids(mode, loaded, T, rng)
    if per_request is not None:
        prompt_mapping = per_request
    else:
        prompt_mapping = [int(i) for i in rng.choice([0, *loaded], P)]
    offsets = None
    if long_context:  # some loaded ids get an offset, and one id that is not loaded
        offsets = {i: int(rng.integers(1, 1 << 20)) for i in loaded if rng.random() < 0.7}
        offsets[20_000] = 7
    mapping = LoRAMapping(index_mapping, prompt_mapping, is_prefill=True)
    return Case(mapping, table, max_loras, vocab_size, extra, offsets)


# -- checks -------------------------------------------------------------------------------


def assert_tensor_equals(name: str, got: torch.Tensor, want: list, shape: tuple) -> None:
    assert isinstance(got, torch.Tensor), f"{name}: {type(got).__name__}, expected a tensor"
    assert got.dtype == torch.int64, f"{name}: dtype {got.dtype}, expected torch.int64"
    assert tuple(got.shape) == shape, f"{name}: shape {tuple(got.shape)}, expected {shape}"
    assert got.device.type == torch.device(DEVICE).type, f"{name} on {got.device}"
    flat_got = got.reshape(-1).tolist()
    flat_want = np.asarray(want, dtype=np.int64).reshape(-1).tolist()
    for i, (a, b) in enumerate(zip(flat_got, flat_want)):
        where = np.unravel_index(i, shape) if shape else ()
        assert a == b, (
            f"{name} {list(shape)}: first difference at {tuple(int(w) for w in where)}: "
            f"got {a}, expected {b}"
        )


def assert_matches_model(case: Case) -> None:
    got = case.run()
    want = case.expected()
    T, P = len(case.mapping.index_mapping), len(case.mapping.prompt_mapping)
    assert_tensor_equals("base_indices", got.base_indices, want["base_indices"], (T,))
    assert_tensor_equals("sampler_indices", got.sampler_indices, want["sampler_indices"], (P,))
    assert_tensor_equals(
        "sampler_indices_padded",
        got.sampler_indices_padded,
        want["sampler_indices_padded"],
        (P,),
    )
    assert_tensor_equals(
        "embeddings_indices", got.embeddings_indices, want["embeddings_indices"], (2, T)
    )
    if want["long_lora_indices"] is None:
        assert got.long_lora_indices is None, "long_lora_indices without a long-LoRA context"
    else:
        assert_tensor_equals(
            "long_lora_indices", got.long_lora_indices, want["long_lora_indices"], (T,)
        )
    assert list(got.indices_len) == want["indices_len"], got.indices_len


# -- properties ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ID_MODES)
@given(data=st.data())
def test_convert_mapping_matches_the_plain_model(mode, data):
    assert_matches_model(data.draw(mapping_cases(mode=mode), label="case"))


@given(case=mapping_cases(tables=slot_tables(distinct=False)))
def test_duplicate_ids_map_to_the_first_slot(case):
    # Ids drawn from 1..4 over up to 16 slots: most tables hold some id twice.
    assert_matches_model(case)
    got = case.run().base_indices.tolist()
    for lora_id, slot in zip(case.mapping.index_mapping, got):
        if lora_id > 0:
            first = next(s for s, i in enumerate(case.lora_index_to_id) if i == lora_id)
            assert slot == first, f"id {lora_id} went to slot {slot}, its first slot is {first}"


@given(
    case=mapping_cases(),
    which=st.sampled_from(["index_mapping", "prompt_mapping"]),
    data=st.data(),
)
def test_an_unknown_id_raises_naming_it(case, which, data):
    loaded = {i for i in case.lora_index_to_id if i is not None}
    unknown = data.draw(st.integers(1, 30_000).filter(lambda i: i not in loaded), label="unknown")
    ids = list(getattr(case.mapping, which))
    where = data.draw(st.integers(0, len(ids)), label="position")
    ids.insert(where, unknown)
    if which == "index_mapping":
        case.mapping = LoRAMapping(ids, case.mapping.prompt_mapping)
    else:
        case.mapping = LoRAMapping(case.mapping.index_mapping, ids)
    with pytest.raises(ValueError) as raised:
        case.run()
    message = str(raised.value)
    assert re.search(rf"(?<!\d){unknown}(?!\d)", message), f"{unknown} not named in {message!r}"


# -- examples -----------------------------------------------------------------------------


def test_spec_example_by_hand():
    # Slots: 0 -> id 7, 1 -> empty, 2 -> id 3. max_loras = L + 1 = 4, as vLLM passes it.
    mapping = LoRAMapping([3, 0, 7, 7, 0], [7, 0, 3])
    context = LongContextLoRAContext({3: 4096})
    got = convert_mapping(mapping, [7, None, 3], 4, 512, 256, DEVICE, context)
    assert got.base_indices.tolist() == [2, -1, 0, 0, -1]
    assert got.sampler_indices.tolist() == [0, -1, 2]
    assert got.sampler_indices_padded.tolist() == [0 + 0 * 3, 1 + 3 * 3, 2 + 2 * 3]
    assert got.embeddings_indices.tolist() == [
        [2 * 256, 0, 0, 0, 0],
        [2 * 768, 0, 0, 0, 0],
    ]
    assert got.long_lora_indices.tolist() == [4096, 0, 0, 0, 0]
    assert got.indices_len == [5, 3, 3, 5, 5]


def test_ids_at_or_below_zero_mean_no_lora():
    mapping = LoRAMapping([-3, 0, 5, -1], [-2, 5])
    got = convert_mapping(mapping, [None, 5], 3, 512, 256, DEVICE)
    assert got.base_indices.tolist() == [-1, -1, 1, -1]
    assert got.sampler_indices.tolist() == [-1, 1]
    assert got.sampler_indices_padded.tolist() == [0 + 2 * 2, 1 + 1 * 2]
    assert got.embeddings_indices.tolist() == [[0, 0, 256, 0], [0, 0, 768, 0]]
    assert got.long_lora_indices is None
    assert got.indices_len == [4, 2, 2, 4, None]


def test_empty_mapping():
    got = convert_mapping(LoRAMapping([], []), [None, 1], 3, 32000, 512, DEVICE)
    for name in ("base_indices", "sampler_indices", "sampler_indices_padded"):
        tensor = getattr(got, name)
        assert tensor.dtype == torch.int64 and tuple(tensor.shape) == (0,), name
    assert tuple(got.embeddings_indices.shape) == (2, 0)
    assert got.indices_len == [0, 0, 0, 0, None]


@pytest.mark.parametrize("which", ["index_mapping", "prompt_mapping"])
def test_unknown_id_with_every_slot_empty(which):
    ids = {"index_mapping": [0], "prompt_mapping": [0], which: [0, 42]}
    with pytest.raises(ValueError, match=r"(?<!\d)42(?!\d)"):
        convert_mapping(LoRAMapping(**ids), [None, None], 3, 512, 256, DEVICE)


def test_lora_mapping_turns_lists_into_tuples():
    mapping = LoRAMapping([1, 0, np.int64(2)], [2])
    assert isinstance(mapping.index_mapping, tuple)
    assert isinstance(mapping.prompt_mapping, tuple)
    assert mapping.index_mapping == (1, 0, 2)
    assert all(type(i) is int for i in mapping.index_mapping)
    assert mapping.prompt_mapping == (2,)
    assert mapping.is_prefill is False
    # Equality is the dataclass ==: lists and tuples with equal ids give equal mappings.
    assert mapping == LoRAMapping((1, 0, 2), (2,))
    assert mapping != LoRAMapping((1, 0, 2), (2,), is_prefill=True)
    assert mapping != LoRAMapping((1, 0, 1), (2,))


def test_convert_mapping_is_vectorised():
    """100_000 tokens over 1024 slots take well under a second.

    The SPEC's per-token loop pays one ``lora_index_to_id.index`` scan per token, about
    a second here (tokens use the last-loaded adapters); a vectorised lookup does not.
    """
    rng = np.random.default_rng(0)
    table = [None, *range(1001, 2024)]  # 1024 slots, the first one empty
    T = 100_000
    index_mapping = [int(i) for i in rng.choice([0, *table[-32:]], T)]
    prompt_mapping = index_mapping[: T // 2]
    mapping = LoRAMapping(index_mapping, prompt_mapping)
    offsets = {i: 4096 * k for k, i in enumerate(table[1:])}
    context = LongContextLoRAContext(offsets)

    def timed(fn):
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result

    runs = [timed(lambda: convert_mapping(mapping, table, 1025, 32000, 256, DEVICE, context))]
    runs += [timed(lambda: convert_mapping(mapping, table, 1025, 32000, 256, DEVICE, context))]
    ours, got = min(runs, key=lambda run: run[0])
    loop, want = timed(
        lambda: plain_convert(index_mapping, prompt_mapping, table, 1025, 32000, 256, offsets)
    )
    assert got.base_indices.tolist() == want["base_indices"]
    assert got.sampler_indices_padded.tolist() == want["sampler_indices_padded"]
    assert got.long_lora_indices.tolist() == want["long_lora_indices"]
    assert ours < 0.25, f"convert_mapping took {ours:.3f} s for {T} tokens"
    assert ours * 5 < loop, f"convert_mapping {ours:.3f} s vs a per-token loop {loop:.3f} s"
