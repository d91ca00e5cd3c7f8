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
# # 7. Tensor-parallel LoRA: past one GPU
#
# A model too large for one GPU is split over several: with *tensor parallelism*
# (TP) every linear layer is cut into `tp` pieces, one per GPU ("rank"), and the
# ranks exchange partial results with collectives (all-gather, all-reduce). A LoRA
# adapter on such a layer must be cut the same way, or its output would not fit
# the base layer's piece. This notebook shows how vLLM cuts `A` and `B` for each
# kind of layer, checks every scheme against the unsharded layer, and then runs
# them for real on two processes joined by `torch.distributed`.
#
# **You will learn**
#
# - why a column-parallel layer shards `B` by output rows and keeps `A` whole, and a
#   row-parallel layer shards `A` by input columns and keeps `B` whole;
# - how the *fully sharded* variants also cut the other factor, at the price of one
#   small collective on the fp32 shrink buffer (all-gather for column layers,
#   all-reduce for row layers, with `offset_start = rank × shard`);
# - why the LoRA output of a row-parallel layer needs no collective of its own: it
#   rides along in the base layer's all-reduce;
# - how packed layers (gate_up, q/k/v with GQA widths) give each rank its shard of
#   *every* slice, and what happens with fewer k/v heads than ranks;
# - how to run it all on two ranks: gloo on CPUs, NCCL on GPUs
#   (`punica_numba.parallel.run_layer_cases`).

# %%
import time

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display
from matplotlib.patches import Rectangle

import punica_numba
from punica_numba.parallel import (
    LayerCase,
    LoRALinear,
    default_backend,
    qkv_output_slices,
    run_layer_cases,
    shard,
    wrapper_for_slots,
)

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
WORLD = 2  # ranks

# On the simulator every CUDA thread is a Python thread: tiny layers there.
if SIMULATOR:
    T, H, N, R, L = 7, 6, 8, 4, 3  # tokens, hidden in, hidden out, rank, slots
    HEADS, KV_HEADS, HEAD = 4, 1, 2  # q/k/v: 4 query heads, 1 k/v head of size 2
else:
    T, H, N, R, L = 256, 4096, 4096, 16, 8
    HEADS, KV_HEADS, HEAD = 32, 8, 128
