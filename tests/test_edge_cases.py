"""Edge cases that must work, through the ops and through the wrapper, against the reference.

Each edge case changes one thing of an ordinary problem (7 tokens on 3 slots, H=10, r=3,
two slices) to its extreme: no token at all, no token with a LoRA, one slot, rank 1,
hidden size 1, one slice of width 1, and a batch that fills the metadata (T equal to
``max_num_tokens`` / ``max_num_batched_tokens``). The ops are checked with the property
tests' checks (:mod:`tests.op_cases`), the wrapper with :mod:`punica_numba.reference`;
both within :mod:`tests.tolerance`, and bit for bit where nothing may change.
``test_mutants.py`` plants one bug per edge case and shows these checks catch it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from punica_numba import LoRAKernelMeta, LoRAMapping, lora_expand, lora_shrink, reference
from punica_numba.wrapper import PunicaWrapperNumba

from .op_cases import ExpandCase, Problem, ShrinkCase, check_expand, check_shrink
from .strategies import DEVICE, DTYPES, random_tensor
from .tolerance import assert_close


@dataclass(frozen=True)
class Edge:
    """An ordinary problem with one thing taken to its extreme.

    ``slots`` has one entry per activation row; rows past ``prepared`` are CUDA-graph
    padding (slot -1, not in the mapping). ``full``: the metadata and the wrapper hold
    exactly ``len(slots)`` tokens, no more.
    """

    slots: tuple[int, ...] = (0, 2, -1, 1, 2, 2, 0)
    prepared: int | None = None  # tokens in the mapping; None: every row
    num_loras: int = 3
    hidden: int = 10
    rank: int = 3
    widths: tuple[int, ...] = (5, 2)
    full: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    @property
    def mapped(self) -> int:
        return self.num_tokens if self.prepared is None else self.prepared

    @property
    def capacity(self) -> int:
        return self.num_tokens if self.full else self.num_tokens + 3


ORDINARY = Edge()
EDGES: dict[str, Edge] = {
    "T = 0": Edge(slots=()),
    "T = 0, with padded rows": Edge(slots=(-1, -1), prepared=0),
    "no token has a LoRA": Edge(slots=(-1,) * 5),
    "max_loras = 1": Edge(slots=(0, -1, 0, 0, -1, 0), num_loras=1),
    "rank 1": Edge(rank=1),
    "hidden 1": Edge(hidden=1),
    "one slice of width 1": Edge(widths=(1,)),
    "T == max tokens": Edge(full=True),
}


@dataclass
class _EdgeProblem(Problem):
    """A problem whose metadata holds ``capacity`` tokens (the property tests' hold T + 2)."""

    capacity: int = field(default=0)

    def meta(self) -> LoRAKernelMeta:
        meta = LoRAKernelMeta.make(self.num_loras, self.capacity, DEVICE)
        meta.prepare_tensors(torch.tensor(self.slots[: self.prepared], dtype=torch.int64))
        return meta


def _problem(edge: Edge, seed: int) -> Problem:
    return _EdgeProblem(list(edge.slots), edge.mapped, edge.num_loras, seed, edge.capacity)


def shrink_case(edge: Edge, dtype: torch.dtype, seed: int = 1) -> ShrinkCase:
    return ShrinkCase(
        problem=_problem(edge, seed),
        hidden=edge.hidden,
        rank=edge.rank,
        num_slices=len(edge.widths),
        extra_slices=1,
        dtype=dtype,
        out_dtype=torch.float32,
        scaling=0.5,
        four_d=True,
    )


def expand_case(edge: Edge, dtype: torch.dtype, seed: int = 2) -> ExpandCase:
    return ExpandCase(
        problem=_problem(edge, seed),
        rank=edge.rank,
        widths=list(edge.widths),
        offset_start=1,
        extra_columns=1,
        x_dtype=torch.float32,
        w_dtype=dtype,
        out_dtype=dtype,
        add_inputs=True,
        four_d=False,
        strided_input=True,
    )


def check_op_edge(edge: Edge, dtype: torch.dtype, shrink=lora_shrink, expand=lora_expand):
    """The ops (or implementations with their signatures) on one edge case."""
    check_shrink(shrink, shrink_case(edge, dtype))
    check_expand(expand, expand_case(edge, dtype))


# -- through the wrapper -------------------------------------------------------------------


def _ids(slots) -> tuple[int, ...]:
    """Adapter ids for slots: slot s holds adapter 11 + s; 0 is no LoRA."""
    return tuple(0 if s == -1 else 11 + s for s in slots)


def _wrapper(edge: Edge) -> PunicaWrapperNumba:
    """A wrapper whose token and sampler mappings are both the edge's mapped tokens."""
    wrapper = PunicaWrapperNumba(max(edge.capacity, 1), 4, DEVICE, max_loras=edge.num_loras)
    ids = _ids(edge.slots[: edge.mapped])
    wrapper.update_metadata(
        LoRAMapping(ids, ids, is_prefill=True),
        [11 + s for s in range(edge.num_loras)],
        edge.num_loras + 1,
        vocab_size=32,
        extra_vocab_size=0,
    )
    return wrapper


def _assert_rows_kept(got, before, slots, what):
    untouched = slots == -1
    assert torch.equal(got[untouched], before[untouched]), f"{what}: rows without a LoRA changed"


def _abs(tensors):
    return [None if t is None else t.abs() for t in tensors]


def check_wrapper_edge(edge: Edge, dtype: torch.dtype, seed: int = 3) -> None:
    """add_lora_linear, add_lora_logits and add_lora_embedding on one edge case."""
    T, H, r, L = edge.num_tokens, edge.hidden, edge.rank, edge.num_loras
    widths = list(edge.widths)
    slots = torch.tensor(edge.slots, dtype=torch.int64, device=DEVICE)
    wrapper = _wrapper(edge)

    def data(shape, k):
        return random_tensor(shape, dtype, seed * 100 + k)

    # A LoRA linear layer: shrink, expand and a bias, slice by slice.
    x = data((T, H), 0)
    a = tuple(data((L, 1, r, H), 1 + s) for s in range(len(widths)))
    b = tuple(data((L, 1, n, r), 11 + s) for s, n in enumerate(widths))
    bias = tuple(data((L, 1, n), 21 + s) for s, n in enumerate(widths))
    y = data((T, sum(widths)), 31)
    before = y.clone()
    wrapper.add_lora_linear(y, x, a, b, bias, 0.5, widths)
    want = reference.add_lora_linear(before, x, a, b, bias, 0.5, widths, slots)
    magnitude = reference.add_lora_linear(
        before.abs(), x.abs(), _abs(a), _abs(b), _abs(bias), 0.5, widths, slots
    )
    _assert_rows_kept(y, before, slots, "add_lora_linear")
    assert_close(y, want, magnitude, terms=H + r, what=f"edge add_lora_linear {dtype}")

    # The LM head: the sampler mapping, and logits wider than the LoRA's B.
    vocab = sum(widths) + 2
    a_head, b_head = data((L, 1, r, H), 41), data((L, 1, vocab - 2, r), 42)
    logits = data((T, vocab), 43)
    before = logits.clone()
    wrapper.add_lora_logits(logits, x, a_head, b_head, 0.25)
    want = reference.add_lora_logits(before, x, a_head, b_head, 0.25, slots)
    magnitude = reference.add_lora_logits(
        before.abs(), x.abs(), a_head.abs(), b_head.abs(), 0.25, slots
    )
    _assert_rows_kept(logits, before, slots, "add_lora_logits")
    assert_close(logits, want, magnitude, terms=H + r, what=f"edge add_lora_logits {dtype}")

    # The embedding: x is each token's looked-up row of A.
    rows, b_embed = data((T, r), 51), data((L, 1, widths[0], r), 52)
    out = data((T, widths[0]), 53)
    before = out.clone()
    wrapper.add_lora_embedding(out, rows, b_embed, add_inputs=True)
    want = reference.add_lora_embedding(before, rows, b_embed, slots, add_inputs=True)
    magnitude = reference.add_lora_embedding(before.abs(), rows.abs(), b_embed.abs(), slots)
    _assert_rows_kept(out, before, slots, "add_lora_embedding")
    assert_close(out, want, magnitude, terms=r, what=f"edge add_lora_embedding {dtype}")


# -- the tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("edge", EDGES, ids=str)
def test_ops_edge_case(edge, dtype):
    check_op_edge(EDGES[edge], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("edge", EDGES, ids=str)
def test_wrapper_edge_case(edge, dtype):
    check_wrapper_edge(EDGES[edge], dtype)


@pytest.mark.gpu
def test_logits_offsets_past_two_to_the_31_elements():
    """add_lora_logits where slot 2 of B starts 2**31 elements in: 64-bit addressing.

    B is [3, 1, 2**26, 16] bf16 (6 GiB). Only a few columns at both ends of the logits
    are checked, against a float64 computation of just those columns.
    """
    slots_in_b, vocab, rank, hidden = 3, 1 << 26, 16, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = torch.empty(slots_in_b, 1, vocab, rank, dtype=torch.bfloat16, device="cuda")
    b.normal_(generator=gen)
    a = torch.randn(slots_in_b, 1, rank, hidden, generator=gen, device="cuda").bfloat16()
    x = torch.randn(3, hidden, generator=gen, device="cuda").bfloat16()
    y = torch.randn(3, vocab, generator=gen, device="cuda").bfloat16()
    before = y.clone()

    wrapper = PunicaWrapperNumba(4, 4, "cuda", max_loras=slots_in_b)
    sampled = (2, -1, 0)  # row 0 on slot 2 (its B starts at element 2 * 2**26 * 16 = 2**31)
    wrapper.update_metadata(
        LoRAMapping(_ids(sampled), _ids(sampled)), [11, 12, 13], slots_in_b + 1, vocab, 0
    )
    wrapper.add_lora_logits(y, x, a, b, scale=0.5)

    assert torch.equal(y[1], before[1]), "the row without a LoRA changed"
    columns = torch.tensor([0, 1, 2, 3, vocab - 4, vocab - 3, vocab - 2, vocab - 1], device="cuda")
    for row, slot in ((0, 2), (2, 0)):
        xa = 0.5 * (x[row].double() @ a[slot, 0].double().T)  # [r]
        b_cols = b[slot, 0, columns].double()  # [8, r]
        want = before[row, columns].double() + b_cols @ xa
        xa_abs = 0.5 * (x[row].double().abs() @ a[slot, 0].double().abs().T)
        magnitude = before[row, columns].double().abs() + b_cols.abs() @ xa_abs
        assert_close(
            y[row, columns], want, magnitude, terms=hidden + rank, what="logits past 2**31"
        )
