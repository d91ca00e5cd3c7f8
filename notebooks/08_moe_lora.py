# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 8. LoRA on the experts of a mixture-of-experts layer
#
# A mixture-of-experts (MoE) layer sends each token to a few of its many experts
# (Qwen3-30B-A3B: 8 of 128), each expert an MLP of its own. A LoRA adapter for such a
# model has an A and a B **per expert**, so a token's update depends on two things at
# once: its adapter (its slot) and the expert it is routed to. This notebook builds
# vLLM's `add_lora_fused_moe` the way the earlier notebooks built the linear layer:
# the dense computation, the metadata, a per-thread emulation, the Numba kernels, and
# the wrapper's calls, each checked against the one before.
#
# **You will learn**
#
# - what MoE LoRA computes, pair by pair: a token on its k-th expert is a *pair*, and
#   the gate/up projection (w13) and the down projection (w2) read different rows;
# - how the pairs are sorted by slot and expert into blocks (vLLM's
#   `moe_lora_align_block_size` layout), on the device and without a sync;
# - how a kernel walks those blocks, emulated thread by thread in Python;
# - the library's kernels and the wrapper's two calls, checked against the reference.

# %%
import torch

import punica_numba
from punica_numba import LoRAMapping, PunicaWrapperNumba, reference
from punica_numba.moe_meta import align_pairs, aligned_sizes
from punica_numba.ops.moe import fused_moe_lora

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
torch.manual_seed(0)
print(f"device: {DEVICE}")

# %% [markdown]
# ## Pairs, and what each one adds
#
# Take M tokens, E experts and top-k routing: the router gives token t the experts
# `topk_ids[t, :]` with weights `topk_weights[t, :]`. Pair `p = t * top_k + k` is token
# t on expert `topk_ids[t, k]`. Each slot l (an adapter) holds, for every expert e,
# `A[l, e]: [r, K]` and `B[l, e]: [N, r]`.
#
# The layer's two projections use them differently:
#
# - **w13** (gate and up, two slices) reads the token's hidden state: every pair of a
#   token reads the same row `x[t]`;
# - **w2** (down, one slice) reads each expert's own activation, a row per pair
#   `x[p]`, and its result is scaled by the pair's routing weight
#   (`mul_routed_weight`).
#
# Either way the pair's delta goes into its own row `y[t, k]`. Below, a batch with the
# awkward cases in it: a token without an adapter (slot -1), a slot that is switched
# off, and an expert slot -1 ("not routed").

# %%
M, top_k, E, L = 6, 2, 4, 3  # tokens, experts per token, experts, slots
K, r, N = 8, 2, 5  # input width, rank, output width of a slice
slots = torch.tensor([0, 2, -1, 1, 0, 2], device=DEVICE)  # token 2: no adapter
adapter_enabled = torch.tensor([1, 1, 0], dtype=torch.int32, device=DEVICE)  # slot 2 is off
topk_ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, -1], [1, 0], [2, 3]], device=DEVICE)
topk_weights = torch.rand(M, top_k, device=DEVICE)

x13 = torch.randn(M, K, device=DEVICE)  # w13's input: a row per token
a13 = [torch.randn(L, E, r, K, device=DEVICE) for _ in ("gate", "up")]
b13 = [torch.randn(L, E, N, r, device=DEVICE) for _ in ("gate", "up")]
y13 = torch.zeros(M, top_k, 2 * N, device=DEVICE)

# The computation as plainly as it can be written: pair by pair, slice by slice.
by_hand = y13.double().clone()
for t in range(M):
    slot = int(slots[t])
    if slot == -1 or not adapter_enabled[slot]:
        continue
    for k in range(top_k):
        e = int(topk_ids[t, k])
        if e == -1:
            continue
        for s in range(2):
            delta = b13[s][slot, e].double() @ (a13[s][slot, e].double() @ x13[t].double())
            by_hand[t, k, s * N : (s + 1) * N] += delta

want13 = reference.fused_moe_lora(
    y13, x13, a13, b13, topk_ids, topk_weights, slots, adapter_enabled=adapter_enabled
)
assert torch.allclose(by_hand, want13)
reached = int((by_hand != 0).any(dim=2).sum())
print(f"{M * top_k} pairs, {reached} with a delta (no adapter, slot off or no expert: none)")

