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
4. The op, with the kernels of every version, and the wrapper's calls give the
   reference; version 3's tiles are crossed (rank groups, chunks of a block's pairs,
   column groups, K in whole words or not), and version 4's (rank groups, passes and
   m-tiles of a block's pairs, column groups, K and ranks past whole tiles), with its
   gate: what the tensor cores cannot take runs version 3's kernels; version 5 takes
   version 4's shrink on either side of its threshold of pairs a block as designed;
   version 6 stores version 5's bits on every drawn call, its expand version 3's bits
   (in words, 16-byte pairs of words and element by element), its tensor-core shrink
   version 5's (both slices together, runs of blocks), and its compact grids take every
   block whatever their size.
"""

from __future__ import annotations

import functools
import json
import math
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import bench_moe, reference
from punica_numba._cuda import cuda
from punica_numba.launch import config_name
from punica_numba.mapping import LoRAMapping
from punica_numba.moe_meta import MoEBlocks, align_pairs, aligned_sizes
from punica_numba.ops import moe as moe_ops
from punica_numba.ops import moe_dense
from punica_numba.ops.moe import VERSIONS, fused_moe_lora
from punica_numba.wrapper import PunicaWrapperNumba

from .strategies import DEVICE, LARGE
from .tolerance import assert_close

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
def test_align_pairs_never_syncs_and_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(0)
    M, top_k, E, L, B = 37, 4, 16, 3, 8

    def routing():
        return (
            torch.randint(-1, E, (M, top_k), generator=gen).to(DEVICE),
            torch.randint(-1, L, (M,), generator=gen).to(DEVICE),
        )

    topk_ids, slots = routing()
    on = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    with warnings.catch_warnings():  # (torch warns that the debug mode is a prototype)
        warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)
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


# -- 4. the op and the wrapper against the reference -----------------------------------------

LARGE_MOE = LARGE  # the gpu profile on a GPU: real layer sizes (Qwen3-30B-A3B and larger)


class MoECase:
    """A drawn MoE LoRA call: dims first, then the routing, then a seed for the data."""

    def __init__(self, draw):
        if LARGE_MOE:
            self.E = draw(st.sampled_from([64, 128]), label="E")
            self.top_k = 8
            hidden = draw(st.sampled_from([2048, 4096]), label="hidden")
            inter = draw(st.sampled_from([768, 1536]), label="intermediate")
            self.r = draw(st.sampled_from([16, 32, 64]), label="r")
            self.M = draw(st.integers(1, 32), label="M")
            self.L = draw(st.integers(1, 4), label="L")
            self.B = draw(st.sampled_from([16, 32, 64]), label="block_size")
        else:
            self.E = draw(st.integers(1, 4), label="E")
            self.top_k = draw(st.integers(1, min(2, self.E)), label="top_k")
            hidden = draw(st.integers(1, 8), label="hidden")
            inter = draw(st.integers(1, 6), label="intermediate")
            self.r = draw(st.integers(1, 4), label="r")
            self.M = draw(st.integers(1, 6), label="M")
            self.L = draw(st.integers(1, 3), label="L")
            self.B = draw(st.integers(1, 3), label="block_size")
        self.projection = draw(st.sampled_from(["w13", "w2"]), label="projection")
        self.mul = self.projection == "w2"
        self.S = 2 if self.projection == "w13" else 1
        self.K, self.N = (hidden, inter) if self.projection == "w13" else (inter, hidden)
        self.offset = draw(st.integers(0, 2), label="offset")
        self.add_inputs = draw(st.booleans(), label="add_inputs")
        self.dtype = draw(st.sampled_from(DTYPES), label="dtype")
        self.slots = draw(st.lists(st.integers(-1, self.L - 1), min_size=self.M, max_size=self.M))
        self.enabled = draw(st.lists(st.booleans(), min_size=self.L, max_size=self.L))
        self.seed = draw(st.integers(0, 2**31 - 1), label="data seed")

    def data(self):
        # (made on the device: the gpu profile's stacks hold up to 2 x 67M elements)
        gen = torch.Generator(device=DEVICE).manual_seed(self.seed)
        M, k, dt = self.M, self.top_k, self.dtype

        def randn(*shape, dtype=dt):
            return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)

        # Distinct experts per token (as a router picks them); -1 now and then.
        experts = torch.stack(
            [torch.randperm(self.E, generator=gen, device=DEVICE)[:k] for _ in range(M)]
        )
        experts[torch.rand(M, k, generator=gen, device=DEVICE) < 0.1] = -1
        return dict(
            y=randn(M, k, self.offset + self.S * self.N + 1),
            x=randn(M * k if self.mul else M, self.K),
            lora_a=[randn(self.L, self.E, self.r, self.K) * 0.5 for _ in range(self.S)],
            lora_b=[randn(self.L, self.E, self.N, self.r) * 0.5 for _ in range(self.S)],
            topk_ids=experts,
            topk_weights=torch.rand(M, k, generator=gen, device=DEVICE),
            slots=torch.tensor(self.slots, dtype=torch.int64, device=DEVICE),
            enabled=torch.tensor(self.enabled, dtype=torch.int32, device=DEVICE),
        )


moe_cases = st.composite(lambda draw: MoECase(draw))


def check_against_reference(case: MoECase, y, d, before) -> None:
    """y (after the call) against the reference; what no pair reaches, bit for bit."""
    args = (d["topk_ids"], d["topk_weights"], d["slots"])
    options = dict(mul_routed_weight=case.mul, offset=case.offset, adapter_enabled=d["enabled"])
    want = reference.fused_moe_lora(
        before, d["x"], d["lora_a"], d["lora_b"], *args, **options, add_inputs=case.add_inputs
    )
    magnitude = reference.fused_moe_lora(
        before.abs(), d["x"].abs(), [a.abs() for a in d["lora_a"]],
        [b.abs() for b in d["lora_b"]], d["topk_ids"], d["topk_weights"].abs(), d["slots"],
        **options,
    )  # fmt: skip
    assert_close(y, want, magnitude, terms=case.K + case.r, what=f"fused_moe_lora {case.dtype}")
    on = d["enabled"].to(torch.bool)[d["slots"].clamp(min=0)] & (d["slots"] != -1)
    reached = on[:, None] & (d["topk_ids"] != -1)  # [M, top_k]
    assert torch.equal(y[~reached], before[~reached]), "a pair without a LoRA changed"
    columns = slice(case.offset, case.offset + case.S * case.N)
    outside = torch.ones(y.shape[2], dtype=torch.bool)
    outside[columns] = False
    assert torch.equal(y[:, :, outside], before[:, :, outside]), "a column past the slices changed"


#: Examples a property draws at most: at the gpu profile's sizes one example makes ~0.5
#: GB of weights and a float64 reference of up to 256 pairs.
MOE_EXAMPLES = settings(max_examples=min(settings().max_examples, 40))


@pytest.mark.parametrize("version", VERSIONS)
@MOE_EXAMPLES
@given(moe_cases())
def test_fused_moe_lora_matches_the_reference(version, case):
    d = case.data()
    blocks = align_pairs(d["topk_ids"], d["slots"], case.E, case.B, case.L, d["enabled"])
    y, before = d["y"], d["y"].clone()
    fused_moe_lora(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
        block_size=case.B, mul_routed_weight=case.mul, offset=case.offset,
        add_inputs=case.add_inputs, version=version,
    )  # fmt: skip
    check_against_reference(case, y, d, before)


@MOE_EXAMPLES
@given(moe_cases())
def test_version_6_gives_version_5s_bits(case):
    """Version 6 takes version 5's shrink wherever 5 does, in kernels that make the same
    products in the same order (both slices in one CUDA block, runs of blocks, compact
    grids), and an expand that makes version 3's sums in the same order: on every call the
    same bits as version 5."""
    d = case.data()
    blocks = align_pairs(d["topk_ids"], d["slots"], case.E, case.B, case.L, d["enabled"])
    results = []
    for version in (5, 6):
        y = d["y"].clone()
        fused_moe_lora(
            y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
            block_size=case.B, mul_routed_weight=case.mul, offset=case.offset,
            add_inputs=case.add_inputs, version=version,
        )  # fmt: skip
        results.append(y)
    bits = torch.int16 if results[0].element_size() == 2 else torch.int32
    differ = results[1].view(bits) != results[0].view(bits)
    assert not bool(differ.any()), f"different bits at {torch.nonzero(differ)[0].tolist()}"


def _wrapper_of(case: MoECase) -> PunicaWrapperNumba:
    """A wrapper whose step puts the case's tokens on their slots (adapter ids 101...)."""
    wrapper = PunicaWrapperNumba(case.M + 2, 4, DEVICE, max_loras=case.L)
    ids = [101 + s if s >= 0 else 0 for s in case.slots]
    adapters = [101 + s for s in range(case.L)]
    wrapper.update_metadata(LoRAMapping(ids, ids), adapters, case.L + 1, 32, 0)
    return wrapper


