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
# # 4. The expand kernel
#
# Expand takes the fp32 buffer that shrink filled and widens it back to the layer's
# output, slice by slice: for every token `t` whose slot is `l != -1`,
#
# ```
# out[t, c_s + n] = (out[t, c_s + n] if add_inputs else 0) + buffer[s, t] @ B_s[l][n]
#     buffer: [S, T, r] fp32    B_s: [L, N_s, r]    out: [T, >= offset_start + sum N_s]
#     c_s = offset_start + N_0 + ... + N_{s-1}
# ```
#
# The ladder is the same as for shrink: dense torch, every thread emulated in Python,
# a naive Numba kernel, the library's `lora_expand`, each checked against
# `punica_numba.reference`.
#
# **You will learn**
#
# - how the expand kernel splits the work: a tile of one slot's tokens, one slice and
#   one group of output columns per block, one output column per thread;
# - who writes what: every output element written by exactly one thread, once, and
#   nothing outside the slices or in rows without an adapter (a picture);
# - slices of unequal width (GQA's q, k, v), `offset_start` and `add_inputs`;
# - why an fp32 input with bf16 / fp16 weights is rounded **once**, at the store.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display
from matplotlib.colors import ListedColormap
from numba import float32

import punica_numba
from punica_numba import LoRAKernelMeta, lora_expand, reference
from punica_numba._cuda import cuda, kernel_array, launch_stream
from punica_numba.kernels.dtypes import loader, storer
from punica_numba.kernels.expand_lanes import lanes_per_row
from punica_numba.kernels.segments import tile_grid_bound, tile_table
from punica_numba.launch import force_launch_config, launch_configs

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
W_DTYPE = torch.bfloat16  # weights and layer output; the input is the fp32 buffer

# Tiny for the Python emulation on both machines; a GQA QKV layer of a 7B-class model
# on a GPU. Awkward on purpose: q is not a multiple of the block's columns, r = 5.
TINY = dict(T=11, R=5, L=4, widths=(24, 8, 8))
SIZES = [TINY] if SIMULATOR else [TINY, dict(T=253, R=16, L=8, widths=(4096, 1024, 1024))]
OFFSET, EXTRA = 3, 2  # columns before and after the slices
print(f"{'simulator' if SIMULATOR else 'GPU'}; sizes: {SIZES}")