# %% [markdown]
# ## Sorting the pairs into blocks
#
# A kernel wants each (slot, expert)'s pairs side by side, so that one CUDA block loads
# one A and one B for all of them. vLLM's layout gives every slot a row: the slot's
# pairs, expert by expert, each expert's run padded (with the value P, "no pair") to a
# multiple of `block_size`; `expert_ids[l, b]` names the expert of block b of row l, and
# `num_tokens_post_padded[l]` how long row l's runs are. Built by hand, in plain Python:

# %%
block_size = 2
P = M * top_k
padded_len, num_blocks = aligned_sizes(P, E, block_size)
rows = [[P] * padded_len for _ in range(L)]
experts = [[-1] * num_blocks for _ in range(L)]
totals = [0] * L
for slot in range(L):
    if not adapter_enabled[slot]:
        continue
    column = 0
    for e in range(E):
        run = [p for p in range(P) if slots[p // top_k] == slot and topk_ids.view(-1)[p] == e]
        if not run:
            continue  # an expert no pair of this slot uses: no block
        rows[slot][column : column + len(run)] = run
        length = -(-len(run) // block_size) * block_size
        for b in range(column // block_size, (column + length) // block_size):
            experts[slot][b] = e
        column += length
    totals[slot] = column

for slot in range(L):
    print(f"slot {slot}: pairs {rows[slot][: totals[slot]]}, experts of its blocks "
          f"{experts[slot][: totals[slot] // block_size]}")  # fmt: skip

# %% [markdown]
# The library's `align_pairs` makes the same with torch alone: one key per pair
# (`slot * E + expert`, or "none"), a `scatter_add` to count each key's pairs, the
# padded counts' running sums for where each run starts, a stable sort for the order
# within a run, and a `searchsorted` for each block's expert. Every tensor has a size
# fixed by P, E, the block size and the slot count, and nothing is read back to the
# host, so a CUDA graph can capture it (the GPU tests replay it).

# %%
blocks = align_pairs(topk_ids, slots, E, block_size, L, adapter_enabled)
assert blocks.sorted_token_ids.tolist() == rows
assert blocks.expert_ids.tolist() == experts
assert blocks.num_tokens_post_padded.tolist() == totals
print("align_pairs: the same rows, experts and totals")

# %% [markdown]
# ## A kernel, thread by thread
#
# A CUDA block takes block b of row l for one slice. Its threads split the outputs: in
# the shrink a thread computes one (pair, rank) entry of the fp32 buffer `[S, P, r]`,
# a dot product of length K; in the expand a thread owns one output column and, for
# every pair of the block, adds `buffer[s, p] @ B[l, e][n]` into `y[t, k, s * N + n]`.
# A block of expert -1, or past the row's last, leaves at once. Emulated in Python, one
# loop iteration per thread:

# %%
THREADS = 4  # per block, in this emulation


def emulate(y, x, a, b, blocks, by_pair, weights):
    """The kernels of ``punica_numba.kernels.moe_shrink`` and ``moe_expand``, one Python
    step per thread."""
    out = y.double().clone()
    slices = len(a)
    buffer = torch.zeros(slices, P, r, dtype=torch.float64, device=DEVICE)
    for kernel in ("shrink", "expand"):
        for slot in range(L):  # blockIdx.y
            for bx in range(num_blocks):  # blockIdx.x
                for s in range(slices):  # blockIdx.z
                    start = bx * block_size
                    e = int(blocks.expert_ids[slot, bx])
                    if start >= int(blocks.num_tokens_post_padded[slot]) or e == -1:
                        continue  # the whole block leaves
                    pairs = blocks.sorted_token_ids[slot, start : start + block_size].tolist()
                    for tid in range(THREADS):  # threadIdx.x
                        if kernel == "shrink":
                            for o in range(tid, block_size * r, THREADS):
                                p, j = pairs[o // r], o % r
                                if p < P:
                                    row = x[p if by_pair else p // top_k].double()
                                    buffer[s, p, j] = a[s][slot, e, j].double() @ row
                        else:
                            for n in range(tid, N, THREADS):
                                for p in pairs:
                                    if p < P:
                                        t, k = divmod(p, top_k)
                                        acc = buffer[s, p] @ b[s][slot, e, n].double()
                                        acc *= float(weights[t, k]) if by_pair else 1.0
                                        out[t, k, s * N + n] += acc
    return out


assert torch.allclose(emulate(y13, x13, a13, b13, blocks, False, topk_weights), want13)

# w2: a row per pair, each delta weighted by the router.
x2 = torch.randn(P, K, device=DEVICE)
a2, b2 = [torch.randn(L, E, r, K, device=DEVICE)], [torch.randn(L, E, N, r, device=DEVICE)]
y2 = torch.zeros(M, top_k, N, device=DEVICE)
want2 = reference.fused_moe_lora(
    y2, x2, a2, b2, topk_ids, topk_weights, slots, mul_routed_weight=True,
    adapter_enabled=adapter_enabled,
)  # fmt: skip
assert torch.allclose(emulate(y2, x2, a2, b2, blocks, True, topk_weights), want2)
print("the emulated kernels give the reference, for w13 and for w2")

# %% [markdown]
# ## The Numba kernels
#
# `punica_numba.kernels.moe_shrink` and `moe_expand` hold the two kernels just emulated, and
# `punica_numba.ops.moe.fused_moe_lora` checks a call and launches them (the shrink
# into an fp32 buffer of its own, then the expand into y). They are the first rung:
# a thread per output, no shared memory, no tensor cores; they run on the simulator
# here when there is no GPU. In bf16 the result is rounded once, when it is stored.

# %%
for dtype in (torch.float32, torch.bfloat16):
    y = y13.to(dtype, copy=True)  # (a copy even in fp32: the call writes it)
    fused_moe_lora(
        y, x13.to(dtype), [w.to(dtype) for w in a13], [w.to(dtype) for w in b13],
        topk_weights, *blocks, adapter_enabled, block_size=block_size,
    )  # fmt: skip
    want = reference.fused_moe_lora(
        y13, x13.to(dtype), [w.to(dtype) for w in a13], [w.to(dtype) for w in b13],
        topk_ids, topk_weights, slots, adapter_enabled=adapter_enabled,
    )  # fmt: skip
    error = float((y.double() - want).abs().max() / want.abs().max())
    assert error < (1e-6 if dtype == torch.float32 else 1e-2), error
    print(f"{dtype}: largest error {error:.1e} of the largest output")

# %% [markdown]
# ## vLLM's two calls
#
# In vLLM the MoE layer asks the Punica wrapper for the blocks of its step
# (`moe_lora_align_block_size`, with the tokens' slots of the last `update_metadata`),
# then hands them, with the stacked weights, to `add_lora_fused_moe`. The block size is
# that of the shrink's configuration (`BLOCK_SIZE_M`); the blocks come back flat, as
# vLLM's do, and are viewed a row per slot.

# %%
wrapper = PunicaWrapperNumba(max_num_batched_tokens=16, max_batches=4, device=DEVICE, max_loras=L)
ids = [101 + s if s >= 0 else 0 for s in slots.tolist()]  # adapter ids 101, 102, 103
wrapper.update_metadata(LoRAMapping(ids, ids), [101, 102, 103], L + 1, 32000, 0)
_, sorted_ids, expert_ids, post = wrapper.moe_lora_align_block_size(
    topk_ids, M, block_size, E, L, adapter_enabled
)
y = y13.clone()
wrapper.add_lora_fused_moe(
    y, x13, a13, b13, topk_weights, sorted_ids.view(L, -1), expert_ids.view(L, -1), post,
    r, top_k, {"BLOCK_SIZE_M": block_size}, {}, adapter_enabled,
)  # fmt: skip
assert torch.allclose(y.double(), want13, rtol=1e-5, atol=1e-5)
print("the wrapper's add_lora_fused_moe gives the reference")

# %% [markdown]
# ## What is next
#
# These kernels are correct on every case the property tests draw (`tests/test_moe.py`:
# tiny shapes on the simulator; 64-128 experts, top-8, hidden 2048-4096, rank 16-64 on
# a GPU), and the align step and both calls are captured in a CUDA graph there. They
# are not fast: a thread per output reads its rows of A or B with no reuse beyond the
# caches. The package's later versions are the next rungs, each checked the same way:
# 2 reads a block's pairs and its A once, in shared-memory tiles
# (`kernels.moe_shrink_tiled`); 3 splits K across a CUDA block's threads in the shrink and
# keeps each thread's columns of B in registers in the expand (`kernels.moe_shrink_split`,
# `kernels.moe_expand_columns`).
# On an H200 at Qwen3-30B-A3B's layer (`bench --moe`) version 3 takes 0.06-0.23x this
# rung's time, and beats vLLM's Triton `fused_moe_lora`
# (`docs/benchmarks/peers/vllm_moe_lora.py`) with few tokens or many adapters but not
# from 256 tokens on one to four adapters, where a block's pairs are many enough for the
# tensor cores (`docs/benchmarks/lab_notes.md`). Version 4 is that rung: a block's pairs
# as the rows of `mma.sync` tiles in both kernels (`kernels.moe_shrink_mma`,
# `kernels.moe_expand_mma`, the fp32 buffer split into two bf16 for the expand), for bf16
# or fp16 with K and the rank multiples of 4 (other calls run version 3's kernels). Version
# 5 takes 4's shrink where a call's pairs average 4 or more a (slot, expert) block, else
# 3's, and 3's expand always (timed kernel by kernel on an H200, 4's shrink lost with one
# pair a block and 4's expand on every case). On the H200 version 5 takes 0.53-0.87x
# version 3's time where its blocks are full enough for the tensor cores, and version 3's
# kernels elsewhere. Version 6 (whose kernels the default still takes where the tensor cores
# cannot take a call) waits on
# memory less where blocks are full: its expand takes a chunk of a block's pairs at once,
# asking for all their old outputs together and forming the sums as outer products, rank
# by rank (`kernels.moe_expand_outer`); its tensor-core shrink reads each row of x once for
# both slices of w13, loads a warp's next chunk of K before it multiplies this one, and
# reads each chunk of A once for a run of blocks of one expert; and the runs and the expand
# go on grids that hold only the blocks the call's pairs can fill. On the H200 its expand
# won from about 16 pairs a block and lost below, so it runs only there
# (`OUTER_EXPAND_FROM_PAIRS`); as a whole version 6 took 0.76-0.96x version 5's time on 9
# of the benchmark's 30 cases and within 3 % of it on the others.
# It stores the same bits as version 5 (the sums in the same order):

# %%
stored = {}
for version in (5, 6):
    y = y13.to(torch.bfloat16, copy=True)
    fused_moe_lora(
        y, x13.to(torch.bfloat16), [w.to(torch.bfloat16) for w in a13],
        [w.to(torch.bfloat16) for w in b13], topk_weights, *blocks, adapter_enabled,
        block_size=block_size, version=version,
    )  # fmt: skip
    stored[version] = y.view(torch.int16)  # the bits
assert torch.equal(stored[5], stored[6])
print("versions 5 and 6 store the same bf16 bits")

# %% [markdown]
# Version 6's runs of blocks and its expand take *compact* grids. The grids above launch a
# row's bound of blocks for every slot (`aligned_sizes`), and a CUDA block past its row's
# blocks in use leaves at once; at Qwen3-30B-A3B's layer, 2048 tokens over 16 adapters,
# that is 18,304 CUDA blocks of which at most 2,944 find pairs
# (`kernels.moe_blocks.units_in_use` counts the most a call's pairs can fill). A compact
# grid launches that many and no more, and CUDA block x takes the blocks in use numbered x,
# x + G, x + 2G, ... (G the grid's size), counting them slot by slot from the rows' totals.
# That walk over the slots has a cost of its own: on the H200 it made the shrinks of single
# blocks slower than the idle CUDA blocks did, so those keep version 5's grid. Emulated here
# on a grid of two, fewer than the blocks in use, so that each CUDA block takes several:

# %%
from punica_numba.kernels.moe_blocks import units_in_use


def block_number(v, blocks):
    """``(slot, b)`` of the v-th block in use, counting slot by slot (the kernels'
    ``moe_blocks.unit_walker``, one block a unit); ``(-1, 0)`` past the last."""
    for slot in range(L):
        used = -(-int(blocks.num_tokens_post_padded[slot]) // block_size)
        used *= int(adapter_enabled[slot])  # (a slot turned off has none)
        if v < used:
            return slot, v
        v -= used
    return -1, 0


G = 2  # CUDA blocks along x
taken = []
for x in range(G):  # blockIdx.x
    v = x
    while (found := block_number(v, blocks))[0] != -1:
        taken.append(found)
        v += G
in_use = [
    (slot, b)
    for slot in range(L)
    for b in range(num_blocks)
    if b * block_size < int(blocks.num_tokens_post_padded[slot]) and adapter_enabled[slot]
]
assert sorted(taken) == in_use  # every block in use, each once
assert len(in_use) <= units_in_use(P, L, E, block_size, 1)
print(f"{len(in_use)} blocks in use, {L * num_blocks} in the full grid, taken by {G} CUDA blocks")
print("Qwen3-30B-A3B, 2048 tokens over 16 adapters:", units_in_use(2048 * 8, 16, 128, 16, 1))

# %% [markdown]
# An MoE expand is the dense expand on other rows: pair `p` adds its buffer row times its
# (slot, expert)'s B into its own row of `y.view(P, W)`, as token `t` adds its buffer row
# times its slot's B into row `t`; and its shrink is the dense shrink but that w13's pairs
# of a token read the token's row of x (row `p // top_k`). Version 7 hands both to the dense
# op's tensor-core kernels, tuned for every layer shape (lab notes, "MoE LoRA version 7"):
# (slot l, expert e) is dense slot `l * E + e` of each A and B viewed `[L * E, ...]`, and
# each block of pairs becomes tiles of the dense tile table, with its pairs as the tile's
# tokens (`ops.moe_dense.moe_tiles`: one kernel, a thread a tile, rows for the blocks in use
# first and idle ones up to a bound the host knows); w2's router weights go into the buffer
# before the expand. The blocks above, as tiles (slot `l * E + e`, where its pairs start in
# the list of every tile's, pairs, first pair), those in use:

# %%
from punica_numba.ops.moe_dense import moe_tiles

table, tile_pairs = moe_tiles(*blocks, adapter_enabled, block_size, P, E)
print(table[table[:, 0] >= 0].tolist())

# %% [markdown]
# Its tensor cores take 16-bit x, A, B and y, K a multiple of 8 and widths and rank whole
# words of four elements (otherwise version 7 runs version 6's kernels). A w13 layer of such
# sizes, against version 6:

# %%
N7, r7 = 8, 4
a7 = [torch.randn(L, E, r7, K, device=DEVICE).to(torch.bfloat16) for _ in ("gate", "up")]
b7 = [torch.randn(L, E, N7, r7, device=DEVICE).to(torch.bfloat16) for _ in ("gate", "up")]


def w13_rows(version: int) -> torch.Tensor:
    """This w13 layer's outputs (from zeros) by the kernels of ``version``."""
    y = torch.zeros(M, top_k, 2 * N7, device=DEVICE, dtype=torch.bfloat16)
    fused_moe_lora(
        y, x13.to(torch.bfloat16), a7, b7, topk_weights, *blocks, adapter_enabled,
        block_size=block_size, version=version,
    )  # fmt: skip
    return y.float()


result = {version: w13_rows(version) for version in (6, 7)}
torch.testing.assert_close(result[7], result[6], rtol=2e-2, atol=2e-2)
print("version 7 gives version 6's outputs, within bf16's rounding")

# %% [markdown]
# The dense kernels' tiles are 16 rows whatever a block holds, so they pay only where the
# blocks are full. On an H100 (at cb9702d, `bench --moe`) version 7 took 0.56-0.90x version
# 6's time where the pairs average a tile (16) or more a (slot, expert), and up to 1.62x
# below. Version 8 chooses by that average (`pairs_per_block`, from the
# shapes alone: no sync): version 7's kernels from `DENSE_FROM_PAIRS` on, version 6's below.
# On an H200 it took 0.46-0.85x version 6's time where it takes version 7's kernels.
# At Qwen3-30B-A3B's shape (128 experts, top-8):

# %%
from punica_numba.ops.moe import DENSE_FROM_PAIRS, pairs_per_block

for T, loras in ((1, 16), (64, 1), (256, 1), (2048, 4), (2048, 16)):
    average = pairs_per_block(T * 8, loras, 128)
    kernels = 7 if average >= DENSE_FROM_PAIRS else 6
    print(f"{T:5d} tokens over {loras:2d} adapters: {average:5g} pairs a (slot, expert), "
          f"version {kernels}'s kernels")  # fmt: skip

# %% [markdown]
# Below it each (slot, expert) has a few pairs, and where it has a pair or two version 6's
# kernels run far from the copy bandwidth. The dense op meets the same shape where each slot
# has a token or two, and takes its row kernels there, one token a tile. Version 9 (the
# default until version 11) hands those calls to them below 4 pairs a (slot, expert), the
# threshold of version 6's tensor-core shrink: every pair a one-token tile of dense slot
# `l * E + e`, the router's weights multiplied in as the shrink stores a pair's row. On an
# H100 (at 6426c98) it took 0.54-0.99x version 8's time there and 0.98-1.003x elsewhere;
# taken above the threshold too (at a4b05b8), the row kernels took up to 1.96x. The
# align step pads each run of pairs to whole blocks, so the pairs are packed first, one kernel
# making a table of P rows (`moe_pairs`: a running sum of each block's pairs), that no CUDA
# block of the row kernels finds nothing. Here it is for the call above, then the call itself:

# %%
from punica_numba.ops.moe_dense import moe_pairs

table, pair_rows = moe_pairs(*blocks, adapter_enabled, block_size, M * top_k, E)
live = table[:, 0] >= 0
print("dense slot (l * E + e) of each pair:", table[live, 0].tolist())
print("the pairs, in that order:          ", pair_rows[live].tolist())

torch.testing.assert_close(w13_rows(9), result[6], rtol=2e-2, atol=2e-2)
print("version 9 gives version 6's outputs, within bf16's rounding")

# %% [markdown]
# Versions 7 to 9 launch the dense op's kernels, so each launch chooses its configuration as
# the dense op does (`launch.choose_launch_config`): the tuned table's pick for the nearest
# problem measured, else the heuristic. Measured on linear layers, those picks did not suit
# MoE's calls: on an H100 (at a949933, no table) the op with the picked shrink of 16-pair tiles
# took up to 1.66x its time under the fastest shrink. So `python -m punica_numba tune --moe`
# times the MoE op's own calls under every configuration each path can run, and writes
# entries of their own (`"layer": "moe"`) that these launches read before the dense ones.
# With the H200's, shipped in the package, w13 at 2048 tokens over four adapters went from
# 171 to 90 µs there (lab notes, "MoE LoRA's own entries in the tuned table").

# %% [markdown]
# ## One launch for one token
#
# At one token of top-8 the pairs are eight, and version 9's three launches (the table of
# pairs, the shrink, the expand) take about 2 µs each on an H100, most of it waiting: for the
# launch, then for each trip to memory. Each pair's delta needs only its own block's A and
# B, so one CUDA block can take a block of pairs all the way from its entries to its rows of
# y, the shrunk rows between the two products kept in shared memory
# (`punica_numba.kernels.moe_fused`): no table, no buffer in global memory, one launch. Its
# warps each take a few ranks and split K among their lanes, whose partial sums meet by warp
# shuffles; one barrier, and the threads expand, each with its columns of B loaded before
# the shrink began.
#
# Version 11 takes that launch for calls of at most `FUSED_TO_PAIRS` (8)
# pairs and version 9's kernels above: on an H100 (at aa6b0cd) one token took 0.65-0.83x
# version 9's time at w2 and 0.84-0.98x at w13, over 1, 4 and 16 adapters; at 16 tokens the
# one launch was slower on 4 of 6 calls, where version 9's kernels, each shaped for its own
# half of the work, have blocks enough to fill the GPU. Here the first token's pairs alone,
# aligned again, against version 6's rows of that token:

# %%
one_token = align_pairs(topk_ids[:1], slots[:1], E, block_size, L, adapter_enabled)
y = torch.zeros(1, top_k, 2 * N7, device=DEVICE, dtype=torch.bfloat16)
fused_moe_lora(
    y, x13[:1].to(torch.bfloat16), a7, b7, topk_weights[:1], *one_token, adapter_enabled,
    block_size=block_size, version=11,
)  # fmt: skip
torch.testing.assert_close(y.float(), result[6][:1], rtol=2e-2, atol=2e-2)
print("version 11's one launch gives version 6's rows of the first token")

# %% [markdown]
# ## The tiles from 4 pairs a (slot, expert)
#
# Version 8's threshold, a tile's worth (16) of pairs a (slot, expert), was measured against
# version 7's tiles as they were then. Since, the tiles have taken version 9's stores of the
# router's weights, the tuned MoE entries and, on a GPU without a table, blocks of 4 warps
# where they are many; version 6's kernels have not changed. On an H100 (at 470088f,
# `probes/moe_dense_from_pairs.py`) the tiles took 0.61-0.73x version 6's kernels' time on
# every call of 4 to 16 pairs a (slot, expert) at r=16, and 0.32-0.66x at r=64, even with
# three quarters of each tile padding at 4. So version 12 is version 11 with the tiles
# from `TILES_FROM_PAIRS` (4), where the pairs path stops (below it the tiles lost: at
# dfa2c7a, 1.05-1.44x the pairs path's time at about one pair): version 6's kernels run
# only where the tensor cores cannot take a kernel. The same calls as above:

# %%
from punica_numba.ops.moe import MMA_SHRINK_FROM_PAIRS, one_launch, tiles_from_pairs

for T, loras in ((1, 16), (64, 1), (256, 1), (2048, 4), (2048, 16)):
    average = pairs_per_block(T * 8, loras, 128)
    for version in (11, 12):
        if one_launch(T * 8, version):
            path = "the one launch"
        elif average < MMA_SHRINK_FROM_PAIRS:
            path = "the pairs"
        else:
            path = "the tiles" if average >= tiles_from_pairs(version) else "version 6's kernels"
        print(f"{T:5d} tokens over {loras:2d} adapters, version {version}: {path}")

# %% [markdown]
# ## One launch up to 8 tokens
#
# Version 11's threshold, 8 pairs, was one token of top-8: between it and 16 tokens nothing
# was measured, and decode batches of 2 to 15 tokens are common. On an H100 (at dfa2c7a,
# `probes/moe_fused_ab.py --tokens`) the one launch, forced past its threshold, took
# 0.62-0.99x the pairs path's time on every call of 2, 4 and 8 tokens (16 to 64 pairs) over 1,
# 4 and 16 adapters at both projections, and was slower on 13 of the 18 calls of 10, 12 and
# 16 tokens. So version 13 (the default until version 14, below) is version 12 with the one
# launch up to `ONE_LAUNCH_TO_PAIRS` (64) pairs. The layer above has 12 pairs (6 tokens of
# top-2): past version 12's one launch, within version 13's. Both against version 6:

# %%
from punica_numba.ops.moe import one_launch_to_pairs

for version in (12, 13):
    torch.testing.assert_close(w13_rows(version), result[6], rtol=2e-2, atol=2e-2)
    print(f"version {version} (one launch: {one_launch(M * top_k, version)}): version 6's rows")
for T in (1, 4, 8, 16):
    sides = [f"version {v}: {one_launch(T * 8, v)}" for v in (12, 13)]
    print(f"{T:2d} tokens of top-8 ({T * 8:3d} pairs) in one launch?", ", ".join(sides))
print("version 13 takes the one launch up to", one_launch_to_pairs(13), "pairs")

# %% [markdown]
# ## The table of pairs without one block's running sum
#
# Version 9's table of pairs (`moe_pairs`, above) is made by one CUDA block, which works out
# where each block's pairs go by a running sum over every block in use, in rounds of its 1024
# threads. On an H100 (at c543804, `probes/moe_pairs_steps.py`) it took 4 µs at one token and
# 27 µs at 256 tokens over 16 adapters, a fifth of the op. The row kernels that read it need
# no order: each of their CUDA blocks reads its own row, and every pair's sums go to its own
# row of the buffer and of y. The order is worth something to the L2 only: the pairs of one
# (slot, expert) read the same A, and in neighbouring rows they run at the same time.
#
# So version 14 packs the pairs with *runs* of the metadata's entries that each claim their
# rows at once (`ops.moe_dense.claimed_pairs`, `kernels.moe_claims`): a thread an entry,
# a running sum within the run's CUDA block, and one atomic add a run on a count of the rows
# claimed, which tells the run where its rows start. The rows are `moe_pairs`' rows, each
# run's pairs together and in order, the runs in whatever order their atomic adds land. In
# plain Python, runs of 4 entries, claiming in turn:

# %%
from punica_numba.ops.moe_dense import claimed_pairs


def claimed_by_runs(blocks, run: int = 4) -> list[list[int]]:
    """The (dense slot, pair) of each row that runs of ``run`` entries claim, in turn."""
    ids, expert_of, padded = (t.tolist() for t in blocks)
    rows = []
    for slot in range(L):
        in_use = -(-padded[slot] // block_size) * block_size if adapter_enabled[slot] else 0
        for start in range(0, len(ids[slot]), run):
            entries = range(start, min(start + run, in_use, len(ids[slot])))
            named = [
                [slot * E + expert_of[slot][q // block_size], ids[slot][q]]
                for q in entries
                if ids[slot][q] < P and 0 <= expert_of[slot][q // block_size] < E
            ]
            rows += named  # the rows claimed, len(rows) before, .. after
    return rows


table, claimed_rows = claimed_pairs(*blocks, adapter_enabled, block_size, P, E)
live = table[:, 0] >= 0
by_claims = table[live][:, [0, 3]].tolist()
print("claimed here (dense slot, pair):", by_claims)
packed, _ = moe_pairs(*blocks, adapter_enabled, block_size, P, E)
assert sorted(by_claims) == sorted(claimed_by_runs(blocks))
assert sorted(by_claims) == sorted(packed[packed[:, 0] >= 0][:, [0, 3]].tolist())
print("the same rows as moe_pairs', and as the runs claim them in plain Python")

# %% [markdown]
# On an H100 (at 5d9b04e, `probes/moe_pairs_steps.py`) the claimed table took 3.4-9.6 µs where
# the running sum took 3.7-27.2 (5.8 against 27.2 at 256 tokens over 16 adapters), and the
# shrink after it took the same time: the runs kept each (slot, expert)'s pairs together. Whole,
# the op took 0.77-0.98x version 13's time on every call of `bench --moe` on the pairs path, so
# version 14 became the default (until version 16, below). The layer above (12 pairs) takes the
# one launch at version 14 too, and the two tables feed the same row kernels, so its rows are
# version 13's:

# %%
torch.testing.assert_close(w13_rows(14), result[6], rtol=2e-2, atol=2e-2)
print("version 14: version 6's rows")

# %% [markdown]
# ## The one launch past 8 tokens, where the adapters are many
#
# Past 64 pairs version 14 takes the pairs path. A build of the one launch with 8 columns of
# y a thread, not 4 (a slice cut into half as many column groups, each of which shrinks the
# block's pairs again), took 0.82-0.97x that path's time on 11 of 12 calls of 10 to 16 tokens
# over 4 and 16 adapters on an H100 (at 31898a8, `probes/moe_fused_ab.py --against 14`), and
# 0.97-1.20x over one adapter. From the shapes alone, what sets those calls apart is how many
# (slot, expert)s there are for each pair: over 4 or 16 adapters of 128 experts many, over one
# about one. So version 16 takes that build (`FUSED_PAIRS_SPARSE`) from 65 to 128 pairs where
# the (slot, expert)s are at least twice the pairs (`fused_config`), and version 14's kernels
# elsewhere (on the simulator the two builds take 1 and 2 columns a thread, on a GPU 4 and 8).
# As a version, on an H100 at 2c4bce5, it took 0.88-0.98x version 14's time on three of the four
# calls of `bench --moe` it changes and 1.05x on the fourth (w13's 16 tokens over 4 adapters,
# which the build had lost before too), and past 16 tokens the same build lost on every call
# timed (32 to 256 tokens). So version 16 is the default, and its one launch stops at 128 pairs.

# %%
from punica_numba.ops.moe import fused_config

for T, loras in ((8, 1), (12, 1), (12, 4), (16, 16), (64, 16)):
    for version in (14, 16):
        config = fused_config(T * 8, loras, 128, version)
        path = "the pairs path" if config is None else f"one launch, {config.vec} columns"
        print(f"{T:2d} tokens over {loras:2d} adapters, version {version}: {path}")
torch.testing.assert_close(w13_rows(16), result[6], rtol=2e-2, atol=2e-2)
print("version 16 (this layer's 12 pairs: version 14's one launch): version 6's rows")