@MOE_EXAMPLES
@given(moe_cases())
def test_the_wrappers_moe_calls_match_the_reference(case):
    """vLLM's two calls: align the step's pairs, then the fused MoE LoRA on them."""
    d = case.data()
    wrapper = _wrapper_of(case)
    _, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(
        d["topk_ids"], case.M, case.B, case.E, case.L, d["enabled"]
    )
    y, before = d["y"], d["y"].clone()
    wrapper.add_lora_fused_moe(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], sorted_ids.view(case.L, -1),
        expert_ids.view(case.L, -1), post, case.r, case.top_k, {"BLOCK_SIZE_M": case.B}, {},
        d["enabled"], case.mul, offset=case.offset, add_inputs=case.add_inputs,
    )  # fmt: skip
    check_against_reference(case, y, d, before)


def _moe_call():
    """A valid add_lora_fused_moe call on a fresh wrapper (2 tokens, top-2 of 3 experts)."""
    L, E, r, K, N, B = 2, 3, 2, 4, 5, 2
    wrapper = PunicaWrapperNumba(4, 4, DEVICE, max_loras=L)
    wrapper.update_metadata(LoRAMapping([101, 102], [101, 102]), [101, 102], L + 1, 32, 0)
    topk = torch.tensor([[0, 2], [1, 2]], device=DEVICE)
    on = torch.ones(L, dtype=torch.int32, device=DEVICE)
    _, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(topk, 2, B, E, L, on)
    call = dict(
        y=torch.zeros(2, 2, 2 * N, device=DEVICE),
        x=torch.randn(2, K, device=DEVICE),
        lora_a_stacked=[torch.randn(L, E, r, K, device=DEVICE) for _ in range(2)],
        lora_b_stacked=[torch.randn(L, E, N, r, device=DEVICE) for _ in range(2)],
        topk_weights=torch.rand(2, 2, device=DEVICE),
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=post,
        max_lora_rank=r,
        top_k_num=2,
        shrink_config={"BLOCK_SIZE_M": B},
        expand_config={},
        adapter_enabled=on,
    )
    return wrapper, call


MOE_BAD = {
    "max_lora_rank not the stacks'": (dict(max_lora_rank=3), ValueError, "max_lora_rank"),
    "top_k_num not y's": (dict(top_k_num=3), ValueError, "top_k_num"),
    "another block size": (dict(shrink_config={"BLOCK_SIZE_M": 3}), ValueError, "block_size"),
    "x of the pairs without mul_routed_weight": (
        dict(x=torch.randn(4, 4, device=DEVICE)),
        ValueError,
        "x must be",
    ),
    "B of another rank": (
        dict(lora_b_stacked=[torch.randn(2, 3, 5, 3, device=DEVICE)] * 2),
        ValueError,
        "lora_b_stacked",
    ),
    "three slices": (
        dict(lora_a_stacked=[torch.randn(2, 3, 2, 4, device=DEVICE)] * 3),
        ValueError,
        "up to 2 slices",
    ),
    "y too narrow": (dict(y=torch.zeros(2, 2, 9, device=DEVICE)), ValueError, "columns"),
    "weights of x's dtype wrong": (
        dict(x=torch.randn(2, 4, device=DEVICE).to(torch.float16)),
        TypeError,
        "x must be",
    ),
    "fully sharded": (dict(fully_sharded=True), ValueError, "fully_sharded"),
    "naive assignment without a mapping": (
        dict(sorted_token_ids=None),
        ValueError,
        "token_lora_mapping must be given",
    ),
    "naive assignment, blocks for experts": (
        dict(sorted_token_ids=None, token_lora_mapping=torch.zeros(2, dtype=torch.int64)),
        ValueError,
        "each pair's expert",
    ),
    "flags too short": (
        dict(adapter_enabled=torch.ones(1, dtype=torch.int32, device=DEVICE)),
        ValueError,
        "adapter_enabled",
    ),
}


@pytest.mark.parametrize("case", MOE_BAD)
def test_a_bad_moe_call_is_rejected_by_name_and_changes_nothing(case):
    change, error, name = MOE_BAD[case]
    wrapper, call = _moe_call()
    call.update(change)
    before = call["y"].clone()
    with pytest.raises(error, match=name):
        wrapper.add_lora_fused_moe(**call)
    assert torch.equal(call["y"], before)


def test_an_expert_map_with_the_naive_block_assignment_is_refused_by_name():
    wrapper, _ = _moe_call()
    topk = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    on = torch.ones(2, dtype=torch.int32, device=DEVICE)
    emap = torch.arange(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="naive_block_assignment"):
        wrapper.moe_lora_align_block_size(topk, 2, 2, 3, 2, on, emap, naive_block_assignment=True)


@MOE_EXAMPLES
@given(moe_cases())
def test_the_naive_block_assignment_gives_the_reference(case):
    """vLLM 0.33's calls for sparse batches: no blocks from the align step, each pair's
    expert and the tokens' slots instead."""
    d = case.data()
    wrapper = _wrapper_of(case)
    mapping, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(
        d["topk_ids"], case.M, case.B, case.E, case.L, d["enabled"], naive_block_assignment=True
    )
    assert sorted_ids is None and post is None
    assert torch.equal(expert_ids, d["topk_ids"].reshape(-1))
    y, before = d["y"], d["y"].clone()
    wrapper.add_lora_fused_moe(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], None, expert_ids, None,
        case.r, case.top_k, {}, {}, d["enabled"], case.mul, offset=case.offset,
        token_lora_mapping=mapping, add_inputs=case.add_inputs,
    )  # fmt: skip
    check_against_reference(case, y, d, before)


def _named_call(mul_routed_weight: bool, top_k: int = 2):
    """3 tokens on slots 0, 1, 0, each on top_k of 3 experts: a fixed call of the op."""
    gen = torch.Generator().manual_seed(7)
    M, E, L, r, K, N, B = 3, 3, 2, 2, 4, 3, 2
    d = dict(
        y=torch.randn(M, top_k, N, generator=gen).to(DEVICE),
        x=torch.randn(M * top_k if mul_routed_weight else M, K, generator=gen).to(DEVICE),
        lora_a=[torch.randn(L, E, r, K, generator=gen).to(DEVICE)],
        lora_b=[torch.randn(L, E, N, r, generator=gen).to(DEVICE)],
        topk_ids=torch.tensor([[0, 2], [1, 2], [2, 0]], device=DEVICE)[:, :top_k],
        topk_weights=torch.rand(M, top_k, generator=gen).to(DEVICE),
        slots=torch.tensor([0, 1, 0], device=DEVICE),
        enabled=torch.ones(L, dtype=torch.int32, device=DEVICE),
    )
    blocks = align_pairs(d["topk_ids"], d["slots"], E, B, L, d["enabled"])
    return d, blocks, B


def _named_result(mul_routed_weight: bool = False, **options):
    """The op's and the reference's result of the named call, with ``options`` for both
    (``adapter_enabled``, ``add_inputs``)."""
    d, blocks, B = _named_call(mul_routed_weight)
    enabled = options.pop("adapter_enabled", d["enabled"])
    version = options.pop("version", 1)
    y = d["y"].clone()
    fused_moe_lora(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, enabled,
        block_size=B, mul_routed_weight=mul_routed_weight, version=version, **options,
    )  # fmt: skip
    want = reference.fused_moe_lora(
        d["y"], d["x"], d["lora_a"], d["lora_b"], d["topk_ids"], d["topk_weights"], d["slots"],
        mul_routed_weight=mul_routed_weight, adapter_enabled=enabled, **options,
    )  # fmt: skip
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    return y, want, d


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mul_routed_weight", [False, True], ids=["w13", "w2"])
def test_each_pair_reads_its_own_row_of_the_down_projection(mul_routed_weight, version):
    """w13 reads a token's row for each of its pairs; w2 (mul_routed_weight) the pair's;
    with the kernels of every version."""
    _named_result(mul_routed_weight, version=version)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_slot_turned_off_after_the_blocks_were_made_is_skipped(version):
    """The kernels read ``adapter_enabled`` themselves: blocks made while slot 1 was on
    add nothing for it once it is off."""
    off = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    y, _, d = _named_result(adapter_enabled=off, version=version)
    assert torch.equal(y[1], d["y"][1])  # token 1 is slot 1's


