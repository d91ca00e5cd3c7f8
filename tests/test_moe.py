"""MoE LoRA: the (token, expert) pairs sorted into blocks, and the dense reference.

1. ``moe_meta.align_pairs`` equals the blocks built pair by pair in plain Python, for
   any routing, slots (-1, off, out of range), experts (-1, out of range, unused),
   block size, expert map and padding; it leaves its inputs alone and rejects bad
   arguments before any work.
2. Walking the blocks (what a kernel does: a block loads its slot's and expert's A
   and B and runs its pairs) gives ``reference.fused_moe_lora``, for the gate/up
   projection (rows per token) and the down projection (rows per pair, weighted).
3. On a GPU: no sync with the host, and a CUDA graph of it replays what it computes
   eagerly for new routings.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba import reference
from punica_numba.moe_meta import MoEBlocks, align_pairs, aligned_sizes

from .strategies import DEVICE


class Routing:
    """One drawn MoE call: tokens' slots, their experts, the flags, and the sizes."""

    def __init__(self, draw):
        self.max_loras = draw(st.integers(1, 4), label="L")
        self.num_experts = draw(st.integers(1, 6), label="E")
        self.block_size = draw(st.integers(1, 5), label="block_size")
        self.num_tokens = draw(st.integers(0, 9), label="M")
        self.top_k = draw(st.integers(1, min(4, self.num_experts)), label="top_k")
        L, E, M = self.max_loras, self.num_experts, self.num_tokens
        # Slots: -1 and (rarely) one past the last, which no row takes.
        self.slots = draw(st.lists(st.integers(-1, L), min_size=M, max_size=M), label="slots")
        self.experts = [
            draw(st.lists(st.integers(-1, E), min_size=self.top_k, max_size=self.top_k))
            for _ in range(M)
        ]
        self.enabled = draw(st.lists(st.booleans(), min_size=L, max_size=L), label="enabled")
        self.pad_sorted_ids = draw(st.booleans(), label="pad_sorted_ids")
        self.expert_map = None
        if draw(st.booleans(), label="expert map"):
            self.expert_map = draw(
                st.lists(st.integers(-1, E - 1), min_size=E, max_size=E), label="expert_map"
            )

    def tensors(self) -> dict:
        M, k = self.num_tokens, self.top_k
        return dict(
            topk_ids=torch.tensor(self.experts, dtype=torch.int32, device=DEVICE).reshape(M, k),
            token_lora_mapping=torch.tensor(self.slots + [-1], dtype=torch.int64, device=DEVICE),
            num_experts=self.num_experts,
            block_size=self.block_size,
            max_loras=self.max_loras,
            adapter_enabled=torch.tensor(self.enabled + [True], device=DEVICE).to(torch.int32),
            expert_map=None
            if self.expert_map is None
            else torch.tensor(self.expert_map, dtype=torch.int32, device=DEVICE),
            pad_sorted_ids=self.pad_sorted_ids,
        )


routings = st.composite(lambda draw: Routing(draw))