def make_problem(T, R, L, widths, seed=0, x_dtype=torch.float32, w_dtype=W_DTYPE):
    """buffer [S, T, r], stacked B's [L, N_s, r], an output with margins, slots, metadata."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(widths), T, R, generator=gen).to(x_dtype).to(DEVICE)
    B = [(torch.randn(L, n, R, generator=gen) / R**0.5).to(w_dtype).to(DEVICE) for n in widths]
    out = torch.randn(T, OFFSET + sum(widths) + EXTRA, generator=gen).to(w_dtype).to(DEVICE)
    slots = torch.randint(-1, L, (T,), generator=gen)
    slots[0], slots[1::4] = L - 1, -1  # the last slot in use, and tokens without adapter
    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    return x, B, out, slots.to(DEVICE), meta


def check_close(got, want, what, rtol=1e-2):
    """max |got - want| <= rtol * max |want| (bf16 output: 2**-8 relative rounding)."""
    err = (got.double() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    assert err <= rtol * scale, f"{what}: error {err:.3g} > {rtol} * {scale:.3g}"
    return err / scale


def check_untouched(got, before, slots, widths, offset=OFFSET):
    """Rows without adapter, and columns outside the slices, bit for bit unchanged."""
    last = offset + sum(widths)
    assert torch.equal(got[slots == -1], before[slots == -1]), "a row without adapter changed"
    assert torch.equal(got[:, :offset], before[:, :offset]), "a column before the slices changed"
    assert torch.equal(got[:, last:], before[:, last:]), "a column after the slices changed"


def same_bits(got, other, what):
    """Bit for bit on the simulator. On a GPU the compiler may fuse a multiply and an add
    into one FMA (one rounding fewer), so there the two must only agree closely."""
    got, other = got.cpu(), other.cpu()
    identical = torch.equal(got, other)
    if SIMULATOR:
        assert identical, f"{what}: not bit for bit"
    else:
        check_close(got, other.double(), what)
    return "bit for bit" if identical else "within one rounding"


x, B, out0, slots, meta = make_problem(**TINY)
T, R, WIDTHS = TINY["T"], TINY["R"], TINY["widths"]
want = reference.lora_expand(x, B, out0, slots, OFFSET, add_inputs=True)  # float64
display(meta)
assert want.shape == out0.shape and meta.num_tokens == T

# %% [markdown]
# ## Rung 0: dense torch, segment by segment
#
# For every segment and slice: gather the segment's rows of the buffer, multiply by
# the slot's `B_s`, add into the slice's columns. The slices sit side by side, each
# starting where the previous one ended.


# %%
def expand_torch(x, B, out, meta, T, offset, add_inputs):
    out = out.clone()
    _, order, counts, starts, ids, no_lora = meta.meta_args(T)
    if bool(no_lora):
        return out
    for slot, count, start in zip(ids.tolist(), counts.tolist(), starts.tolist()):
        if slot == -1 or count == 0:
            continue
        tokens = order[start : start + count].long()  # [count]
        column = offset
        for s, B_s in enumerate(B):
            width = B_s.shape[1]
            old = out[tokens, column : column + width].float() if add_inputs else 0.0
            new = old + x[s, tokens].float() @ B_s[slot].float().T  # [count, N_s] fp32
            out[tokens, column : column + width] = new.to(out.dtype)  # one rounding
            column += width
    return out


got = expand_torch(x, B, out0, meta, T, OFFSET, True)
check_close(got, want, "rung 0: torch")
check_untouched(got, out0, slots, WIDTHS)
print("rung 0 (torch, per segment) agrees with the reference; other rows/columns untouched")

# %% [markdown]
# ## Rung 1: every thread, emulated in Python
#
# One block = one tile of up to `TILE_M` tokens of one segment (`blockIdx.x`, found
# exactly as in shrink), one slice (`blockIdx.y`) and one group of `THREADS` output
# columns (`blockIdx.z`; on the simulator a single group that loops). Thread `tid`
# owns column `n`: it reads row `n` of `B_s[slot]` (`r` elements) once, and the tile's
# rows of the buffer (the same for all threads of the block, a broadcast), keeps
# `TILE_M` sums in registers, and writes `TILE_M` outputs. There is no reduction
# across threads, so no shared memory and no barrier: `r` is small, one thread does a
# whole dot product.
#
# A narrower slice (k and v under GQA) just has fewer busy threads in its blocks.
# The emulation records, for every output element, which block wrote it.

# %%
# this rung's kernel: one column per thread (vec > 1 comes at the end of the notebook)
ROWS = [c for c in launch_configs("expand") if c.kernel == "rows" and c.vec == 1]
CFG = max(ROWS, key=lambda c: c.tile_m)  # the largest token tile, forced on the library below
THREADS, TILE_M = CFG.threads, CFG.tile_m
print(f"launch config: {THREADS} threads/block, TILE_M={TILE_M} tokens, spread={CFG.spread}")


def expand_emulated(x, B, out, meta, T, offset, add_inputs, writer):
    """The kernel's arithmetic in float32, one Python loop per CUDA index."""
    xs = x.float().cpu().numpy()
    ws = [b.float().cpu().numpy() for b in B]
    o = out.float().cpu().numpy().copy()
    order = meta.token_indices_sorted_by_lora_ids.cpu().numpy()
    _, _, counts, starts, ids, _ = meta.meta_args(T)
    columns = [offset + sum(w.shape[1] for w in ws[:s]) for s in range(len(ws))]  # c_s
    widest = max(w.shape[1] for w in ws)
    groups = -(-widest // THREADS) if CFG.spread else 1  # gridDim.z
    blocks = tile_grid_bound(T, len(ids), TILE_M)
    table = tile_table(ids, counts, starts, meta.token_indices_sorted_by_lora_ids, TILE_M, blocks)
    for block_x in range(blocks):  # blockIdx.x
        # the block's lookup in the tile table: slot, sorted position, rows, first token
        slot, position, rows, first_token = table[block_x].tolist()
        if slot == -1:
            continue
        tokens = [first_token] + [order[position + min(j, rows - 1)] for j in range(1, TILE_M)]
        for block_y, w in enumerate(ws):  # blockIdx.y: the slice
            for block_z in range(groups):  # blockIdx.z: a group of columns
                for tid in range(THREADS):  # threadIdx.x
                    n_first = block_z * THREADS + tid
                    for n in range(n_first, w.shape[1], groups * THREADS):  # n in [0, N_s)
                        acc = np.zeros(TILE_M, np.float32)
                        for k in range(w.shape[2]):  # k in [0, r)
                            acc += xs[block_y, tokens, k] * w[slot, n, k]
                        for j in range(rows):
                            t, c = tokens[j], columns[block_y] + n
                            o[t, c] = acc[j] + (o[t, c] if add_inputs else np.float32(0))
                            writer[t, c].append((block_x, block_y, block_z, tid))
    return torch.from_numpy(o).to(out.dtype)  # the store rounds once, to nearest even


writer = np.empty(out0.shape, dtype=object)
for index in np.ndindex(writer.shape):
    writer[index] = []
emulated = expand_emulated(x, B, out0, meta, T, OFFSET, True, writer)
check_close(emulated, want.cpu(), "rung 1: emulation")
check_untouched(emulated, out0.cpu(), slots.cpu(), WIDTHS)

times_written = np.vectorize(len)(writer)  # [T, W]
has_lora = (slots != -1).cpu().numpy()
in_slices = np.zeros(out0.shape[1], bool)
in_slices[OFFSET : OFFSET + sum(WIDTHS)] = True
assert (times_written == np.outer(has_lora, in_slices)).all(), "written twice, or not at all"
print("rung 1 (emulation) agrees; every element in a LoRA row and a slice written exactly once")

# %% [markdown]
# Who wrote what. Top: each cell of `out` coloured by the tile (`blockIdx.x`) that
# wrote it. Bottom: by the thread (`threadIdx.x`) within the block: neighbouring
# threads write neighbouring columns (coalesced stores), and a slice wider than the
# block is covered by the same threads again, `THREADS` columns further on. White
# cells were not written: the rows of tokens without an adapter, the `offset_start`
# columns on the left and the extra columns on the right. Dashed lines: the slice
# boundaries `c_s`.

# %%
tile_of = np.full(out0.shape, -1)
thread_of = np.full(out0.shape, -1)
for index in np.ndindex(writer.shape):
    if writer[index]:
        block_x, _, _, tid = writer[index][0]
        tile_of[index], thread_of[index] = block_x, tid
fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
for ax, owner, what in ((axes[0], tile_of, "tile"), (axes[1], thread_of, "thread")):
    colours = ["#ffffff"] + [plt.cm.tab20(i % 20) for i in range(owner.max() + 1)]
    ax.imshow(owner + 1, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1)
    for c in np.cumsum((OFFSET,) + WIDTHS):
        ax.axvline(c - 0.5, color="black", ls="--", lw=1)
    ax.set_yticks(range(T), [f"{t} (slot {s})" for t, s in enumerate(slots.tolist())])
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"out[t, c] coloured by the {what} that wrote it")
axes[1].set_xlabel("output column: offset | q | k | v | extra")
plt.tight_layout()
plt.show()
assert (tile_of >= 0).sum() == has_lora.sum() * sum(WIDTHS)
for c_s, width in zip(np.cumsum((OFFSET,) + WIDTHS), WIDTHS):  # thread = n mod THREADS
    assert (thread_of[has_lora, c_s : c_s + width] == np.arange(width) % THREADS).all()