@pytest.mark.gpu
def test_the_wrappers_moe_calls_replay_in_a_cuda_graph():
    """Aligning and the fused MoE LoRA, captured once, replay what they compute eagerly
    for new routings (Qwen3-30B-A3B's gate/up: hidden 2048, 128 experts, top-8,
    intermediate 768; 24 tokens over 8 slots)."""
    gen = torch.Generator().manual_seed(3)
    M, top_k, E, L, r, K, N, B = 24, 8, 128, 8, 16, 2048, 768, 16
    wrapper = PunicaWrapperNumba(M, 4, DEVICE, max_loras=L)
    ids = [101 + t % L for t in range(M)]
    wrapper.update_metadata(LoRAMapping(ids, ids), [101 + s for s in range(L)], L + 1, 32, 0)
    on = torch.ones(L, dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=gen).to(DEVICE, torch.bfloat16)
    a = [(torch.randn(L, E, r, K, generator=gen) * 0.1).to(DEVICE, torch.bfloat16) for _ in "gu"]
    b = [(torch.randn(L, E, N, r, generator=gen) * 0.1).to(DEVICE, torch.bfloat16) for _ in "gu"]
    topk = torch.zeros(M, top_k, dtype=torch.int64, device=DEVICE)
    weights = torch.rand(M, top_k, generator=gen).to(DEVICE)

    def route() -> None:
        topk.copy_(torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(M)]))

    def step() -> torch.Tensor:
        y = torch.zeros(M, top_k, 2 * N, device=DEVICE, dtype=torch.bfloat16)
        _, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(topk, M, B, E, L, on)
        wrapper.add_lora_fused_moe(
            y, x, a, b, weights, sorted_ids.view(L, -1), expert_ids.view(L, -1), post, r,
            top_k, {"BLOCK_SIZE_M": B}, {}, on,
        )  # fmt: skip
        return y

    route()
    step()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        route()
        graph.replay()
        assert torch.equal(captured, step())


def test_the_wrapper_aligns_the_mapping_it_is_given_and_global_experts():
    """vLLM 0.33's expert parallelism: a token mapping of the caller's own, and global
    experts renamed by ``expert_map`` (its length is the global count)."""
    wrapper, _ = _moe_call()  # its step maps tokens 0, 1 to slots 0, 1
    topk = torch.tensor([[5, 1], [4, 5]], device=DEVICE)  # global experts of 6
    on = torch.ones(2, dtype=torch.int32, device=DEVICE)
    expert_map = torch.tensor([-1, 0, -1, -1, 1, 2], dtype=torch.int32, device=DEVICE)
    mine = torch.tensor([1, -1], device=DEVICE)  # token 0 on slot 1, token 1 on none
    used, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(
        topk, 2, 2, 3, 2, on, expert_map, token_lora_mapping=mine
    )
    assert used is mine
    want = align_pairs(topk, mine, 6, 2, 2, on, expert_map)
    assert torch.equal(sorted_ids.view(2, -1), want.sorted_token_ids)
    assert torch.equal(expert_ids.view(2, -1), want.expert_ids)
    assert torch.equal(post, want.num_tokens_post_padded)
    assert want.expert_ids[1].tolist()[:2] == [0, 2]  # global 1 and 5, local 0 and 2
    assert int(want.num_tokens_post_padded[0]) == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_without_add_inputs_each_pair_in_a_block_holds_its_delta_alone(version):
    _, want, d = _named_result(add_inputs=False, version=version)
    assert not torch.equal(want, d["y"].double())  # (the old values are gone)


@pytest.mark.parametrize("version", VERSIONS)
def test_blocks_of_experts_that_are_not_local_add_nothing(version):
    """Under expert parallelism ``expert_map`` names the experts held here; a block of an
    expert held elsewhere is -1, and the kernels skip it."""
    gen = torch.Generator().manual_seed(11)
    M, top_k, E_global, L, r, K, N, B = 4, 2, 5, 2, 2, 4, 3, 2
    expert_map = torch.tensor([0, -1, 1, -1, 2], device=DEVICE)  # experts 0, 2, 4 are here
    topk = torch.tensor([[0, 1], [2, 3], [4, 1], [3, 0]], device=DEVICE)  # global experts
    slots = torch.tensor([0, 1, 1, 0], device=DEVICE)
    on = torch.ones(L, dtype=torch.int32, device=DEVICE)
    x = torch.randn(M, K, generator=gen).to(DEVICE)
    a = [torch.randn(L, 3, r, K, generator=gen).to(DEVICE)]  # the 3 local experts
    b = [torch.randn(L, 3, N, r, generator=gen).to(DEVICE)]
    w = torch.rand(M, top_k, generator=gen).to(DEVICE)
    y = torch.randn(M, top_k, N, generator=gen).to(DEVICE)
    blocks = align_pairs(topk, slots, E_global, B, L, on, expert_map)
    got = y.clone()
    fused_moe_lora(got, x, a, b, w, *blocks, on, block_size=B, version=version)
    local = torch.where(topk >= 0, expert_map[topk.clamp(min=0)], -1)  # -1: elsewhere
    want = reference.fused_moe_lora(y, x, a, b, local, w, slots)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[local == -1], y[local == -1])


def test_the_tiled_shrink_takes_blocks_up_to_its_tiles_and_leaves_larger_ones(monkeypatch):
    """Version 2 where a block fits its tiles; a larger block falls back to version 1,
    and both give the reference."""
    from punica_numba.kernels import moe_shrink_tiled
    from punica_numba.ops import moe as moe_ops

    built = []
    real = moe_shrink_tiled.build_moe_tiled_shrink_kernel
    monkeypatch.setattr(
        moe_ops.tiled_shrink,
        "build_moe_tiled_shrink_kernel",
        lambda *a: built.append(a) or real(*a),
    )
    for block_size in (moe_shrink_tiled.MAX_PAIRS, moe_shrink_tiled.MAX_PAIRS + 1):
        topk = torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)
        slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
        on = torch.ones(1, dtype=torch.int32, device=DEVICE)
        x, w = torch.randn(2, 3, device=DEVICE), torch.rand(2, 1, device=DEVICE)
        a, b = [torch.randn(1, 1, 2, 3, device=DEVICE)], [torch.randn(1, 1, 4, 2, device=DEVICE)]
        y = torch.zeros(2, 1, 4, device=DEVICE)
        blocks = align_pairs(topk, slots, 1, block_size, 1, on)
        fused_moe_lora(y, x, a, b, w, *blocks, on, block_size=block_size, version=2)
        want = reference.fused_moe_lora(torch.zeros_like(y), x, a, b, topk, w, slots)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert len(built) == 1  # the first block size only


@pytest.mark.parametrize("version", [0, max(VERSIONS) + 1])
def test_an_unknown_version_is_rejected_by_name(version):
    d, blocks, B = _named_call(False)
    before = d["y"].clone()
    with pytest.raises(ValueError, match="version"):
        fused_moe_lora(
            d["y"], d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
            block_size=B, version=version,
        )  # fmt: skip
    assert torch.equal(d["y"], before)


# -- 5. version 3's tiles --------------------------------------------------------------------


#: The kernel builders of version 3 and of version 4, as (module, name).
VERSION_3_BUILDERS = (
    (moe_ops.split_shrink, "build_moe_split_shrink_kernel"),
    (moe_ops.columns_expand, "build_moe_columns_expand_kernel"),
)
VERSION_4_BUILDERS = (
    (moe_ops.mma_shrink, "build_moe_mma_shrink_kernel"),
    (moe_ops.mma_expand, "build_moe_mma_expand_kernel"),
)