DTYPE = torch.float32  # the checks below are tight in fp32; the tests also run 16-bit
SLOTS = (0, 2, -1, 1, 0, -1, 2) * (T // 7) + (1,) * (T % 7)  # every slot, and -1

print(f"{'simulator' if SIMULATOR else 'GPU'}: T={T}, H={H}, N={N}, r={R}, L={L}, tp={WORLD}")
assert len(SLOTS) == T and H % WORLD == 0 and N % WORLD == 0 and R % WORLD == 0

# %% [markdown]
# ## What each rank holds
#
# A LoRA linear layer computes `y = x Wᵀ + scale · (x Aᵀ) Bᵀ`, with `x: [T, H]`,
# `A: [r, H]`, `B: [N, r]` per adapter slot. Tensor parallelism cuts `W` in one of
# two ways, and the LoRA factors follow:
#
# | layer | W on rank k | A on rank k | B on rank k | collective |
# |---|---|---|---|---|
# | column-parallel | rows (outputs) | whole | rows (outputs) | none: `y` stays sharded |
# | column, fully sharded | rows | `r/tp` rows | rows | all-gather the `[S, T, r/tp]` fp32 buffer |
# | row-parallel | columns (inputs) | columns | whole | all-reduce `y` (the base layer's own) |
# | row, fully sharded | columns | columns | rows | all-reduce the `[1, T, r]` buffer, then `y` |
#
# The pictures: each panel reads left to right as `x · Aᵀ → buffer · Bᵀ → y`; blue
# is what rank 0 holds, orange rank 1, grey what every rank holds whole, and
# hatched a *partial sum*: every rank holds a tensor of that shape, and the sum over
# ranks is the true value. Red marks a collective. In the last panel the colours of
# the hatched `y` show which columns each rank's LoRA output is added to.

# %%
RANK_COLOURS = ("#4c72b0", "#dd8452")  # rank 0, rank 1
WHOLE = "#c8c8c8"


def block(ax, x0, w, h, label, how, split=None):
    """A matrix as a rectangle; returns its right edge.

    how: 'whole' (grey), 'partial' (hatched grey), 'split' (by rank along ``split``:
    'cols' or 'rows'), or 'partial-split' (a partial sum whose column halves hold the
    LoRA output of rank 0 and rank 1).
    """
    y0 = -h / 2
    if how in ("split", "partial-split"):
        hatch = "///" if how == "partial-split" else None
        for k in range(WORLD):
            if split == "cols":
                part = Rectangle((x0 + k * w / WORLD, y0), w / WORLD, h)
            else:  # rows: rank 0 on top
                part = Rectangle((x0, y0 + (WORLD - 1 - k) * h / WORLD), w, h / WORLD)
            part.set(facecolor=RANK_COLOURS[k], edgecolor="black", linewidth=0.8, hatch=hatch)
            ax.add_patch(part)
    else:
        hatch = "///" if how == "partial" else None
        ax.add_patch(
            Rectangle((x0, y0), w, h, facecolor=WHOLE, edgecolor="black", hatch=hatch, lw=0.8)
        )
    ax.text(x0 + w / 2, -h / 2 - 0.2, label, ha="center", va="top", fontsize=9)
    return x0 + w


def arrow(ax, x0, collective=None, length=0.8):
    """An arrow from x0 to the right, with the collective (if any) above it."""
    ax.annotate("", xy=(x0 + length, 0), xytext=(x0, 0), arrowprops=dict(arrowstyle="->"))
    if collective:
        ax.text(
            x0 + length / 2,
            0.2,
            collective,
            ha="center",
            va="bottom",
            color="crimson",
            fontsize=8,
            fontweight="bold",
        )
    return x0 + length + 0.1


def dot(ax, x0):
    ax.text(x0 + 0.15, 0, "·", ha="center", va="center", fontsize=16)
    return x0 + 0.3


# Per layer: how x, Aᵀ, the buffer, Bᵀ and y are held, and the collectives on the buffer
# and on y. Sizes in the picture: T = 1.2 tall, H = 1.6 wide, r = 0.5, N = 2.0.
SPLIT_COLS, SPLIT_ROWS = ("split", "cols"), ("split", "rows")
LAYOUTS = {
    "column-parallel": dict(x=("whole",), a=("whole",), buf=("whole",), b=SPLIT_COLS, y=SPLIT_COLS),
    "column, fully sharded": dict(
        x=("whole",),
        a=SPLIT_COLS,
        buf=SPLIT_COLS,
        b=SPLIT_COLS,
        y=SPLIT_COLS,
        buf_collective="all-gather\n(fp32)",
    ),
    "row-parallel": dict(
        x=SPLIT_COLS,
        a=SPLIT_ROWS,
        buf=("partial",),
        b=("whole",),
        y=("partial",),
        y_collective="all-reduce",
    ),
    "row, fully sharded": dict(
        x=SPLIT_COLS,
        a=SPLIT_ROWS,
        buf=("partial",),
        b=SPLIT_COLS,
        y=("partial-split", "cols"),
        buf_collective="all-reduce\n(fp32)",
        y_collective="all-reduce",
    ),
}


def draw_layer(ax, title, layout):
    pos = block(ax, 0.0, 1.6, 1.2, "x [T, H]", *layout["x"])
    pos = block(ax, dot(ax, pos), 0.5, 1.6, "Aᵀ [H, r]", *layout["a"])
    pos = block(ax, arrow(ax, pos + 0.1), 0.5, 1.2, "buffer\n[T, r]", *layout["buf"])
    if "buf_collective" in layout:  # after it, every rank holds the whole buffer
        pos = arrow(ax, pos + 0.1, layout["buf_collective"], length=1.0)
        pos = block(ax, pos, 0.5, 1.2, "buffer\n[T, r]", "whole")
    pos = block(ax, dot(ax, pos), 2.0, 0.5, "Bᵀ [r, N]", *layout["b"])
    pos = block(ax, arrow(ax, pos + 0.1), 2.0, 1.2, "y [T, N]", *layout["y"])
    if "y_collective" in layout:  # after it, every rank holds the whole y
        pos = arrow(ax, pos + 0.1, layout["y_collective"], length=1.0)
        ax.text(pos, 0, "y on\nevery rank", ha="left", va="center", fontsize=9)
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlim(-0.2, 12.4)
    ax.set_ylim(-1.5, 1.2)
    ax.axis("off")


fig, axes = plt.subplots(4, 1, figsize=(11, 9))
for ax, (title, layout) in zip(axes, LAYOUTS.items()):
    draw_layer(ax, title, layout)
legend = {
    "rank 0": dict(facecolor=RANK_COLOURS[0]),
    "rank 1": dict(facecolor=RANK_COLOURS[1]),
    "whole on every rank": dict(facecolor=WHOLE),
    "partial sum on every rank": dict(facecolor=WHOLE, hatch="///"),
}
handles = [Rectangle((0, 0), 1, 1, edgecolor="black", lw=0.8, **kw) for kw in legend.values()]
fig.legend(handles, list(legend), loc="lower center", ncol=4, frameon=False)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()
assert len(fig.axes) == 4 and all(len(ax.patches) >= 5 for ax in fig.axes)

# %% [markdown]
# Read the panels against the algebra:
#
# - **Column-parallel.** Rank k owns output features `N_k`. Its LoRA part for them
#   is `(x Aᵀ) B_kᵀ`: it needs the whole shrink (so all of `A`) but only its rows of
#   `B`. No communication: the next layer is row-parallel and wants `y` sharded.
# - **Column, fully sharded.** `x Aᵀ` is cut by its `r` columns: rank k computes
#   `x A_kᵀ` (`r/tp` of them), and an all-gather of that thin fp32 buffer rebuilds
#   the whole `[T, r]` on every rank. It costs `S·T·r` fp32 values per step, and
#   saves `(tp-1)/tp` of the memory of `A`.
# - **Row-parallel.** Rank k owns input features `H_k`, so `x Aᵀ = Σ_k x_k A_kᵀ`:
#   every rank shrinks its columns, expands with the whole `B`, and adds the
#   result to its partial base output. The base layer all-reduces `y` anyway, and
#   since `B` is linear that one all-reduce sums the LoRA parts too.
# - **Row, fully sharded.** As row-parallel, but `B` is cut by output rows; the
#   shrink buffer is all-reduced first (it is small), and each rank expands only
#   into *its* output columns of the partial `y`, at `offset_start = k · N/tp`. The
#   all-reduce of `y` then assembles the columns.
#
# ## Cutting one full layer for each rank
#
# Every rank must hold pieces of *the same* adapter, so the tests and this notebook
# build one full, unsharded layer (`LoRALinear`) and cut it with `shard(t, dim,
# index, shards)`. A packed q/k/v layer is cut slice by slice: each rank gets its
# heads of q, of k and of v. With fewer k/v heads than ranks (GQA with one k/v
# head here), a k/v head cannot be split, so it is *replicated*: both ranks hold
# all of k and v (vLLM's `num_kv_head_replicas`).

# %%
QKV, QKV_SHARDS = qkv_output_slices(HEADS, KV_HEADS, HEAD, WORLD)
full = LoRALinear.random(QKV, H, R, L, dtype=DTYPE, seed=7, scale=0.5)  # the unsharded layer

rows = [
    "| rank | slice | shards | W rows | B_s (column) | A_s (column, fully sharded) |",
    "|---|---|---|---|---|---|",
]
for k in range(WORLD):
    for s, (name, width, n) in enumerate(zip("qkv", QKV, QKV_SHARDS)):
        j = k // (WORLD // n)  # which shard of slice s rank k holds
        b_k = shard(full.lora_b[s], -2, j, n)  # [L, 1, N_s/n, r]
        a_k = shard(full.lora_a[s], -2, k, WORLD)  # [L, 1, r/tp, H]
        first = sum(QKV[:s]) + j * width // n
        rows.append(
            f"| {k} | {name} | {n} | {first}..{first + width // n - 1} "
            f"| {tuple(b_k.shape)} | {tuple(a_k.shape)} |"
        )
display(Markdown("\n".join(rows)))

# Cutting loses nothing: the shards of every slice put back together give the full weights.
for s, n in enumerate(QKV_SHARDS):
    pieces = [shard(full.lora_b[s], -2, j, n) for j in range(n)]
    assert torch.equal(torch.cat(pieces, dim=-2), full.lora_b[s])
    assert torch.equal(
        torch.cat([shard(full.lora_a[s], -2, k, WORLD) for k in range(WORLD)], -2), full.lora_a[s]
    )

# %% [markdown]
# ## Two ranks in one process: collectives are a sum and a concatenation
#
# Before any process or network, the four schemes written out by hand for both
# ranks, in a loop: an all-gather is a `torch.cat` of the ranks' tensors, an
# all-reduce their sum. Every rank has the whole batch mapping, so one
# `PunicaWrapperNumba` (with the slots above) serves both "ranks" here. Each result
# is checked against the float64 reference of the unsharded layer.

# %%
wrapper = wrapper_for_slots(SLOTS, L, DEVICE)
dev = full.to(DEVICE)
x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DTYPE)  # [T, H]
xd = x.to(DEVICE)
want = full.reference(x, SLOTS)  # [T, ΣN] float64: the unsharded layer
magnitude = full.reference(x, SLOTS, absolute=True)  # the same on |values|