# %% [markdown]
# ## Rung 2: a naive Numba kernel
#
# The simplest correct kernel: one block per token (batch order, no segments) and
# group of columns, one thread per output column of one slice, one launch per slice.
# Loads and stores go through the library's `loader` / `storer`, which handle bf16 as
# `int16` bits on both machines. Every token reads its adapter's whole `B_s`, even when
# all tokens share one adapter.


# %%
def build_naive_expand(x_dtype, w_dtype, out_dtype):
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    load_out, store_out = loader(out_dtype), storer(out_dtype)

    @cuda.jit
    def naive_expand(x, w, out, s, column0, token_lora_mapping, add_inputs):
        t = cuda.blockIdx.x  # t in [0, T)
        n = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # n in [0, N_s)
        slot = token_lora_mapping[t]
        if slot == -1 or n >= w.shape[1]:
            return
        acc = float32(0.0)
        for k in range(w.shape[2]):  # k in [0, r)
            acc += load_x(x[s, t, k]) * load_w(w[slot, n, k])
        if add_inputs:
            acc += load_out(out[t, column0 + n])
        out[t, column0 + n] = store_out(acc)

    return naive_expand


def expand_naive(x, B, out, meta, T, offset, add_inputs):
    kernel = build_naive_expand(x.dtype, B[0].dtype, out.dtype)
    threads = 16 if SIMULATOR else 128
    mapping = kernel_array(meta.token_lora_mapping[:T])
    column = offset
    for s, B_s in enumerate(B):  # one launch per slice
        grid = (T, -(-B_s.shape[1] // threads))
        kernel[grid, threads, launch_stream()](
            kernel_array(x), kernel_array(B_s), kernel_array(out), s, column, mapping, add_inputs
        )
        column += B_s.shape[1]


got = out0.clone()
expand_naive(x, B, got, meta, T, OFFSET, True)
check_close(got, want, "rung 2: naive kernel")
check_untouched(got, out0, slots, WIDTHS)
agreement = same_bits(got, emulated, "naive kernel vs emulation")
print(f"rung 2 (naive Numba kernel) agrees with the reference, and {agreement} with rung 1")

# %% [markdown]
# ## Rung 3: the library's `lora_expand`
#
# One launch for all slices (grid `y`), with vLLM's signature. Slice widths come from
# the weights' shapes; `offset_start` shifts them all. Checked against the reference,
# the naive kernel and the emulation, on every size of this notebook.

# %%
for dims in SIZES:
    xb, Bb, outb, slots_b, meta_b = make_problem(**dims, seed=1)
    Tb = dims["T"]
    want_b = reference.lora_expand(xb, Bb, outb, slots_b, OFFSET, add_inputs=True)
    got = outb.clone()
    lora_expand(xb, Bb, got, *meta_b.meta_args(Tb), offset_start=OFFSET, add_inputs=True)
    err = check_close(got, want_b, f"lora_expand at {dims}")
    check_untouched(got, outb, slots_b, dims["widths"])
    naive = outb.clone()
    expand_naive(xb, Bb, naive, meta_b, Tb, OFFSET, True)
    agreement = same_bits(got, naive, "lora_expand vs naive")
    print(f"{dims}: lora_expand agrees (relative error {err:.1e}), {agreement} with naive")

got = out0.clone()
with force_launch_config("expand", CFG):
    lora_expand(x, B, got, *meta.meta_args(T), offset_start=OFFSET, add_inputs=True)
agreement = same_bits(got, emulated, "lora_expand vs emulation")
print(f"and, at the tiny size, {agreement} with the emulation of rung 1")

# %% [markdown]
# Why bit for bit: each output element is one fp32 sum of `r` products taken in the
# order `k = 0 .. r-1`, plus the old value, rounded once. Every rung above does exactly
# that, so on the simulator they agree to the last bit. On a GPU the compiler may fuse
# a multiply and its add into one FMA, which rounds once instead of twice; the Python
# emulation does not, so there the checks allow one rounding and say which it was.
#
# The library's row kernel also comes with `vec` columns per thread (`vec=4` on the
# GPU from 16 tokens on): thread `tid` of a warp then owns columns `tid`, `tid + 32`,
# `tid + 64` and `tid + 96` of its group, so one load of the buffer feeds four products,
# and a warp still reads neighbouring rows of `B` and writes neighbouring columns. On
# the H200 the one-column kernel is bound by issuing instructions, one load of the
# buffer per product; four columns per thread took T=4096 on one LoRA from 102 to 78 µs.
# For short rows of `B` (at most 4 eight-byte words: r <= 16 in bf16) the library also
# compiles the rank in, so the loop over it has a known length and the compiler unrolls
# it, sending a row's loads out together (T=1: 3.0 to 2.8 µs).
#
# With many tokens per slot and a large rank the library switches to a second kernel,
# `punica_numba.kernels.expand_tiled`: a block stages a chunk of the buffer's rows and
# of `B` in shared memory, and each thread computes a small register tile of outputs
# from there, so each loaded element is used many times. Every one of these FFMA
# configurations adds the same products in the same order, so each gives the same bits
# as the kernel of this notebook, and the heuristic may move between them from one step
# to the next.
#
# A third kernel, `punica_numba.kernels.expand_mma`, hands the products to the tensor
# cores (`mma.sync`, 16 tokens x 8 columns x 16 ranks per instruction) where the call
# allows it: bf16 weights and output, an even rank, slices that start and end on whole
# 8-byte words of 4 columns. Its sums run in an order of their own (its arithmetic key
# differs), so it is left out below; this problem, with its offset of 3 columns, is not
# one it takes anyway.
#
# A fourth, `punica_numba.kernels.expand_lanes`, shares each row of `B` among several
# lanes (rung 4 below); its sums are grouped differently, so it too has an arithmetic
# key of its own and is left out here.

# %%
others = [
    c
    for c in launch_configs("expand")
    if c != CFG and c.arithmetic("expand") == CFG.arithmetic("expand")
]
for config in others:
    got_other = out0.clone()
    with force_launch_config("expand", config):
        lora_expand(x, B, got_other, *meta.meta_args(T), offset_start=OFFSET, add_inputs=True)
    assert torch.equal(got_other, got), config
kinds = [f"{c.kernel}{f' vec={c.vec}' if c.vec > 1 else ''}" for c in others]
print(f"{len(others)} other configuration(s) ({', '.join(kinds)}): the same bits")

# %% [markdown]
# ## Rung 4: a row of `B` shared by lanes
#
# At r=16 a row of `B` is 32 bytes, and the thread that owns a column reads it in four
# 8-byte words. At r=64 it is 128 bytes: the thread's products wait on 16 words in turn,
# and each load instruction of a warp asks for one word of each of 32 rows. The
# library's lane-split expand (`punica_numba.kernels.expand_lanes`) turns the layout
# around: `LANES` neighbouring lanes share a row, each reading two neighbouring words
# (one 16-byte load) and multiplying its stretch of the rank, so one load instruction
# of a warp brings `32 / LANES` whole rows, 512 neighbouring bytes.
#
# The lanes' partial sums are then added by a *butterfly*: at each step every lane adds
# the value of the lane `offset` away (`cuda.shfl_xor_sync` on the GPU), for offsets
# `LANES / 2, ..., 1`. After the last step every lane of the group holds the same total
# (lane `i` computes `a + b` where lane `i ^ offset` computes `b + a`: the same number),
# and the group's first lane adds the old output and stores. The simulator has no warp
# shuffles, so there the parts go through shared memory and the first lane adds them in
# the butterfly's order.
#
# The emulation below does that arithmetic for r=32 (bf16: 8 words a row, 4 lanes of
# 2 words each), and the library's kernel, forced, must agree with it bit for bit on
# the simulator. The order is not the row kernel's (`k = 0 .. r-1` in one accumulator),
# hence the kernel's own arithmetic key. On the H200 it took one token per slot at r=64
# from 28 to 16 µs (T=64) and from 83 to 53 µs (T=256).

# %%
LANE_CFG = next(c for c in launch_configs("expand") if c.kernel == "lanes")
LANE_DIMS = dict(T=5, R=32, L=3, widths=(24, 8, 8))
xl, Bl, outl, slots_l, meta_l = make_problem(**LANE_DIMS, seed=2)
LANES = lanes_per_row(LANE_DIMS["R"] * Bl[0].element_size() // 8)  # words of a row of B
STRETCH = LANE_DIMS["R"] // LANES  # elements of a row each lane multiplies


def expand_lanes_emulated(x, B, out, slots, offset):
    """Each output: every lane's stretch of k in order, the butterfly, then the old value."""
    xs = x.float().cpu().numpy()
    o = out.float().cpu().numpy().copy()
    column = offset
    for s, B_s in enumerate(B):
        w = B_s.float().cpu().numpy()
        for t, slot in enumerate(slots.tolist()):
            if slot == -1:
                continue
            for n in range(w.shape[1]):
                parts = np.zeros(LANES, np.float32)  # one per lane
                for lane in range(LANES):
                    for k in range(lane * STRETCH, (lane + 1) * STRETCH):
                        parts[lane] += xs[s, t, k] * w[slot, n, k]
                step = LANES // 2
                while step:  # lane i adds lane i + step (lane 0's view of the butterfly)
                    parts[:step] = parts[:step] + parts[step : 2 * step]
                    step //= 2
                o[t, column + n] += parts[0]  # the old output, plus the sum
        column += w.shape[1]
    return torch.from_numpy(o).to(out.dtype)  # one rounding


want_l = reference.lora_expand(xl, Bl, outl, slots_l, OFFSET, add_inputs=True)
emulated_l = expand_lanes_emulated(xl, Bl, outl, slots_l, OFFSET)
check_close(emulated_l, want_l.cpu(), "rung 4: emulation")
got_l = outl.clone()
with force_launch_config("expand", LANE_CFG):
    lora_expand(
        xl, Bl, got_l, *meta_l.meta_args(LANE_DIMS["T"]), offset_start=OFFSET, add_inputs=True
    )
check_close(got_l, want_l, "rung 4: the library's lane-split expand")
check_untouched(got_l, outl, slots_l, LANE_DIMS["widths"])
agreement = same_bits(got_l, emulated_l, "lane-split kernel vs its emulation")
print(f"r={LANE_DIMS['R']}: {LANES} lanes a row, {STRETCH} elements each; the library's")
print(f"lane-split expand agrees with the reference, and {agreement} with the emulation")

# %% [markdown]
# ## `offset_start` and `add_inputs`
#
# - `offset_start` moves every slice right by that many columns. A tensor-parallel
#   layer that owns only a shard of the output uses it to write into its part.
# - `add_inputs=True` adds into what is there (the base layer's output);
#   `add_inputs=False` overwrites the slice columns of the rows with an adapter.
#   (vLLM v0.8–0.9's wrapper ignored this flag and always added; ours honours it.)
#
# All four combinations, against the reference, with everything outside untouched:

# %%
for offset in (0, OFFSET):
    for add_inputs in (True, False):
        got = out0.clone()
        lora_expand(x, B, got, *meta.meta_args(T), offset_start=offset, add_inputs=add_inputs)
        want_c = reference.lora_expand(x, B, out0, slots, offset, add_inputs)
        check_close(got, want_c, f"offset {offset}, add_inputs {add_inputs}")
        check_untouched(got, out0, slots, WIDTHS, offset)
        print(f"offset_start={offset}, add_inputs={add_inputs!s:<5}: agrees")

# %% [markdown]
# ## An fp32 input with 16-bit weights: one rounding
#
# In a real layer the input is shrink's **fp32** buffer, while the weights and the
# output are bf16 (or fp16). vLLM's Triton kernel rounds the fp32 input to the weight
# dtype before the dot product, rounds the fp32 sum to the weight dtype, and adds it to
# the output in 16 bits: up to three roundings. Ours widens everything to fp32, sums,
# adds the old output, and rounds **once**, at the store.
#
# Below, both are compared with the float64 reference. "vLLM-style" is emulated in
# torch; the bound asserted for `lora_expand` is one rounding of the exact result
# (`2**-8` relative for bf16, `2**-11` for fp16) plus fp32's share.

# %%
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
dims = SIZES[-1]
for w_dtype in (torch.bfloat16, torch.float16):
    xf, Bf, outf, slots_f, meta_f = make_problem(**dims, seed=3, w_dtype=w_dtype)
    Tf = dims["T"]
    exact = reference.lora_expand(xf, Bf, outf, slots_f, OFFSET, add_inputs=True)
    ours = outf.clone()
    lora_expand(xf, Bf, ours, *meta_f.meta_args(Tf), offset_start=OFFSET, add_inputs=True)

    vllm_style = outf.clone()
    column = OFFSET
    for s, B_s in enumerate(Bf):
        width = B_s.shape[1]
        x16 = xf[s].to(w_dtype).float()  # rounding 1: the input
        for l in sorted(set(slots_f.tolist()) - {-1}):
            rows = slots_f == l
            delta = (x16[rows] @ B_s[l].float().T).to(w_dtype)  # rounding 2: the sum
            window = vllm_style[rows, column : column + width]
            vllm_style[rows, column : column + width] = window + delta  # rounding 3: the add
        column += width

    rows = slots_f != -1
    err_ours = (ours.double() - exact).abs()[rows]
    err_vllm = (vllm_style.double() - exact).abs()[rows]
    bound = UNIT[w_dtype] * exact.abs()[rows] + 1e-5 * exact.abs().max()
    assert bool((err_ours <= bound).all()), "lora_expand rounds more than once"
    print(
        f"{str(w_dtype):<15} largest error vs float64: ours {err_ours.max():.2e}, "
        f"vLLM-style {err_vllm.max():.2e}; mean: {err_ours.mean():.2e} vs {err_vllm.mean():.2e}"
    )
