# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 3. The shrink kernel
#
# Shrink computes, for every slice `s` and every token `t` whose slot is `l != -1`,
#
# ```
# out[s, t, :] += scale * x[t] @ A_s[l]^T        x: [T, H], A_s: [L, r, H], out: [S, T, r] fp32
# ```
#
# This notebook takes that sentence down the ladder, one rung at a time, checking
# each rung against `punica_numba.reference`: dense torch, then plain Python loops
# that play the part of every CUDA block and thread, then a naive Numba kernel, then
# the library's `lora_shrink`.
#
# **You will learn**
#
# - how a block finds its work: one *tile* of up to `TILE_M` tokens of one segment,
#   with a grid sized without reading the segment sizes back to the host;
# - how the threads of a block split the hidden dimension and add their partial sums
#   with a tree in shared memory (deterministic: no atomics);
# - how to write, launch and check a Numba CUDA kernel that runs on the simulator and
#   on a GPU unchanged (bf16 travels as `int16` bits);
# - the memory-traffic budget of shrink, and the floor it sets at 4.2 TB/s for a
#   decode step.

# %%
import time

import numpy as np
import torch
from IPython.display import Markdown, display
from numba import float32

import punica_numba
from punica_numba import LoRAKernelMeta, lora_shrink, reference
from punica_numba._cuda import cuda, kernel_array, launch_stream
from punica_numba.kernels.dtypes import loader
from punica_numba.kernels.segments import tile_grid_bound, tile_table
from punica_numba.launch import force_launch_config, launch_configs

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
DTYPE = torch.bfloat16  # the serving dtype; fp32 accumulation everywhere
SCALE = 0.5

# The Python emulation runs at a tiny size on both machines (it is Python); the
# kernels also run at a realistic size on a GPU. Awkward on purpose: T is not a
# multiple of the tile, H is odd, r is not a multiple of TILE_N.
TINY = dict(T=13, H=37, R=5, L=4, S=2)
SIZES = [TINY] if SIMULATOR else [TINY, dict(T=253, H=4096, R=16, L=8, S=3)]
print(f"{'simulator' if SIMULATOR else 'GPU'}; sizes: {SIZES}")