def _recording_builds(monkeypatch, builders=VERSION_3_BUILDERS) -> list:
    """``(builder, arguments)`` of every kernel ``builders`` are asked for (by default
    version 3's two)."""
    built = []
    for module, name in builders:
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, name=name: built.append((name, a)) or real(*a)
        )
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("projection", ["w13", "w2"])
@pytest.mark.parametrize("whole_words", [False, True], ids=["K-odd", "K-in-int64-words"])
def test_version_3_crosses_its_rank_groups_chunks_of_pairs_and_column_groups(
    whole_words, projection, dtype, monkeypatch
):
    """Sizes just past each of version 3's tiles, from its own parameters (the
    simulator's or the GPU's): a rank of more than TILE_N ranks and no multiple of them,
    blocks of more pairs than TILE_P (and blocks of one pair, then padding), more columns
    than a column group, and K longer than one step of a block's loads, odd (a word per
    element) or in whole int64 words one past the step."""
    shrink, expand = moe_ops.SPLIT_SHRINK, moe_ops.COLUMNS_EXPAND
    step = shrink.threads * shrink.unroll  # words of K a block loads at once
    rank = 2 * shrink.tile_n + 1
    vec, _ = moe_ops.columns_shape(rank)
    K = 4 * (step + 1) if whole_words else step + 5
    N = 2 * expand.threads * vec + 1
    B = 2 * shrink.tile_p + 1  # pairs a block
    # B + 1 tokens on slot 0: a full block and a block of one pair per expert; one token on
    # slot 1, one on none
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=N, B=B, projection=projection,
                                      offset=1)  # fmt: skip
    ids, P = blocks.sorted_token_ids, d["topk_ids"].numel()
    real = torch.stack(
        [(ids[:, i : i + B] < P).sum(1) for i in range(0, ids.shape[1], B)], 1
    )  # [L, NB] the pairs of each block
    assert real.max() > shrink.tile_p and real.max() > expand.tile_p and (real == 1).any()
    assert rank > shrink.tile_n and rank % shrink.tile_n and N > expand.threads * vec
    y, before = d["y"], d["y"].clone()
    built = _recording_builds(monkeypatch)
    fused_moe_lora(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
        block_size=B, mul_routed_weight=case.mul, offset=1, version=3,
    )  # fmt: skip
    check_against_reference(case, y, d, before)
    (shrink_name, shrink_args), (expand_name, _) = built
    assert (shrink_name, expand_name) == (
        "build_moe_split_shrink_kernel",
        "build_moe_columns_expand_kernel",
    )
    assert shrink_args[5] == whole_words  # x and A as int64 words, or element by element
    words = K // (8 // dtype.itemsize) if whole_words else K
    assert words > step and words % step, "K must end in a part of a step"


def test_version_3s_expand_holds_at_most_its_values_of_b_and_of_buffer_rows():
    config = moe_ops.ColumnsExpand(threads=128, vec=4, tile_p=4, values=64)
    assert moe_ops.columns_shape(1, config) == (4, 4)
    assert moe_ops.columns_shape(16, config) == (4, 4)
    assert moe_ops.columns_shape(24, config) == (2, 2)
    assert moe_ops.columns_shape(64, config) == (1, 1)
    assert moe_ops.columns_shape(128, config) == (1, 1)  # at least 1 (a larger rank spills)
    assert moe_ops.columns_shape(8, config._replace(vec=2, tile_p=8)) == (2, 8)