def blocks_pair_by_pair(r: Routing) -> MoEBlocks:
    """The blocks as the module docstring says, one pair at a time."""
    P = r.num_tokens * r.top_k
    padded_len, num_blocks = aligned_sizes(P, r.num_experts, r.block_size, r.pad_sorted_ids)
    rows = [[P] * padded_len for _ in range(r.max_loras)]
    experts = [[-1] * num_blocks for _ in range(r.max_loras)]
    totals = [0] * r.max_loras
    for slot in range(r.max_loras):
        if not r.enabled[slot]:
            continue
        column = 0
        for e in range(r.num_experts):
            run = [p for p in range(P) if r.slots[p // r.top_k] == slot
                   and r.experts[p // r.top_k][p % r.top_k] == e]  # fmt: skip
            if not run:
                continue
            rows[slot][column : column + len(run)] = run
            length = math.ceil(len(run) / r.block_size) * r.block_size
            name = e if r.expert_map is None else r.expert_map[e]
            for b in range(column // r.block_size, (column + length) // r.block_size):
                experts[slot][b] = name
            column += length
        totals[slot] = column
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return MoEBlocks(
        torch.tensor(rows, **i32).reshape(r.max_loras, padded_len),
        torch.tensor(experts, **i32).reshape(r.max_loras, num_blocks),
        torch.tensor(totals, **i32),
    )


# -- 1. the blocks ---------------------------------------------------------------------------


@given(routings())
def test_align_pairs_gives_the_blocks_built_pair_by_pair(r):
    args = r.tensors()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    got = align_pairs(**args)
    want = blocks_pair_by_pair(r)
    for name, g, w in zip(MoEBlocks._fields, got, want):
        assert g.dtype == torch.int32 and g.device == w.device, name
        assert torch.equal(g, w), f"{name}:\n got {g.tolist()}\nwant {w.tolist()}"
    for name, value in before.items():
        assert torch.equal(args[name], value), f"align_pairs changed {name}"


def test_every_pair_of_one_slot_and_expert_shares_blocks():
    """A named case: 5 tokens, top-2 of 3 experts, two slots, blocks of 2."""
    topk = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [1, 1]], device=DEVICE)
    slots = torch.tensor([1, 0, 1, -1, 0], device=DEVICE)
    on = torch.ones(2, dtype=torch.int32, device=DEVICE)
    blocks = align_pairs(topk, slots, 3, 2, 2, on)
    P = 10  # padding value; pairs are t * 2 + k
    # slot 0: tokens 1 and 4 -> pairs 2 (e2), 3 (e1), 8 (e1), 9 (e1)
    # slot 1: tokens 0 and 2 -> pairs 0 (e0), 1 (e2), 4 (e0), 5 (e1)
    padded_len = 10 + 3 * 1
    assert blocks.sorted_token_ids.tolist() == [
        [3, 8, 9, P, 2, P] + [P] * (padded_len - 6),
        [0, 4, 5, P, 1, P] + [P] * (padded_len - 6),
    ]
    assert blocks.expert_ids.tolist() == [[1, 1, 2, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1]]
    assert blocks.num_tokens_post_padded.tolist() == [6, 6]


BAD = {
    "topk_ids float": (dict(topk_ids=torch.zeros(2, 2)), TypeError, "topk_ids"),
    "topk_ids 1-D": (dict(topk_ids=torch.zeros(4, dtype=torch.int32)), ValueError, "topk_ids"),
    "mapping too short": (
        dict(token_lora_mapping=torch.zeros(1, dtype=torch.int32)),
        ValueError,
        "token_lora_mapping",
    ),
    "flags too short": (
        dict(adapter_enabled=torch.ones(1, dtype=torch.int32)),
        ValueError,
        "adapter_enabled",
    ),
    "expert_map of another length": (
        dict(expert_map=torch.zeros(2, dtype=torch.int32)),
        ValueError,
        "expert_map",
    ),
    "block_size 0": (dict(block_size=0), ValueError, "block_size"),
    "num_experts a float": (dict(num_experts=3.0), TypeError, "num_experts"),
    "pad_sorted_ids an int": (dict(pad_sorted_ids=1), TypeError, "pad_sorted_ids"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_rejected_by_name(case):
    change, error, name = BAD[case]
    args = dict(
        topk_ids=torch.zeros(2, 2, dtype=torch.int32),
        token_lora_mapping=torch.zeros(2, dtype=torch.int32),
        num_experts=3,
        block_size=2,
        max_loras=2,
        adapter_enabled=torch.ones(2, dtype=torch.int32),
    )
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    change = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()}
    with pytest.raises(error, match=name):
        align_pairs(**{**args, **change})


# -- 2. through the blocks, as a kernel walks them -------------------------------------------


def through_the_blocks(y, x, lora_a, lora_b, blocks, block_size, topk_weights, mul_routed_weight):
    """Each block of each row: its slot's and expert's A and B on its pairs."""
    out = y.to(torch.float64).clone()
    M, top_k = topk_weights.shape
    width = lora_b[0].shape[2]
    for slot, (row, experts) in enumerate(zip(blocks.sorted_token_ids, blocks.expert_ids)):
        for b, e in enumerate(experts.tolist()):
            if e == -1:
                continue
            for p in row[b * block_size : (b + 1) * block_size].tolist():
                if p >= M * top_k:  # padding
                    continue
                t, k = divmod(p, top_k)
                x_row = x[p if mul_routed_weight else t].to(torch.float64)
                w = float(topk_weights[t, k]) if mul_routed_weight else 1.0
                for s, (a, b_) in enumerate(zip(lora_a, lora_b)):
                    delta = b_[slot, e].double() @ (a[slot, e].double() @ x_row)
                    out[t, k, s * width : (s + 1) * width] += w * delta
    return out


@given(routings(), st.sampled_from(["w13", "w2"]), st.integers(0, 2**31 - 1))
def test_walking_the_blocks_gives_the_reference(r, projection, seed):
    r.expert_map = None  # (the weights are indexed by the global expert here)
    # An expert past the last is in no block; the reference knows -1 for "no expert".
    r.experts = [[e if e < r.num_experts else -1 for e in row] for row in r.experts]
    slices, mul = (2, False) if projection == "w13" else (1, True)
    gen = torch.Generator().manual_seed(seed)
    L, E, M, k = r.max_loras, r.num_experts, r.num_tokens, r.top_k
    K, rank, N = 5, 3, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    x = randn(M * k if mul else M, K)
    lora_a = [randn(L, E, rank, K) for _ in range(slices)]
    lora_b = [randn(L, E, N, rank) for _ in range(slices)]
    y = randn(M, k, slices * N)
    weights = randn(M, k)
    args = r.tensors()
    blocks = align_pairs(**args)
    got = through_the_blocks(y, x, lora_a, lora_b, blocks, r.block_size, weights, mul)
    want = reference.fused_moe_lora(
        y,
        x,
        lora_a,
        lora_b,
        args["topk_ids"],
        weights,
        # (a slot past the last is in no row; the reference would index past the stacks)
        torch.where(args["token_lora_mapping"][:M] >= L, -1, args["token_lora_mapping"][:M]),
        mul_routed_weight=mul,
        adapter_enabled=args["adapter_enabled"],
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_reference_weights_the_down_projection_and_offsets_its_columns():
    """One token, one expert, rank 1: the numbers by hand."""
    x = torch.tensor([[2.0, 3.0]])  # one pair (top_k 1), rows per pair
    a = [torch.tensor([[[[1.0, 1.0]]]])]  # [L=1, E=1, r=1, K=2]
    b = [torch.tensor([[[[1.0], [10.0]]]])]  # [1, 1, N=2, 1]
    y = torch.zeros(1, 1, 3)
    out = reference.fused_moe_lora(
        y, x, a, b, torch.tensor([[0]]), torch.tensor([[0.5]]), torch.tensor([0]),
        mul_routed_weight=True, offset=1,
    )  # fmt: skip
    assert out.tolist() == [[[0.0, 2.5, 25.0]]]  # 0.5 * (2 + 3) * [1, 10], from column 1
    off = reference.fused_moe_lora(
        y, x, a, b, torch.tensor([[0]]), torch.tensor([[0.5]]), torch.tensor([0]),
        adapter_enabled=torch.tensor([0]),
    )  # fmt: skip
    assert not off.any()


# -- 3. on a GPU: graph-safe -----------------------------------------------------------------


@pytest.mark.gpu
def test_align_pairs_never_syncs_and_replays_in_a_graph():
    gen = torch.Generator().manual_seed(0)
    M, top_k, E, L, B = 37, 4, 16, 3, 8

    def routing():
        return (
            torch.randint(-1, E, (M, top_k), generator=gen).to(DEVICE),
            torch.randint(-1, L, (M,), generator=gen).to(DEVICE),
        )

    topk_ids, slots = routing()
    on = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    torch.cuda.set_sync_debug_mode("error")
    try:
        align_pairs(topk_ids, slots, E, B, L, on)  # (warm-up: raises on any sync)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = align_pairs(topk_ids, slots, E, B, L, on)
    for _ in range(3):
        new_ids, new_slots = routing()
        topk_ids.copy_(new_ids), slots.copy_(new_slots)
        graph.replay()
        eager = align_pairs(topk_ids, slots, E, B, L, on)
        for name, g, w in zip(MoEBlocks._fields, captured, eager):
            assert torch.equal(g, w), name