def make_problem(T, H, R, L, S, seed=0):
    """x, the S stacked A's, the slots (some -1, uneven) and prepared metadata."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DTYPE).to(DEVICE)  # [T, H]
    A = [(torch.randn(L, R, H, generator=gen) / H**0.5).to(DTYPE).to(DEVICE) for _ in range(S)]
    slots = torch.randint(-1, L, (T,), generator=gen)  # [T], -1 = no adapter
    slots[0] = L - 1  # at least one token with an adapter, the last slot used
    slots[1::5] = -1  # and some without
    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    return x, A, slots.to(DEVICE), meta


# fp32 sums of H products err by about sqrt(H) roundings: H = 4096 on a GPU needs more room.
RTOL32 = 1e-4 if SIMULATOR else 5e-4


def check_close(got, want, what, rtol=RTOL32):
    """max |got - want| <= rtol * max |want|, got in fp32 against the float64 reference."""
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    assert err <= rtol * scale, f"{what}: error {err:.3g} > {rtol} * {scale:.3g}"
    return err / scale


def reference_shrink(x, A, slots):
    out = torch.zeros(len(A), x.shape[0], A[0].shape[1], device=x.device)
    return reference.lora_shrink(x, A, out, slots, SCALE)  # [S, T, r] float64


x, A, slots, meta = make_problem(**TINY)
want = reference_shrink(x, A, slots)  # [S, T, r] float64: what every rung must give
display(meta)
assert want.shape == (TINY["S"], TINY["T"], TINY["R"]) and meta.num_tokens == TINY["T"]

# %% [markdown]
# ## Rung 0: dense torch, segment by segment
#
# Notebook 2's loop, over slices as well: one small GEMM per segment and slice. The
# work a kernel must do is exactly this; the kernel only does it in parallel.


# %%
def shrink_torch(x, A, meta, T, scale):
    out = torch.zeros(len(A), T, A[0].shape[1], dtype=torch.float32, device=x.device)
    _, order, counts, starts, ids, no_lora = meta.meta_args(T)
    if bool(no_lora):
        return out
    for slot, count, start in zip(ids.tolist(), counts.tolist(), starts.tolist()):
        if slot == -1 or count == 0:
            continue
        tokens = order[start : start + count].long()  # [count]
        for s, A_s in enumerate(A):
            out[s, tokens] += scale * x[tokens].float() @ A_s[slot].float().T  # [count, r]
    return out


check_close(shrink_torch(x, A, meta, TINY["T"], SCALE), want, "rung 0: torch")
print("rung 0 (torch, per segment) agrees with the reference")

# %% [markdown]
# ## How a block finds its tile
#
# The host does not know how many tokens each slot has this step: that lives on the
# device, and reading it back would stall the host and break CUDA-graph capture. So
# the grid is sized for the worst case and each block looks up its own work:
#
# - segment `i` is cut into `ceil(count[i] / TILE_M)` tiles of up to `TILE_M` tokens;
# - the tiles of all segments, the `-1` segment left out, are numbered in order;
# - block `b` along `x` takes tile number `b`, or exits if there are fewer tiles.
#
# Since `sum_i ceil(c_i / TILE_M) <= ceil(T / TILE_M) + (L + 1)`, a grid of that many
# blocks always suffices (`tile_grid_bound`). The teaching version below walks the
# segments for one block. The library instead builds the whole **tile table** at once
# on the device, with a `cumsum` of tiles per segment and a `searchsorted` of the block
# numbers (`punica_numba.kernels.segments.tile_table`), when it prepares the metadata;
# a block then does a single lookup, `table[blockIdx.x]`. Both must agree.
#
# The table holds more than the segment and offset the walk finds: the tile's slot,
# the position of its first token in the sorted order, its number of tokens, and that
# first token's row. Each is a read the block would otherwise make *after* learning its
# segment, and every read waits a trip to memory for the one before it. At decode,
# where a block has one token and little else to do, that chain is most of its time.
# A block reads its row of the table (16 bytes) in one load, so the four arrive
# together: read one by one, the compiler waited for the slot before asking for the
# rest, and the chain grew by a trip.

# %%
# The library picks a configuration per call from host-side facts (punica_numba.launch);
# here we take the one with the largest token tile, and later force the library to use it.
CFG = max((c for c in launch_configs("shrink") if c.kernel == "rows"), key=lambda c: c.tile_m)
THREADS, TILE_M, TILE_N = CFG.threads, CFG.tile_m, CFG.tile_n
print(f"launch config: {THREADS} threads/block, TILE_M={TILE_M} tokens, TILE_N={TILE_N} ranks")


def tile_of_block(block, ids, counts, tile_m):
    """(segment, offset of the tile's first token in it) of this block's tile, or (-1, 0)."""
    tiles_before = 0
    for segment, (slot, count) in enumerate(zip(ids, counts)):
        if slot == -1:
            continue
        tiles_here = -(-count // tile_m)  # ceil
        if block < tiles_before + tiles_here:
            return segment, (block - tiles_before) * tile_m
        tiles_before += tiles_here
    return -1, 0


T = TINY["T"]
_, order_t, counts_t, starts_t, ids_t, _ = meta.meta_args(T)
ids, counts, starts, order = (t.tolist() for t in (ids_t, counts_t, starts_t, order_t))
bound = tile_grid_bound(T, len(ids), TILE_M)
table = tile_table(ids_t, counts_t, starts_t, order_t, TILE_M, bound)  # [B, 4]
rows = []
for block in range(bound):
    seg, first = tile_of_block(block, ids, counts, TILE_M)
    library = tuple(table[block].tolist())  # slot, position, rows, first token
    if seg == -1:
        assert library == (-1, 0, 0, 0), (block, library)
        continue
    position, size = starts[seg] + first, min(TILE_M, counts[seg] - first)
    assert library == (ids[seg], position, size, order[position]), (block, library)
    rows.append(
        f"| {block} | {seg} | {ids[seg]} | {first} .. {first + size - 1} | {position} "
        f"| {size} | {order[position]} |"
    )
lines = [
    "| block | segment | slot | tokens of the segment | position | rows | first token |",
    "| ---: | ---: | ---: | :--- | ---: | ---: | ---: |",
]
display(Markdown("\n".join(lines + rows)))
print(f"{len(rows)} blocks have a tile; the grid bound is {bound}; the others exit at once")
assert len(rows) == sum(-(-c // TILE_M) for s, c in zip(ids, counts) if s != -1) <= bound

# %% [markdown]
# ## Rung 1: every thread, emulated in Python
#
# Now the kernel's algorithm with the CUDA indices written out as Python loops.
# One block = one tile (`blockIdx.x`), one slice (`blockIdx.y`) and a group of
# `TILE_N` ranks (on the GPU `blockIdx.z`; here a loop, which is equivalent). Inside:
#
# 1. thread `tid` walks `k = tid, tid + THREADS, ...` over the hidden dimension and
#    keeps `TILE_M * TILE_N` partial dot products (tokens × ranks) in registers;
# 2. the threads write their partials to shared memory, and a tree halves the number
#    of live threads each step (`tid < stride` adds `tid + stride`), `log2(THREADS)`
#    steps with a barrier between them;
# 3. thread `tid < TILE_M * TILE_N` adds one finished dot product into `out`.
#
# On a GPU the library does step 2 differently: the 32 threads of a warp add their
# partials with five register shuffles (`cuda.shfl_down_sync`, no barrier), and only
# the warps' sums meet in shared memory. The simulator has no shuffles, so there the
# kernel uses the tree, exactly as emulated here; on a GPU the sums are added in
# another (also fixed) order and agree within fp32 rounding.
#
# The emulation computes in float32 like the kernel, and counts every element it
# loads from global memory. (The library's kernel reads `x` and `A` in 8-byte words,
# four bf16 elements per load, when every row is a whole number of words; a word is
# then the unit of the strided walk. Here `H = 37` is odd, so it reads single elements
# like the emulation.)


# %%
def bf16_to_f32(t):
    return t.float().cpu().numpy()


def shrink_emulated(x, A, out, meta, T, scale, reads):
    """The kernel's arithmetic, one Python loop per CUDA index; returns the new out."""
    xs, ws, o = bf16_to_f32(x), [bf16_to_f32(a) for a in A], out.cpu().numpy().copy()
    order = meta.token_indices_sorted_by_lora_ids.cpu().numpy()
    counts = meta.num_tokens_per_lora.cpu().numpy().tolist()
    starts = meta.lora_token_start_loc.cpu().numpy()
    ids = meta.active_lora_ids.cpu().numpy().tolist()
    H = xs.shape[1]
    for block_x in range(tile_grid_bound(T, len(ids), TILE_M)):  # blockIdx.x
        segment, first = tile_of_block(block_x, ids, counts, TILE_M)
        if segment == -1:
            continue  # the whole block exits
        slot, rows = ids[segment], min(TILE_M, counts[segment] - first)
        # a short tile repeats its last token so every load is in bounds (never stored)
        tokens = [order[starts[segment] + first + min(j, rows - 1)] for j in range(TILE_M)]
        for block_y, w in enumerate(ws):  # blockIdx.y: the slice
            rank = w.shape[1]
            for n0 in range(0, rank, TILE_N):  # blockIdx.z: a group of TILE_N ranks
                tree = np.zeros((TILE_M * TILE_N, THREADS), np.float32)  # shared memory
                for tid in range(THREADS):  # threadIdx.x
                    partial = np.zeros(TILE_M * TILE_N, np.float32)  # registers
                    for k in range(tid, H, THREADS):  # k in [0, H), strided
                        xk = [xs[tokens[j], k] for j in range(TILE_M)]
                        reads["x"][block_x, tid] += TILE_M
                        for q in range(TILE_N):
                            wk = w[slot, min(n0 + q, rank - 1), k]
                            reads["A"][block_x, tid] += 1
                            for j in range(TILE_M):
                                partial[j * TILE_N + q] += xk[j] * wk
                    tree[:, tid] = partial
                stride = THREADS // 2  # syncthreads, then the tree:
                while stride > 0:  # threads tid < stride run this line in parallel
                    tree[:, :stride] += tree[:, stride : 2 * stride]
                    stride //= 2
                for tid in range(TILE_M * TILE_N):  # the threads that store
                    j, n = tid // TILE_N, n0 + tid % TILE_N
                    if j < rows and n < rank:
                        o[block_y, tokens[j], n] += np.float32(scale) * tree[tid, 0]
    return torch.from_numpy(o)


blocks = tile_grid_bound(T, len(ids), TILE_M)
reads = {name: np.zeros((blocks, THREADS), np.int64) for name in ("x", "A")}
out0 = torch.zeros(TINY["S"], T, TINY["R"])
emulated = shrink_emulated(x, A, out0, meta, T, SCALE, reads)
check_close(emulated, want.cpu(), "rung 1: emulation")
print("rung 1 (per-thread emulation) agrees with the reference")

# Every element each thread reads, totalled, against the budget the kernel promises.
H, R, S = TINY["H"], TINY["R"], TINY["S"]
rank_groups = -(-R // TILE_N)
busy = len(rows)  # blocks with a tile
assert reads["x"].sum() == busy * S * rank_groups * TILE_M * H
assert reads["A"].sum() == busy * S * rank_groups * TILE_N * H
print("elements of x loaded by threads 0..7 of block 0:", reads["x"][0, :8].tolist())
print("elements of A loaded by threads 0..7 of block 0:", reads["A"][0, :8].tolist())

# %% [markdown]
# Each thread reads only the columns `k ≡ tid (mod THREADS)`: neighbouring threads read
# neighbouring addresses, so on a GPU one warp's loads of a row of `x` (or of `A`)
# coalesce into a few wide transactions. Every element of a tile's rows of `x` and of
# the slot's rows of `A` is read once per rank group: the weights of a slot are read
# once per *tile*, not once per token.

# %% [markdown]
# ## Rung 2: a naive Numba kernel
#
# Before the real kernel, the simplest one that is correct: one block per token (in
# batch order, no segments), one thread per rank, each thread a full dot product of
# length `H`. It reads the slot from `token_lora_mapping` and leaves if it is `-1`.
# It runs on the simulator and on the GPU unchanged; bf16 arrives as `int16` bits and
# is widened by the library's `loader` (`punica_numba.kernels.dtypes`).
#
# Its cost: every token reads its adapter's whole `A` (`r * H` elements) even when
# all tokens share one adapter, and a block has only `r` threads.


# %%
def build_naive_shrink(dtype):
    load = loader(dtype)  # bf16 bits / fp16 / fp32 element -> fp32

    @cuda.jit
    def naive_shrink(x, w, out, s, token_lora_mapping, scale):
        t = cuda.blockIdx.x  # t in [0, T): one block per token
        n = cuda.threadIdx.x  # n in [0, blockDim.x): one thread per rank
        slot = token_lora_mapping[t]
        if slot == -1 or n >= w.shape[1]:
            return
        acc = float32(0.0)
        for k in range(x.shape[1]):  # k in [0, H)
            acc += load(x[t, k]) * load(w[slot, n, k])
        out[s, t, n] += scale * acc

    return naive_shrink


naive_shrink = build_naive_shrink(DTYPE)


def shrink_naive(x, A, out, meta, T, scale):
    threads = A[0].shape[1] if SIMULATOR else 32 * -(-A[0].shape[1] // 32)  # >= r
    mapping = kernel_array(meta.token_lora_mapping[:T])
    for s, A_s in enumerate(A):  # one launch per slice
        naive_shrink[T, threads, launch_stream()](
            kernel_array(x), kernel_array(A_s), kernel_array(out), s, mapping, scale
        )


out_naive = torch.zeros(TINY["S"], T, TINY["R"], device=DEVICE)
shrink_naive(x, A, out_naive, meta, T, SCALE)
check_close(out_naive, want, "rung 2: naive kernel")
check_close(out_naive.cpu(), emulated.double(), "naive vs emulation")
print("rung 2 (naive Numba kernel) agrees with the reference and with rung 1")

# %% [markdown]
# ## Rung 3: the library's `lora_shrink`
#
# `lora_shrink` checks its arguments, picks the kernel specialised for the dtypes and
# the launch configuration, and launches all slices in one go (grid `y` = slice). Its
# kernel is rung 1's algorithm (`punica_numba/kernels/shrink.py`). It takes vLLM's
# signature: the six metadata tensors come from `meta.meta_args(T)`.
#
# The buffer is accumulated into (`+=`): the caller zeroes it. On every size of this
# notebook it must agree with the reference, with the naive kernel and (at the tiny
# size) with the emulation.

# %%
for size in SIZES:
    xb, Ab, slots_b, meta_b = make_problem(**size, seed=1)
    Tb = size["T"]
    want_b = reference_shrink(xb, Ab, slots_b)
    out_lib = torch.zeros(size["S"], Tb, size["R"], device=DEVICE)  # [S, T, r] fp32
    lora_shrink(xb, Ab, out_lib, *meta_b.meta_args(Tb), SCALE)
    err = check_close(out_lib, want_b, f"lora_shrink at {size}")

    out_naive = torch.zeros_like(out_lib)
    shrink_naive(xb, Ab, out_naive, meta_b, Tb, SCALE)
    check_close(out_lib, out_naive.double(), "lora_shrink vs naive")
    no_lora = slots_b == -1
    assert not out_lib[:, no_lora].any(), "a token without adapter was written"
    print(f"{size}: lora_shrink agrees (relative error {err:.1e}), -1 rows untouched")

out_lib = torch.zeros(TINY["S"], T, TINY["R"], device=DEVICE)
with force_launch_config("shrink", CFG):  # the configuration rung 1 emulates
    lora_shrink(x, A, out_lib, *meta.meta_args(T), SCALE)
check_close(out_lib.cpu(), emulated.double(), "lora_shrink vs emulation")
print(
    "and, at the tiny size, with the emulation of rung 1;",
    "bit for bit" if torch.equal(out_lib.cpu(), emulated) else "within fp32 rounding",
)

# %% [markdown]
# And the awkward cases that break sloppy kernels: rank 1, one token, every token on a
# different slot, no token with an adapter (nothing is launched; the buffer is left as
# it was), and a buffer that already holds values (shrink adds).

# %%
awkward = {
    "rank 1": (dict(T=6, H=9, R=1, L=3, S=1), None),
    "a single token": (dict(T=1, H=11, R=3, L=2, S=3), None),
    "every token its own slot": (dict(T=4, H=8, R=2, L=4, S=1), [3, 1, 0, 2]),
    "no adapter anywhere": (dict(T=5, H=8, R=2, L=2, S=1), [-1] * 5),
}
for name, (dims, forced) in awkward.items():
    xa, Aa, slots_a, meta_a = make_problem(**dims, seed=2)
    if forced is not None:
        slots_a = torch.tensor(forced, device=DEVICE)
        meta_a.prepare_tensors(slots_a)
    start = torch.randn(dims["S"], dims["T"], dims["R"]).to(DEVICE)  # shrink adds to this
    out_a = start.clone()
    lora_shrink(xa, Aa, out_a, *meta_a.meta_args(dims["T"]), SCALE)
    want_a = reference.lora_shrink(xa, Aa, start, slots_a, SCALE)
    check_close(out_a, want_a, name)
    print(f"{name:<26} agrees with the reference")

# %% [markdown]
# ## The memory-traffic budget
#
# Shrink does `2 * T * r * H` flops per slice on `T * H + L_active * r * H` input
# elements: a handful of flops per byte, far below what any GPU needs to be
# compute-bound (the H200's tensor cores need hundreds of flops per byte of HBM
# traffic). So its speed limit is memory traffic:
#
# ```
# bytes = e * (T * H + L_active * S * r * H) + 2 * 4 * S * T * r
#         x once    each active slot's A's once    fp32 buffer read and written
# ```
#
# with `e` bytes per element (2 for bf16). First, the formula against the bytes of the
# actual tensors of the largest size above:

# %%
COPY_BANDWIDTH = 4.2e12  # bytes/s: a device-to-device copy on an H200


def shrink_bytes(T, H, r, S, active, elt=2):
    return elt * (T * H + active * S * r * H) + 2 * 4 * S * T * r


BIG = SIZES[-1]
xb, Ab, slots_b, meta_b = make_problem(**BIG, seed=1)  # the problem checked above
Tb = BIG["T"]
out_b = torch.zeros(BIG["S"], Tb, BIG["R"], device=DEVICE)
active_slots = sorted(set(slots_b.tolist()) - {-1})
read_once = [xb] + [A_s[active_slots] for A_s in Ab]  # x, and each active slot's A's
actual = sum(t.numel() * t.element_size() for t in read_once) + 2 * out_b.nbytes
budget = shrink_bytes(Tb, BIG["H"], BIG["R"], BIG["S"], len(active_slots))
assert actual == budget, (actual, budget)
print(f"{BIG}: {budget:,} bytes by the formula == {actual:,} bytes of the tensors")

# %% [markdown]
# Now a **decode** step of a 7B-class model's QKV layer: one new token per request,
# `H = 4096`, rank 16, three slices, bf16, and up to 8 adapters in use. The floor is
# the time to move those bytes at 4.2 TB/s, the copy bandwidth of an H200. Next to it,
# the same for a kernel that reads each token's weights separately (the naive kernel
# above, or gather + bmm), which pays `T` times for the weights instead of
# `L_active` times.

# %%
H7, R7, S7, L7 = 4096, 16, 3, 8
lines = [
    "| tokens T | active adapters | bytes (KB) | floor (µs) | per-token weights: floor (µs) |",
    "| ---: | ---: | ---: | ---: | ---: |",
]
floors = []
for T7 in (1, 8, 32, 64, 128, 256):
    active = min(T7, L7)
    nbytes = shrink_bytes(T7, H7, R7, S7, active)
    per_token = shrink_bytes(T7, H7, R7, S7, T7)  # every token reads its own weights
    floors.append(nbytes / COPY_BANDWIDTH * 1e6)
    lines.append(
        f"| {T7} | {active} | {nbytes / 1e3:,.0f} | {floors[-1]:.2f} "
        f"| {per_token / COPY_BANDWIDTH * 1e6:.2f} |"
    )
display(Markdown("\n".join(lines)))
assert all(a <= b for a, b in zip(floors, floors[1:])), "more tokens cannot move fewer bytes"
assert floors[3] < 5, "a 64-token decode shrink should need only microseconds of traffic"

# %% [markdown]
# A decode shrink needs **about a microsecond** of memory traffic. A Numba launch from
# Python costs tens of microseconds on the host (notebook 6 measures it), so at decode
# sizes the launch, not the kernel, is what a multi-LoRA layer pays for, unless the
# launches are captured in a CUDA graph (notebook 5).
#
# On a GPU, the two kernels of this notebook, timed after the checks above:

# %%
if not SIMULATOR:

    def time_us(fn, repeat=50):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeat * 1e6

    out_n = torch.zeros_like(out_b)
    naive_us = time_us(lambda: shrink_naive(xb, Ab, out_n, meta_b, Tb, SCALE))
    lib_us = time_us(lambda: lora_shrink(xb, Ab, out_b, *meta_b.meta_args(Tb), SCALE))
    floor = budget / COPY_BANDWIDTH
    print(
        f"{BIG}: naive {naive_us:.0f} µs, lora_shrink {lib_us:.0f} µs per call "
        f"(launch included); traffic floor {floor * 1e6:.1f} µs"
    )
    assert naive_us > 0 and lib_us > 0
else:
    print("On the simulator every CUDA thread is a Python thread: kernel times mean nothing.")