# fp32 sums H + r products per element: each sum errs by at most about (H + r) * 2**-24
# of the magnitude (the reference on absolute values); a few more roundings on top.
RTOL = (H + R + 4) * 2.0**-24


def check(got, what, rtol=RTOL):
    """|got - want| <= rtol * magnitude, element by element."""
    err = (got.cpu().double() - want).abs()
    worst = float((err / magnitude.clamp_min(1e-30)).max())
    assert worst <= rtol, f"{what}: error {worst:.2e} of the magnitude > {rtol}"
    return worst


def column_pieces(t, shards):
    """Per rank: its shard of every slice of ``t`` (dim 0: output rows), stacked again."""
    return [
        torch.cat([shard(p, 0, k // (WORLD // n), n) for p, n in zip(t.split(QKV), shards)])
        for k in range(WORLD)
    ]


def gather_columns(ys, shards):
    """The all-gather of y, then each slice's shards put back in order: [T, ΣN]."""
    widths = [w // n for w, n in zip(QKV, shards)]
    parts = [y.split(widths, dim=1) for y in ys]
    return torch.cat(
        [parts[j * (WORLD // n)][s] for s, n in enumerate(shards) for j in range(n)], dim=1
    )


local_slices = [w // n for w, n in zip(QKV, QKV_SHARDS)]
W_k = column_pieces(dev.weight, QKV_SHARDS)  # per rank [Σ N_s/n_s, H]


def b_shards(k):
    return [shard(b, -2, k // (WORLD // n), n) for b, n in zip(dev.lora_b, QKV_SHARDS)]


def bias_shards(k):
    return [shard(b, -1, k // (WORLD // n), n) for b, n in zip(dev.lora_bias, QKV_SHARDS)]


# Column-parallel: A whole, B and bias by output rows; no collective (but gather to compare).
ys = []
for k in range(WORLD):
    y_k = xd @ W_k[k].T  # [T, Σ N_s/n_s]
    wrapper.add_lora_linear(
        y_k, xd, dev.lora_a, b_shards(k), bias_shards(k), dev.scale, local_slices
    )
    ys.append(y_k)
column_by_hand = gather_columns(ys, QKV_SHARDS)

# Column, fully sharded: r/tp rows of A each; all-gather the fp32 buffer; then expand.
buffers = []
for k in range(WORLD):
    buf_k = torch.zeros(3, T, R // WORLD, dtype=torch.float32, device=DEVICE)  # [S, T, r/tp]
    wrapper.add_shrink(buf_k, xd, [shard(a, -2, k, WORLD) for a in dev.lora_a], dev.scale)
    buffers.append(buf_k)
buffer = torch.cat(buffers, dim=-1)  # the all-gather: [S, T, r] fp32 on every rank
ys = []
for k in range(WORLD):
    y_k = xd @ W_k[k].T
    wrapper.add_expand(y_k, buffer, b_shards(k), bias_shards(k), local_slices, offset_start=0)
    ys.append(y_k)
column_sharded_by_hand = gather_columns(ys, QKV_SHARDS)

errors = {
    "column-parallel": check(column_by_hand, "column-parallel"),
    "column, fully sharded": check(column_sharded_by_hand, "column, fully sharded"),
}
print({name: f"{e:.1e}" for name, e in errors.items()})
assert all(e <= RTOL for e in errors.values())

# %% [markdown]
# The row-parallel layer below is the `o_proj`-like layer: one slice, `N` outputs,
# input features cut in two. Rank k gets the columns `x_k` of the input.

# %%
row = LoRALinear.random((N,), H, R, L, dtype=DTYPE, seed=8, scale=0.5)
row_dev = row.to(DEVICE)
want = row.reference(x, SLOTS)  # [T, N]
magnitude = row.reference(x, SLOTS, absolute=True)

# Row-parallel: A and W by input columns, B whole; bias on rank 0 only; all-reduce y.
partials = []
for k in range(WORLD):
    x_k = shard(xd, -1, k, WORLD)  # [T, H/tp]
    y_k = x_k @ shard(row_dev.weight, 1, k, WORLD).T  # [T, N], a partial sum
    a_k = [shard(row_dev.lora_a[0], -1, k, WORLD)]  # [L, 1, r, H/tp]
    bias = row_dev.lora_bias if k == 0 else None
    wrapper.add_lora_linear(y_k, x_k, a_k, row_dev.lora_b, bias, row_dev.scale, (N,))
    partials.append(y_k)
row_by_hand = partials[0] + partials[1]  # the all-reduce

# Row, fully sharded: all-reduce the [1, T, r] buffer, expand into this rank's columns.
buffer = torch.zeros(1, T, R, dtype=torch.float32, device=DEVICE)
for k in range(WORLD):
    part = torch.zeros_like(buffer)
    a_k = [shard(row_dev.lora_a[0], -1, k, WORLD)]
    wrapper.add_shrink(part, shard(xd, -1, k, WORLD), a_k, row_dev.scale)
    buffer += part  # the all-reduce of the buffer
partials = []
for k in range(WORLD):
    y_k = shard(xd, -1, k, WORLD) @ shard(row_dev.weight, 1, k, WORLD).T  # [T, N] partial
    b_k = [shard(row_dev.lora_b[0], -2, k, WORLD)]  # [L, 1, N/tp, r]
    bias_k = [shard(row_dev.lora_bias[0], -1, k, WORLD)]
    wrapper.add_expand(y_k, buffer, b_k, bias_k, (N // WORLD,), offset_start=k * N // WORLD)
    partials.append(y_k)
row_sharded_by_hand = partials[0] + partials[1]  # the all-reduce of y

errors["row-parallel"] = check(row_by_hand, "row-parallel")
errors["row, fully sharded"] = check(row_sharded_by_hand, "row, fully sharded")
display(
    Markdown(
        "| layer | largest error / magnitude |\n|---|---|\n"
        + "\n".join(f"| {name} | {e:.1e} |" for name, e in errors.items())
    )
)
assert all(e <= RTOL for e in errors.values())

# %% [markdown]
# ## For real: two processes, `torch.distributed`
#
# `punica_numba.parallel` holds the same four schemes as classes with vLLM's names
# (`ColumnParallelLinearWithLoRA`, `ColumnParallelLinearWithShardedLoRA`,
# `RowParallelLinearWithLoRA`, `RowParallelLinearWithShardedLoRA`), each built
# for one rank from the full layer with `from_full`, and `run_layer_cases`, which
# starts one process per rank with the `spawn` start method (a fresh interpreter:
# nothing of this kernel's state is inherited), joins them in a process group on a
# free localhost port, runs each `LayerCase` on every rank and brings back every
# rank's output. The backend is NCCL when there is one GPU per rank, gloo (over
# the CPU) otherwise. A rank that fails raises `RankError` here, with its traceback.
#
# A function written in this notebook could not be sent to a spawned process (it
# is not importable), which is why the worker lives in the library.

# %%
cases = [
    LayerCase("column", full, x, SLOTS, QKV_SHARDS),
    LayerCase("column_sharded", full, x, SLOTS, QKV_SHARDS),
    LayerCase("row", row, x, SLOTS),
    LayerCase("row_sharded", row, x, SLOTS),
]
by_hand = [column_by_hand, column_sharded_by_hand, row_by_hand, row_sharded_by_hand]
backend = default_backend(WORLD)
start = time.perf_counter()
outputs = run_layer_cases(cases, WORLD, backend=backend)  # outputs[rank][case]
seconds = time.perf_counter() - start

table = ["| layer | rank | largest error / magnitude | same as by hand |", "|---|---|---|---|"]
for i, case in enumerate(cases):
    want = case.layer.reference(case.x, case.slots)
    magnitude = case.layer.reference(case.x, case.slots, absolute=True)
    for k in range(WORLD):
        got = outputs[k][i]
        worst = check(got, f"{case.kind} on rank {k}")
        same = torch.equal(got, by_hand[i].cpu())
        table.append(f"| {case.kind} | {k} | {worst:.1e} | {'bit for bit' if same else 'close'} |")
        torch.testing.assert_close(got, by_hand[i].cpu(), rtol=RTOL, atol=RTOL)
    assert torch.equal(outputs[0][i], outputs[1][i])  # every rank ends with the same y
display(
    Markdown(
        f"{WORLD} ranks over **{backend}**, {seconds:.1f} s including the start-up of "
        f"the processes\n\n" + "\n".join(table)
    )
)
assert len(outputs) == WORLD and all(len(o) == len(cases) for o in outputs)

# %% [markdown]
# ## What sharding saves, and what it sends
#
# Per rank and per step, for a 7B-class attention block (`H = 4096`, q/k/v with 32
# query and 8 k/v heads of 128, rank 16, 8 slots) on `tp = 2`: the LoRA weights each
# rank stores for the q/k/v layer, and the values its collectives move for `T`
# tokens. The fully sharded variant halves `A` at the price of an all-gather of the
# tiny fp32 buffer, `3 · T · 16` values: nothing next to the activations.

# %%
h, r, slots, tp, tokens = 4096, 16, 8, 2, 256
qkv, qkv_shards = qkv_output_slices(32, 8, 128, tp)
a_whole = len(qkv) * slots * r * h  # elements of A over the 3 slices
b_whole = slots * r * sum(qkv)
storage = {
    "column-parallel": a_whole + b_whole // tp,
    "column, fully sharded": a_whole // tp + b_whole // tp,
}
sent = {"column-parallel": 0, "column, fully sharded": len(qkv) * tokens * r * (tp - 1) // tp}
lines = ["| q/k/v layer | LoRA weights per rank | values all-gathered per rank |", "|---|---|---|"]
for name in storage:
    lines.append(f"| {name} | {storage[name] / 1e6:.2f} M | {sent[name]} fp32 |")
display(Markdown("\n".join(lines)))
assert storage["column, fully sharded"] < storage["column-parallel"]
assert sent["column, fully sharded"] < tokens * sum(qkv) // 100  # far below the activations

# %% [markdown]
# ## Summary
#
# - Shard the LoRA factor that touches the sharded dimension of the base weight:
#   `B` by outputs for column layers, `A` by inputs for row layers; the fully
#   sharded variants cut the other factor too and pay one collective on the small
#   fp32 buffer.
# - The row-parallel LoRA needs no collective of its own: it is linear, so it joins
#   the base layer's all-reduce. Only one rank may add the LoRA bias (or each its
#   shard, at its `offset_start`), or the all-reduce would count it `tp` times.
# - Every rank holds the whole batch mapping; the kernels and the wrapper are the
#   same as on one GPU. The tests (`tests/test_parallel.py`) run all four kinds,
#   packed slices, GQA and 16-bit dtypes on 2 ranks against the unsharded layer.