def test_the_moe_benchmark_runs_the_version_it_is_given(tmp_path, capsys):
    """``bench --moe --version 3``: every case checked, then timed, and recorded as 3's, with
    no configuration of the dense op (version 3 runs kernels of its own)."""
    out = tmp_path / "moe.json"
    assert bench_moe.main(["--quick", "--json", str(out), "--version", "3"]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert cases and all(c["version"] == 3 and c["configs"] == {} for c in cases)
    assert "moe w2" in capsys.readouterr().out


def test_the_moe_benchmark_records_the_dense_ops_configurations():
    """Version 9 runs the dense op's kernels: each case records the configuration its shrink
    and its expand took, by name, as the dense op's launch record says."""
    case = bench_moe.default_cases(quick=True)[0]
    with moe_dense.recorded_launches() as launched:
        record = bench_moe.run_case(case, 0.0, version=9)
    assert set(record["configs"]) == {"shrink", "expand"}
    assert record["configs"] == {op: config_name(c) for op, c in launched.items()}


def _moe_run(path, cases, **top) -> str:
    path.write_text(json.dumps({**top, "cases": cases}))
    return str(path)


def test_the_moe_benchmark_sets_a_stored_run_beside_a_peers(tmp_path, capsys):
    """``bench --moe --report RUN --against PEER``: each case of RUN beside the PEER's case of
    its shape (a field PEER leaves out is the benchmark's own layer), the ratio of the two,
    and how many take at most TARGET_RATIO of the peer's time, the furthest named."""
    ours = [
        {"projection": "w13", "T": 1, "loras": 1, "name": "moe w13 T=1 loras=1", "us": 3.0},
        {"projection": "w2", "T": 16, "loras": 4, "name": "moe w2 T=16 loras=4", "us": 9.0},
        {"projection": "w2", "T": 16, "loras": 4, "hidden": 64, "us": 1.0},  # another layer
        {"projection": "w2", "T": 1, "loras": 1, "us": 6.701},  # 0.6701x: rounds to 0.67, misses
    ]
    run = _moe_run(tmp_path / "ours.json", ours, commit="abc1234")
    theirs = [
        {"projection": "w13", "T": 1, "loras": 1, "us": 6.0},
        {"projection": "w2", "T": 16, "loras": 4, "us": 10.0},
        {"projection": "w2", "T": 1, "loras": 1, "us": 10.0},
    ]
    peer = _moe_run(tmp_path / "peer.json", theirs, peer="a peer kernel", gpu="GPU 9")
    assert bench_moe.main(["--report", run, "--against", peer]) == 0
    out = capsys.readouterr().out
    assert "0.500" in out and "0.900" in out
    assert (
        f"1 of 3 cases take at most {bench_moe.TARGET_RATIO}x the time of a peer kernel on GPU 9"
        in out
    )
    assert "(1 without its figure)" in out and "the furthest: moe w2 T=16 loras=4, 0.9x" in out

    records = bench_moe.against_peer(ours, bench_moe.peer_times(peer)[1])
    assert [r.get("ratio") for r in records] == [0.5, 0.9, None, 0.67]
    # a stored run set beside an earlier peer keeps none of that peer's figures
    stale = [dict(ours[2], peer_us=2.0, ratio=0.5)]
    assert "ratio" not in bench_moe.against_peer(stale, bench_moe.peer_times(peer)[1])[0]
    who, _ = bench_moe.peer_times(run)  # a run of ours is named by its commit
    assert who == "abc1234"


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "JSONDecodeError"),
        ('{"cases": [{"projection": "w13", "T": 1, "us": 2.0}]}', "a case without loras"),
        ('{"cases": [{"projection": "w13", "T": 1, "loras": 1, "us": "3.0"}]}', "not a number"),
        ("[1, 2]", "TypeError"),
    ],
)
def test_the_moe_benchmark_refuses_a_file_that_is_not_a_run(tmp_path, capsys, content, why):
    """A file given to ``--against`` or ``--report`` that is not a run of MoE cases stops the
    command before anything is timed, with a message naming the file and what it lacks."""
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    good = _moe_run(tmp_path / "good.json", [{"projection": "w2", "T": 1, "loras": 1, "us": 2.0}])
    for argv in (["--report", good, "--against", str(bad)], ["--report", str(bad)]):
        with pytest.raises(SystemExit) as stopped:
            bench_moe.main(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert str(bad) in err and "not a run of MoE cases" in err and why in err


def test_the_moe_benchmark_records_the_peer_it_was_set_beside(tmp_path, capsys):
    """A timed run with ``--against`` (here the same quick cases, timed before) records the
    file, the peer and TARGET_RATIO, and each case's ``peer_us`` and ``ratio``; ``--report``
    takes no ``--json``."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert bench_moe.main(["--quick", "--json", str(first), "--version", "3"]) == 0
    argv = ["--quick", "--json", str(second), "--version", "3", "--against", str(first)]
    assert bench_moe.main(argv) == 0
    result = json.loads(second.read_text())
    assert result["against"]["file"] == str(first)
    assert result["against"]["target_ratio"] == bench_moe.TARGET_RATIO
    before = {c["name"]: c["us"] for c in json.loads(first.read_text())["cases"]}
    for case in result["cases"]:
        assert case["peer_us"] == before[case["name"]]
        assert case["ratio"] == round(case["us"] / case["peer_us"], 3)
    assert "cases take at most" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_moe.main(["--report", str(second), "--json", str(tmp_path / "x.json")])
    assert "--json is for a run timed here" in capsys.readouterr().err


# -- 6. version 4: the tensor cores ----------------------------------------------------------


def _recording_all_builds(monkeypatch) -> list:
    """``(builder, arguments)`` of every kernel versions 3's and 4's builders and version 6's
    expand builder are asked for."""
    outer = ((moe_ops.outer_expand, "build_moe_outer_expand_kernel"),)
    return _recording_builds(monkeypatch, VERSION_3_BUILDERS + VERSION_4_BUILDERS + outer)


def _one_block_call(dtype, *, rank, K, N, B, projection, offset, slices=None, pairs=None):
    """A call whose slot 0 puts ``pairs`` pairs (B + 1 unless given) on each of two
    experts (a full block and a block of the rest, with padding), one token on slot 1
    and one on none: ``(case, data, blocks)``."""
    mul = projection == "w2"
    S = slices or (1 if mul else 2)
    tokens = B + 1 if pairs is None else pairs
    M, top_k, E, L = tokens + 2, 2, 2, 2
    gen = torch.Generator().manual_seed(rank * 1000 + K * 10 + B)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    d = dict(
        x=randn(M * top_k if mul else M, K),
        lora_a=[randn(L, E, rank, K) for _ in range(S)],
        lora_b=[randn(L, E, N, rank) for _ in range(S)],
        topk_ids=torch.tensor([[0, 1]] * M, device=DEVICE),  # every token on both experts
        topk_weights=torch.rand(M, top_k, generator=gen).to(DEVICE),
        slots=torch.tensor([0] * tokens + [1, -1], device=DEVICE),
        enabled=torch.ones(L, dtype=torch.int32, device=DEVICE),
        y=randn(M, top_k, offset + S * N + 1),
    )
    case = types.SimpleNamespace(
        mul=mul, offset=offset, add_inputs=True, K=K, r=rank, S=S, N=N, dtype=dtype
    )
    return case, d, align_pairs(d["topk_ids"], d["slots"], E, B, L, d["enabled"])


def _run_version(version, case, d, blocks, B, monkeypatch) -> list:
    """The op's ``version`` on the call, checked against the reference; the builds asked
    for."""
    y, before = d["y"], d["y"].clone()
    built = _recording_all_builds(monkeypatch)
    fused_moe_lora(
        y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
        block_size=B, mul_routed_weight=case.mul, offset=case.offset, version=version,
    )  # fmt: skip
    check_against_reference(case, y, d, before)
    return built


@pytest.mark.parametrize(
    "projection, dtype, past",
    [("w13", torch.bfloat16, 4), ("w2", torch.float16, 12)],
    ids=["w13-bf16-one-group-and-4", "w2-fp16-one-group-and-12"],
)
def test_version_4_crosses_its_tiles(projection, dtype, past, monkeypatch):
    """Sizes past each of version 4's tiles, from its own parameters: a rank of several
    rank groups and no multiple of 16 (the expand's last rank step part zeros; no
    multiple of 8: the shrink's last tile stores half its ranks), K of an odd number of words
    and past one chunk a warp (the shrink's 16-byte loads off, its last chunk partial),
    blocks of more than 16 pairs (two passes of the shrink, two m-tiles of the expand on
    the simulator) and of one, more columns than a column group, and an offset."""
    shrink, expand = moe_ops.MMA_SHRINK, moe_ops.MMA_EXPAND
    rank = 8 * shrink.n_tiles + past  # one rank group and part of the next, on each machine
    K = 4 * (8 * shrink.threads // 32 + 1)  # words: one past a chunk for every warp
    N = 8 * expand.n_tiles * (expand.threads // 32) * 2 + 4
    B = 17
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=N, B=B, projection=projection,
                                      offset=1)  # fmt: skip
    built = _run_version(4, case, d, blocks, B, monkeypatch)
    (shrink_name, shrink_args), (expand_name, expand_args) = built
    assert (shrink_name, expand_name) == (
        "build_moe_mma_shrink_kernel",
        "build_moe_mma_expand_kernel",
    )
    assert shrink_args == (
        dtype,
        shrink.threads,
        min(shrink.m_tiles, 2),
        shrink.n_tiles,
        False,
        1,
        False,
        False,
    )
    assert expand_args[:6] == (dtype, dtype, expand.threads, min(expand.m_tiles, 2),
                               expand.n_tiles, rank)  # fmt: skip
    assert rank % 16 and rank > 8 * shrink.n_tiles and N > 8 * expand.n_tiles


@pytest.mark.parametrize(
    "rank, B, slices, dtype",
    [
        (8, 1, 1, torch.bfloat16),  # blocks of one pair: 15 rows of padding a tile
        (16, 16, 2, torch.float16),  # one whole tile, two slices
        (32, 33, 1, torch.bfloat16),  # more pairs than two tiles: passes in both kernels
    ],
)
def test_version_4_takes_ranks_and_block_sizes(rank, B, slices, dtype, monkeypatch):
    """Ranks 8, 16, 32 (one, two and four rank tiles), K in whole 16-byte pairs of words
    (the shrink's 16-byte loads), and blocks of 1, 16 and 33 pairs."""
    K, N = 32, 8
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=N, B=B, projection="w13",
                                      offset=2, slices=slices, pairs=min(B + 1, 34))  # fmt: skip
    built = _run_version(4, case, d, blocks, B, monkeypatch)
    assert [name for name, _ in built] == [
        "build_moe_mma_shrink_kernel",
        "build_moe_mma_expand_kernel",
    ]
    assert built[0][1][4] is True  # 16-byte loads of x and A


@pytest.mark.parametrize(
    "dtype, rank, K, why",
    [
        (torch.float32, 8, 8, "fp32: no exact 16-bit operands"),
        (torch.bfloat16, 6, 8, "a rank that is no multiple of 4: B not in words"),
        (torch.float16, 8, 6, "K no multiple of 4: x and A not in words"),
    ],
)
def test_version_4_runs_version_3_where_the_tensor_cores_cannot(dtype, rank, K, why, monkeypatch):
    """The gate (``ops.moe.tensor_core_words``): such calls take version 3's kernels, and
    give the reference."""
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=5, B=2, projection="w2", offset=0)
    assert moe_ops.tensor_core_words(d["x"], d["lora_a"], d["lora_b"]) is None, why
    built = _run_version(4, case, d, blocks, 2, monkeypatch)
    assert [name for name, _ in built] == [
        "build_moe_split_shrink_kernel",
        "build_moe_columns_expand_kernel",
    ], why


def test_version_4s_shrink_writes_only_the_pairs_of_its_blocks():
    """Foreign metadata: padding (P, and values past it) between a block's pairs, a block
    of expert -1 and one past the row's end. The shrink stores the listed pairs' buffer
    rows and no other (a sentinel stays), and those rows are the products."""
    from punica_numba.ops.launching import launcher_of

    gen = torch.Generator().manual_seed(9)
    P, K, rank, B, L, E = 6, 16, 8, 4, 1, 2
    x = torch.randn(P, K, generator=gen).to(DEVICE, torch.bfloat16)  # rows per pair (w2)
    a = torch.randn(L, E, rank, K, generator=gen).to(DEVICE, torch.bfloat16)
    sorted_ids = torch.tensor([[4, P, 1, P + 3, 0, 2, 5, 3]], dtype=torch.int32, device=DEVICE)
    expert_ids = torch.tensor([[1, -1]], dtype=torch.int32, device=DEVICE)  # block 1: none
    post = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    on = torch.ones(L, dtype=torch.int32, device=DEVICE)
    buffer = torch.full((1, P, rank), 7.0, device=DEVICE)  # [S, P, r] fp32, a sentinel
    config = moe_ops.MMA_SHRINK
    kernel = moe_ops.mma_shrink.build_moe_mma_shrink_kernel(
        torch.bfloat16, config.threads, 1, config.n_tiles, True
    )
    groups = -(-rank // (8 * config.n_tiles))
    launcher_of(kernel)(
        (2, L, groups),
        config.threads,
        (x.view(torch.int64), a.view(torch.int64), a.view(torch.int64), buffer, sorted_ids,
         expert_ids, post, on, 1, B, True),
    )  # fmt: skip
    listed = [4, 1]  # block 0's pairs; block 1's expert is -1
    want = x[listed].double() @ a[0, 1].double().T  # [2, r]
    torch.testing.assert_close(buffer[0, listed].double(), want, rtol=1e-6, atol=1e-6)
    others = [p for p in range(P) if p not in listed]
    assert bool((buffer[0, others] == 7.0).all()), "a pair in no block was written"


# -- 7. version 5: the tensor-core shrink where blocks are full ------------------------------


def test_version_5s_measure_of_full_blocks_on_the_measured_cases():
    """``pairs_per_block`` on the H200 cases that place the threshold (Qwen3-30B-A3B: 128
    experts, top-8): 16 tokens on one adapter, 1 pair a block (the split shrink was the
    faster); 2048 tokens over 16 adapters, 8 (the tensor cores were); and a call of fewer
    pairs than (slot, expert) blocks, 1."""
    assert moe_ops.pairs_per_block(16 * 8, 1, 128) == 1
    assert moe_ops.pairs_per_block(2048 * 8, 16, 128) == 8
    assert moe_ops.pairs_per_block(2048 * 8, 1, 128) == 128
    assert moe_ops.pairs_per_block(3, 4, 8) == 1
    assert 1 < moe_ops.MMA_SHRINK_FROM_PAIRS < 8


@pytest.mark.parametrize(
    "pairs, projection, dtype, shrink",
    [
        (1, "w13", torch.bfloat16, "build_moe_split_shrink_kernel"),  # 1.5 a block
        (5, "w2", torch.bfloat16, "build_moe_split_shrink_kernel"),  # 3.5: just below
        (6, "w2", torch.bfloat16, "build_moe_mma_shrink_kernel"),  # 4: from there on
        (6, "w13", torch.float16, "build_moe_mma_shrink_kernel"),
        (6, "w13", torch.float32, "build_moe_split_shrink_kernel"),  # the gate: fp32
    ],
)
def test_version_5_takes_the_tensor_core_shrink_from_its_threshold(
    pairs, projection, dtype, shrink, monkeypatch
):
    """Slot 0 puts ``pairs`` pairs on each of 2 experts, slot 1 one token, one token is on
    none: P = 2 (pairs + 2) over L * E = 4 blocks. Below MMA_SHRINK_FROM_PAIRS the split
    shrink, from it on the tensor-core one where the operands allow it (the buffer it
    writes read by the columns expand), and the columns expand always; each gives the
    reference."""
    B = 4
    case, d, blocks = _one_block_call(dtype, rank=8, K=32, N=8, B=B, projection=projection,
                                      offset=1, pairs=pairs)  # fmt: skip
    average = moe_ops.pairs_per_block(d["topk_ids"].numel(), 2, 2)
    assert average == (pairs + 2) / 2
    gate = moe_ops.tensor_core_words(d["x"], d["lora_a"], d["lora_b"]) is not None
    assert (average >= moe_ops.MMA_SHRINK_FROM_PAIRS and gate) == ("mma" in shrink)
    built = _run_version(5, case, d, blocks, B, monkeypatch)
    assert [name for name, _ in built] == [shrink, "build_moe_columns_expand_kernel"]


@pytest.mark.parametrize(
    "pairs, outer_from, compact, shrink, expand",
    [
        (1, 4, True, "build_moe_split_shrink_kernel", "build_moe_columns_expand_kernel"),
        (1, 4, False, "build_moe_split_shrink_kernel", "build_moe_columns_expand_kernel"),
        (6, 4, True, "build_moe_mma_shrink_kernel", "build_moe_outer_expand_kernel"),
        (1, 1, False, "build_moe_split_shrink_kernel", "build_moe_outer_expand_kernel"),
    ],
)
def test_version_6_takes_the_outer_expand_from_its_threshold(
    pairs, outer_from, compact, shrink, expand, monkeypatch
):
    """The call of the test above (w2, bf16: 1.5 pairs a block, or 4) at version 6, with
    OUTER_EXPAND_FROM_PAIRS at ``outer_from``: version 3's expand below it, the outer
    products from it on; and its split shrink on a compact grid, or on version 5's, as
    COMPACT_SPLIT_SHRINK says. Each gives the reference."""
    monkeypatch.setattr(moe_ops, "OUTER_EXPAND_FROM_PAIRS", outer_from)
    monkeypatch.setattr(moe_ops, "COMPACT_SPLIT_SHRINK", compact)
    B = 4
    case, d, blocks = _one_block_call(torch.bfloat16, rank=8, K=32, N=8, B=B, projection="w2",
                                      offset=1, pairs=pairs)  # fmt: skip
    built = _run_version(6, case, d, blocks, B, monkeypatch)
    assert [name for name, _ in built] == [shrink, expand]
    if "split" in shrink:  # (dtype, threads, tile_n, tile_p, unroll, packed, compact, ...)
        assert built[0][1][6] is compact


# -- 8. version 6: a chunk of pairs at once, runs of blocks, compact grids -------------------


def _expand_call(dtype, *, rank, N, B, slices, mul, offset, add_inputs, columns):
    """One expand's arguments (``ops.moe._Expand``) and B: a random fp32 buffer, y of
    ``columns`` columns, slot 0 with B + 1 tokens on two experts (a full block and one of
    the rest, with padding), slot 1 with one token, one token on none."""
    tokens, top_k, E, L = B + 1, 2, 2, 2
    M = tokens + 2
    gen = torch.Generator().manual_seed(rank * 100 + N + B)
    y = torch.randn(M, top_k, columns, generator=gen).to(DEVICE, dtype)
    b = [torch.randn(L, E, N, rank, generator=gen).to(DEVICE, dtype) for _ in range(slices)]
    buffer = torch.randn(slices, M * top_k, rank, generator=gen).to(DEVICE)
    weights = torch.rand(M * top_k, generator=gen).to(DEVICE)
    topk_ids = torch.tensor([[0, 1]] * M, device=DEVICE)
    slots = torch.tensor([0] * tokens + [1, -1], device=DEVICE)
    enabled = torch.ones(L, dtype=torch.int32, device=DEVICE)
    metadata = (*align_pairs(topk_ids, slots, E, B, L, enabled), enabled)
    out = y.view(M * top_k, columns)
    call = moe_ops._Expand(out, buffer, weights, metadata, B, mul, offset, add_inputs)
    return call, b


@pytest.mark.parametrize(
    "dtype, rank, slices, mul, offset, add_inputs, past, chunks, vec, pad, access",
    [
        # words of four outputs: column groups, chunks (the last one partial), two slices
        (torch.bfloat16, 8, 2, False, 4, True, 4, (2, 1), 4, 4, "words"),
        (torch.float16, 12, 1, True, 0, True, 8, (2, 3), 4, 4, "words"),  # w2: routing weights
        (torch.bfloat16, 8, 2, False, 0, False, 0, (1, 0), 4, 0, "words"),  # without add_inputs
        # pairs of words, 16 bytes at a time
        (torch.bfloat16, 16, 2, False, 8, True, 8, (2, 1), 8, 8, "pairs"),
        (torch.float16, 8, 1, True, 0, False, 16, (1, 1), 8, 0, "pairs"),
        (torch.bfloat16, 8, 1, False, 4, True, 8, (1, 1), 8, 4, "words"),  # offset off 16 bytes
        # element by element: a width past a word, an offset off a word, fp32
        (torch.bfloat16, 6, 2, False, 1, True, 5, (2, 1), 4, 1, "elements"),
        (torch.float16, 8, 1, True, 2, True, 4, (1, 2), 4, 2, "elements"),
        (torch.float32, 5, 2, False, 0, False, 1, (1, 1), 4, 0, "elements"),
    ],
)
def test_version_6s_expand_gives_version_3s_bits(
    dtype, rank, slices, mul, offset, add_inputs, past, chunks, vec, pad, access, monkeypatch
):
    """The same sums in the same order: version 6's expand and version 3's, on one buffer,
    store the same bits, element by element, in words of four outputs and in pairs of
    words. Sizes from version 6's own parameters (``vec`` columns a thread): slices of
    ``past`` columns past two column groups (or of one group), blocks of ``chunks =
    (whole, past)`` chunks and pairs past them."""
    config = moe_ops.OUTER_EXPAND._replace(vec=vec)
    monkeypatch.setattr(moe_ops, "OUTER_EXPAND", config)
    group = config.threads * config.vec
    N = group * (2 if past else 1) + past
    # the chunk the launcher takes for this vec (8 columns a thread hold more: on a GPU, 8)
    chunk = moe_ops.outer_shape(rank, N, 1 << 20, config)[1]
    B = chunk * chunks[0] + chunks[1]
    columns = offset + slices * N + pad  # y's columns: ``pad`` past the slices
    call, b = _expand_call(dtype, rank=rank, N=N, B=B, slices=slices, mul=mul, offset=offset,
                           add_inputs=add_inputs, columns=columns)  # fmt: skip
    assert moe_ops.outer_shape(rank, N, B, config) == (config.threads, chunk)
    before = call.out.clone()
    moe_ops._columns_expand(call, b)
    want = call.out.clone()
    call.out.copy_(before)
    built = _recording_builds(
        monkeypatch, [(moe_ops.outer_expand, "build_moe_outer_expand_kernel")]
    )
    moe_ops._outer_expand(call, b)
    chosen = {(False, False): "elements", (True, False): "words", (True, True): "pairs"}
    assert [chosen[args[7], args[8]] for _, args in built] == [access]
    assert not torch.equal(want, before), "the expand changed nothing"
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    differ = call.out.view(bits) != want.view(bits)
    assert not bool(differ.any()), f"different bits at {torch.nonzero(differ)[0].tolist()}"


def test_version_6s_expand_holds_at_most_its_values_in_registers():
    """``outer_shape``: whole warps on a GPU (threads of 4 columns for the slice, up to the
    most), and chunks no larger than the block, nor than the registers for the sums and
    old outputs allow, nor than the shared memory for the staged buffer rows; the rank
    counts only there."""
    config = moe_ops.OuterExpand(threads=256, vec=4, chunk=16, values=160)
    unit = 1 if moe_ops.SIMULATOR else 32
    threads, chunk = moe_ops.outer_shape(16, 768, 16, config)
    assert threads == 192 and chunk == 16  # w13 of Qwen3-30B-A3B: one group a slice
    assert moe_ops.outer_shape(16, 2048, 16, config) == (256, 16)  # w2: two groups
    assert moe_ops.outer_shape(16, 768, 5, config)[1] == 8  # the block's pairs, rounded up
    assert moe_ops.outer_shape(256, 768, 16, config)[1] == 16  # the rank holds no register
    wide = config._replace(vec=8)
    assert moe_ops.outer_shape(16, 768, 16, wide)[1] == 8  # 16 * 8 * 1.5 > 160 >= 8 * 8 * 1.5
    staged = moe_ops.STAGED_VALUES
    assert moe_ops.outer_shape(staged // 4, 768, 16, config)[1] == 4  # the staged rows
    assert moe_ops.outer_shape(4 * staged, 768, 16, config)[1] == 1  # at least one
    assert moe_ops.outer_shape(16, 10, 16, config)[0] == -(-3 // unit) * unit


def _shrink_buffers(dtype, *, rank, K, B, pairs, projection, monkeypatch, kernel="mma"):
    """Version 5's shrink and version 6's, the tensor-core one (``kernel="mma"``) or the
    split one (``"split"``), on one call (``_one_block_call``): ``(five, six, built, want,
    listed, blocks)``, the two buffers (a sentinel 7.0 where nothing is stored), version 6's
    tensor-core builds, the float64 products, a mask of the (slice, pair) rows in a block,
    and the call's blocks."""
    case, d, blocks = _one_block_call(dtype, rank=rank, K=K, N=4, B=B, projection=projection,
                                      offset=0, pairs=pairs)  # fmt: skip
    words = moe_ops.tensor_core_words(d["x"], d["lora_a"], d["lora_b"])
    assert words is not None
    P = d["topk_ids"].numel()
    metadata = (*blocks, d["enabled"])
    buffers = []
    for six in (False, True):
        buffer = torch.full((case.S, P, rank), 7.0, device=DEVICE)  # a sentinel
        call = moe_ops._Shrink(buffer, metadata, 2, B, case.mul)
        if six:
            built = _recording_builds(
                monkeypatch, [(moe_ops.mma_shrink, "build_moe_mma_shrink_kernel")]
            )
        if kernel == "split":
            moe_ops._split_shrink(call, d["x"], d["lora_a"], compact=six)
        else:
            moe_ops._mma_shrink(call, *words[:2], hidden=K, dtype=dtype, runs=six)
        buffers.append(buffer)
    slots, ids = d["slots"], d["topk_ids"]
    rows = d["x"].double() if case.mul else d["x"].double().repeat_interleave(2, 0)  # [P, K]
    want = torch.zeros(case.S, P, rank, dtype=torch.float64, device=DEVICE)
    listed = torch.zeros(P, dtype=torch.bool)
    for p in range(P):
        t, k = divmod(p, 2)
        if slots[t] >= 0:
            listed[p] = True
            for s in range(case.S):
                want[s, p] = d["lora_a"][s][slots[t], ids[t, k]].double() @ rows[p]
    return buffers[0], buffers[1], built, want, listed, blocks


def _assert_version_5s_bits(five, six, want, listed) -> None:
    """Version 6's shrink buffer (``_shrink_buffers``) holds version 5's bits, each the float64
    product, and the sentinel in every row of no block."""
    assert torch.equal(six.view(torch.int32), five.view(torch.int32)), "different bits"
    torch.testing.assert_close(six[:, listed].double(), want[:, listed], rtol=1e-5, atol=1e-5)
    assert bool((six[:, ~listed] == 7.0).all()), "a pair in no block was written"


@pytest.mark.parametrize(
    "projection, dtype, rank, K, B, pairs",
    [
        ("w13", torch.bfloat16, 12, 32, 4, 33),  # runs of four blocks in one tile
        ("w13", torch.float16, 20, 20, 8, 65),  # runs of four in a pass of two tiles
        ("w2", torch.bfloat16, 16, 32, 8, 9),  # one slice, blocks one by one
        # K of 6 and 4 chunks over 2 warps: each warp's chunks in turns of two sets of
        # words, ending on either ("Ahead"), where the cases above have one chunk
        ("w13", torch.bfloat16, 12, 168, 4, 33),
        ("w2", torch.float16, 16, 104, 8, 9),
    ],
)
def test_version_6s_tensor_core_shrink_gives_version_5s_bits(
    projection, dtype, rank, K, B, pairs, monkeypatch
):
    """Every slice in one CUDA block (w13, ranks side by side, a rank of no multiple of 8
    so that a tile holds both slices') and runs of blocks of one expert in passes of
    several tiles: the same products in the same order as version 5's one block and one
    slice a CUDA block, so the same bits; each the float64 product, and no row of no block
    written."""
    five, six, built, want, listed, _ = _shrink_buffers(dtype, rank=rank, K=K, B=B,
                                                        pairs=pairs, projection=projection,
                                                        monkeypatch=monkeypatch)  # fmt: skip
    ((_, args),) = built
    m_tiles, n_tiles, blocks, joint = args[2], args[3], args[5], args[6]
    assert args[9] is moe_ops.MMA_SHRINK_AHEAD  # version 6 loads a warp's next chunk ahead
    if projection == "w13":
        assert joint and blocks == 4 and rank % 8  # a tile of both slices' ranks
    else:
        assert not joint and blocks == 1
    assert m_tiles == min(moe_ops.MMA_SHRINK_RUNS.m_tiles, -(-blocks * B // 16))
    ranks = 2 * rank if joint else rank
    assert n_tiles == min(moe_ops.MMA_SHRINK_RUNS.n_tiles, -(-ranks // 8))
    _assert_version_5s_bits(five, six, want, listed)


@pytest.mark.parametrize(
    "joint, compact", [(True, True), (False, True), (True, False), (False, False)]
)
def test_version_6s_tensor_core_shrink_of_single_blocks_takes_either_grid(
    joint, compact, monkeypatch
):
    """Where version 6's tensor-core shrink takes units of one block (w13, 5.5 pairs a
    block): both slices in one CUDA block or each in its own (MMA_SHRINK_JOINT), on a
    compact grid or on version 5's (COMPACT_SINGLE_BLOCK_MMA_SHRINK); every way the same
    bits as version 5's, each the float64 product, and no row of no block written."""
    monkeypatch.setattr(moe_ops, "MMA_SHRINK_JOINT", joint)
    monkeypatch.setattr(moe_ops, "COMPACT_SINGLE_BLOCK_MMA_SHRINK", compact)
    five, six, built, want, listed, _ = _shrink_buffers(torch.bfloat16, rank=12, K=168, B=8,
                                                        pairs=9, projection="w13",
                                                        monkeypatch=monkeypatch)  # fmt: skip
    ((_, args),) = built
    assert (args[5], args[6], args[7]) == (1, joint, compact)  # blocks a unit, joint, compact
    _assert_version_5s_bits(five, six, want, listed)


def test_version_6s_tensor_core_shrink_shape():
    """``mma_shrink_runs``: both slices side by side where there are two; runs of blocks (a
    power of two) only where the call's pairs average enough a (slot, expert) to fill them,
    and passes of no more tiles than a run needs."""
    config = moe_ops.MmaShrink(threads=128, m_tiles=4, n_tiles=4)
    # Qwen3-30B-A3B's w13, 2048 tokens of top-8 on one adapter of 128 experts: 128 a block
    assert moe_ops.mma_shrink_runs(2048 * 8, 1, 128, 16, 2, 16, config) == (4, 4, 4, True)
    # 256 tokens on one adapter: 16 a (slot, expert), one block each
    assert moe_ops.mma_shrink_runs(256 * 8, 1, 128, 16, 2, 16, config) == (1, 4, 1, True)
    # 2048 tokens over 16 adapters: 8 a (slot, expert)
    assert moe_ops.mma_shrink_runs(2048 * 8, 16, 128, 16, 1, 16, config) == (1, 2, 1, False)
    assert moe_ops.mma_shrink_runs(4096 * 8, 1, 128, 16, 2, 64, config) == (4, 4, 4, True)
    assert moe_ops.mma_shrink_runs(4096 * 8, 1, 128, 32, 1, 16, config) == (4, 2, 2, False)
    assert moe_ops.mma_shrink_runs(4096 * 8, 1, 128, 64, 1, 8, config) == (4, 1, 1, False)


@pytest.mark.parametrize("units", [1, 2, 3])
def test_version_6s_expand_takes_every_block_on_a_grid_of_any_size(units, monkeypatch):
    """The compact grid's CUDA blocks take units ``x, x + gridDim.x, ...``: on a grid of 1,
    2 or 3 CUDA blocks along x (fewer than the call's blocks in use), every block is still
    taken, each once, and the outputs are version 3's bits (the barrier between one block's
    readers of the staged pairs and the next block's staging is crossed)."""
    config = moe_ops.OUTER_EXPAND
    N, B = config.threads * config.vec + 4, config.chunk + 1
    call, b = _expand_call(torch.bfloat16, rank=8, N=N, B=B, slices=2, mul=True, offset=4,
                           add_inputs=True, columns=4 + 2 * N + 4)  # fmt: skip
    in_use = int(((call.metadata[2] + B - 1) // B).sum())
    assert in_use > units
    before = call.out.clone()
    moe_ops._columns_expand(call, b)
    want = call.out.clone()
    call.out.copy_(before)
    monkeypatch.setattr(moe_ops, "compact_units", lambda *args: units)
    moe_ops._outer_expand(call, b)
    differ = call.out.view(torch.int16) != want.view(torch.int16)
    assert not bool(differ.any()), f"different bits at {torch.nonzero(differ)[0].tolist()}"


def test_a_compact_grid_has_room_for_every_block_the_pairs_can_fill():
    """``units_in_use``: the blocks P pairs can fill over L slots of E experts, at most one
    run a (slot, expert) and none longer than its pairs, counted against the align step's
    own blocks on random calls; and the worst case of Qwen3-30B-A3B's layer at 2048 tokens
    over 16 adapters (2,944 of the 18,304 blocks the rows could hold)."""
    from punica_numba.kernels.moe_blocks import units_in_use

    assert units_in_use(2048 * 8, 16, 128, 16, 1) == 2944
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        M, top_k, E, L, B = (
            int(torch.randint(1, n, (1,), generator=gen)) for n in (40, 5, 9, 5, 9)
        )
        top_k = min(top_k, E)
        ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(M)])
        slots = torch.randint(-1, L, (M,), generator=gen)
        on = torch.ones(L, dtype=torch.int32)
        blocks = align_pairs(ids, slots, E, B, L, on)
        used = (blocks.num_tokens_post_padded + B - 1) // B  # [L] blocks a row
        for per in (1, 2, 4):
            units = int(((used + per - 1) // per).sum())
            assert units <= units_in_use(M * top_k, L, E, B, per), (M, top_k, E, L, B, per)


@functools.cache
def _unit_walk(batch: int):
    """A kernel that walks a compact grid's units as the version 6 kernels do, reading
    ``batch`` slots' counts at once, each CUDA block recording the (slot, first block) of
    its units and the v where it stopped. (At the module's level: the simulator gives a
    kernel its CUDA names through its globals.)"""
    from punica_numba.kernels.moe_blocks import unit_walker

    unit_of = unit_walker(batch)

    @cuda.jit
    def walk(num_post_pad, enabled, block_size, sorted_ids, per, found, stop):
        v = cuda.blockIdx.x
        while True:
            slot, b = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, per)
            if slot == -1:
                break
            found[v, 0], found[v, 1] = slot, b
            v += cuda.gridDim.x
        stop[cuda.blockIdx.x] = v

    return walk


def test_version_6s_expand_keeps_registers_for_two_cuda_blocks_an_sm():
    """``registers_for``: the register ceiling of version 6's expand leaves an SM's 65,536
    registers to two CUDA blocks, in a thread's steps of 8, and at most 255."""
    from punica_numba.kernels.moe_expand_outer import registers_for

    assert [registers_for(t) for t in (256, 192, 128, 64)] == [128, 168, 255, 255]
    assert registers_for(192, blocks=3) == 112
    for threads in (64, 96, 192, 256):
        assert 2 * threads * registers_for(threads) <= 65536


def test_a_walk_reads_as_many_slots_at_once_as_a_power_of_two_holds_up_to_eight():
    """``slots_at_once``: one adapter's walk reads one slot, three read four, and any
    number past eight reads eight at a time."""
    from punica_numba.kernels.moe_blocks import slots_at_once

    assert [slots_at_once(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_a_compact_grids_walk_finds_every_unit_once_in_slot_order(batch):
    """The walk (``unit_walker``) on random metadata, foreign too (counts below zero or
    past the rows, slots off, units of 1, 2 or 4 blocks, up to 20 slots: batches of
    ``batch`` crossed, and short last batches), walked as a compact grid's CUDA blocks walk
    it (units ``x, x + G, ...``), against the units counted in Python: every unit in use
    is found once, as (slot, first block), in slot order, and each CUDA block stops at its
    first v past the last."""
    import numpy as np

    walk = _unit_walk(batch)
    rng = np.random.default_rng(8 + batch)
    for case in range(16):
        L = int(rng.integers(1, 21)) if case else 2 * batch + 3
        EM, B = int(rng.integers(1, 41)), int(rng.integers(1, 10))
        per, G = int(rng.choice([1, 2, 4])), int(rng.integers(1, 8))
        num_post_pad = rng.integers(-3, EM + 10, L).astype(np.int32)
        enabled = (rng.random(L) < 0.8).astype(np.int32)
        want = []  # (slot, first block) of each unit in use, in order
        for slot in range(L):
            blocks = math.ceil(min(max(int(num_post_pad[slot]), 0), EM) / B)
            if enabled[slot]:
                want += [(slot, u * per) for u in range(math.ceil(blocks / per))]
        found = cuda.to_device(np.full((len(want) + G, 2), -2, dtype=np.int64))
        stop = cuda.to_device(np.zeros(G, dtype=np.int64))
        sorted_ids = cuda.to_device(np.zeros((L, EM), dtype=np.int32))
        counts = cuda.to_device(num_post_pad)
        # (device arrays: a host array passed to a kernel is a warning on a GPU)
        walk[G, 1](counts, cuda.to_device(enabled), B, sorted_ids, per, found, stop)
        found, stop = found.copy_to_host(), stop.copy_to_host()
        where = (L, EM, B, per, G)
        assert [tuple(row) for row in found[: len(want)]] == want, where
        assert (found[len(want) :] == -2).all(), where
        past = [x + G * max(0, math.ceil((len(want) - x) / G)) for x in range(G)]
        assert [int(v) for v in stop] == past, where


@pytest.mark.parametrize("units", [1, 3])
@pytest.mark.parametrize("kernel", ["split", "mma"])
def test_version_6s_shrinks_take_every_block_on_a_grid_of_any_size(kernel, units, monkeypatch):
    """Either shrink on a compact grid of 1 or 3 CUDA blocks along x (fewer than the call's
    blocks in use) stores version 5's bits, on its own grid of a CUDA block a block, into
    every row of a block, and nothing else."""
    B = 4
    monkeypatch.setattr(moe_ops, "compact_units", lambda *args: units)
    monkeypatch.setattr(moe_ops, "COMPACT_SINGLE_BLOCK_MMA_SHRINK", True)  # units of 1 block
    five, six, _, _, _, blocks = _shrink_buffers(torch.bfloat16, rank=12, K=32, B=B, pairs=9,
                                                 projection="w13", monkeypatch=monkeypatch,
                                                 kernel=kernel)  # fmt: skip
    assert int(((blocks.num_tokens_post_padded + B - 1) // B).sum()) > units
    assert bool((five != 7.0).any()), "the shrink stored nothing"
    assert torch.equal(six.view(torch.int32), five.view(torch.int32))
