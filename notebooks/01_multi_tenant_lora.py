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
# # 1. Multi-tenant LoRA and the dense reference
#
# A LoRA adapter changes a linear layer by a low-rank product: next to the base
# weight `W` it keeps two thin matrices, `A` (rank × input) and `B` (output × rank).
# A server that hosts many adapters receives one batch in which every request may
# name a different adapter, or none. This notebook states, in plain torch, what the
# multi-LoRA layer must compute for such a batch, and why doing it naively is slow.
#
# **You will learn**
#
# - what *shrink* (`x @ A^T` into an fp32 buffer) and *expand* (`buffer @ B^T` added
#   into the layer output) compute, with every shape;
# - what the slot `-1`, the `scale` factor and output *slices* (q, k, v) mean;
# - how `punica_numba.reference` states all of it token by token, in float64, and
#   how every later notebook is checked against it;
# - why one batch over many adapters is hard for ordinary GEMMs, and what the two
#   naive torch approaches (a loop per adapter, gather + `bmm`) cost, measured.

# %%
import time

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import punica_numba
from punica_numba import reference

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")

# Sizes are chosen by the machine. This notebook runs no kernel, only torch, so the
# CPU sizes can be moderate; on a GPU they are those of a 7B-class model layer.
if SIMULATOR:
    T, H, N, R, L = 96, 512, 512, 16, 8  # tokens, hidden in, hidden out, rank, slots
    TIMING_DTYPE = torch.float32  # what a CPU computes in
else:
    T, H, N, R, L = 512, 4096, 4096, 16, 32
    TIMING_DTYPE = torch.bfloat16  # what a GPU serves in

machine = "CPU (the kernels would run on Numba's CUDA simulator)" if SIMULATOR else "GPU"
print(f"machine: {machine}; T={T} tokens, H={H}, N={N}, rank r={R}, L={L} slots")


# fp32 sums of H products err by about sqrt(H) roundings: the tolerance of fp32 checks.
RTOL32 = 1e-5 if SIMULATOR else 2e-4


def check_close(got, want, rtol, what):
    """Assert max |got - want| <= rtol * max |want|; return the relative error."""
    err = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item()
    scale = max(want.abs().max().item(), 1e-30)
    assert err <= rtol * scale, f"{what}: error {err:.3g} > {rtol} * {scale:.3g}"
    return err / scale


assert T % 4 == 0 and R < min(H, N)

# %% [markdown]
# ## One adapter on one layer
#
# The base layer computes `y = x @ W^T` for `x: [T, H]`, `W: [N, H]`. A LoRA adapter of
# rank `r` adds
#
# ```
# y += scale * (x @ A^T) @ B^T        A: [r, H],  B: [N, r],  scale = alpha / r
# ```
#
# The two factors are applied one after the other, never multiplied out: `x @ A^T` is
# a thin `[T, r]` intermediate (the **shrink**), and `(...) @ B^T` widens it back to
# `[T, N]` (the **expand**). With a single adapter one could also merge it into the
# weight, `W' = W + scale * B @ A`, and pay nothing at inference; with many adapters
# in one batch, merging is impossible, because every token would need its own `W'`.

# %%
gen = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


x = randn(T, H)  # [T, H]
W = randn(N, H, scale=H**-0.5)  # [N, H] base weight
A1 = randn(R, H, scale=H**-0.5)  # [r, H]
B1 = randn(N, R, scale=R**-0.5)  # [N, r]
alpha = 32.0
scale = alpha / R

y_base = x @ W.T  # [T, N]
y_lora = y_base + scale * (x @ A1.T) @ B1.T  # [T, N]: shrink, then expand
y_merged = x @ (W + scale * B1 @ A1).T  # [T, N]: the single-adapter shortcut

# The reference with every token on slot 0 of a one-slot stack.
every_token_slot_0 = torch.zeros(T, dtype=torch.int64, device=DEVICE)
want = reference.add_lora_linear(
    y_base, x, [A1[None]], [B1[None]], None, scale, [N], every_token_slot_0
)
check_close(y_lora, want, RTOL32, "shrink then expand")
check_close(y_merged, want, RTOL32, "merged weight")
print("y_lora and y_merged both agree with reference.add_lora_linear")

# %% [markdown]
# ## Many adapters: stacked weights and a slot per token
#
# A server keeps `L` *slots* on the GPU and copies each active adapter into one of
# them. The weights of one layer are stacked over slots: `A: [L, r, H]`,
# `B: [L, N, r]`. Each token carries the **slot** of its request's adapter, or
# **`-1`** when the request uses no adapter; such a token's row must stay exactly
# the base layer's output.
#
# Written as plainly as possible, this is the whole specification:
#
# ```
# for every token t with l = slot[t] != -1:
#     y[t] += scale * (x[t] @ A[l].T) @ B[l].T
# ```
#
# `punica_numba.reference` says exactly that, in float64 so that its own rounding
# never hides an error. Below, a per-token torch loop (the same sentence in code) is
# compared with it.

# %%
A = randn(L, R, H, scale=H**-0.5)  # [L, r, H]
B = randn(L, N, R, scale=R**-0.5)  # [L, N, r]
# Awkward on purpose: about one token in five has no adapter, the others are spread
# unevenly over the slots, and slot L-1 may well be unused.
slots = torch.randint(-1, L, (T,), generator=gen)
slots[torch.rand(T, generator=gen) < 0.2] = -1
slots = slots.to(DEVICE)  # [T] int64


def lora_per_token(y, x, A, B, slots, scale):
    out = y.clone()
    for t, l in enumerate(slots.tolist()):
        if l != -1:
            out[t] += scale * (x[t] @ A[l].T) @ B[l].T
    return out


y_loop = lora_per_token(y_base, x, A, B, slots, scale)
want = reference.add_lora_linear(y_base, x, [A], [B], None, scale, [N], slots)
check_close(y_loop, want, RTOL32, "per-token loop")
no_lora = slots == -1
assert torch.equal(y_loop[no_lora], y_base[no_lora]), "a token without adapter changed"
print(f"{int(no_lora.sum())} of {T} tokens have no adapter; their rows are untouched")
print("tokens per slot:", torch.bincount(slots[~no_lora], minlength=L).tolist())

# %% [markdown]
# ## Shrink and expand, separately
#
# The multi-LoRA layer is two operations with a small buffer between them:
#
# ```
# shrink:  buffer[s, t] += scale * x[t] @ A_s[slot[t]]^T       x: [T, H], A_s: [L, r, H]
#                                                              buffer: [S, T, r] fp32
# expand:  y[t, c_s:c_s+N_s] += buffer[s, t] @ B_s[slot[t]]^T  B_s: [L, N_s, r], y: [T, ΣN_s]
# ```
#
# The buffer has one row of `r` numbers per token and slice, a few kilobytes, so it
# is kept in fp32 even when the model runs in bf16: the rank-`r` intermediate is
# never rounded to 16 bits between the two products. `S` is the number of *slices*,
# explained below; here `S = 1`. `reference.lora_shrink` and `reference.lora_expand`
# state the two halves on their own; composed, they must give `add_lora_linear`.

# %%
buffer = torch.zeros(1, T, R, dtype=torch.float32, device=DEVICE)  # [S=1, T, r] fp32
shrunk = reference.lora_shrink(x, [A], buffer, slots, scale)  # [1, T, r] float64
expanded = reference.lora_expand(shrunk, [B], y_base, slots, add_inputs=True)  # [T, N]
assert shrunk.shape == (1, T, R) and expanded.shape == (T, N)
assert torch.equal(shrunk[0, no_lora], torch.zeros_like(shrunk[0, no_lora]))
check_close(expanded, want, 1e-12, "shrink then expand (reference)")
print("reference shrink -> expand == reference add_lora_linear")

# %% [markdown]
# ## Slices: one shrink and one expand for q, k and v
#
# Transformers fuse several projections into one GEMM: q, k and v into one QKV
# matrix, gate and up into one. The base output `y` then holds the slices side by
# side, and each slice has its own LoRA pair. With grouped-query attention (GQA) the
# slices have **unequal widths**: q is `n_heads * d`, k and v are `n_kv_heads * d`.
# Slice `s` lands in the columns `c_s .. c_s + N_s` with
# `c_s = offset_start + N_0 + ... + N_{s-1}`. One shrink launch covers every slice
# (the buffer is `[S, T, r]`), and so does one expand launch.

# %%
q_width, kv_width = N, N // 4  # GQA: 4 query heads per key/value head
widths = (q_width, kv_width, kv_width)
A_qkv = [randn(L, R, H, scale=H**-0.5) for _ in widths]  # S x [L, r, H]
B_qkv = [randn(L, n, R, scale=R**-0.5) for n in widths]  # [L, N_s, r]
y_qkv = randn(T, sum(widths))  # [T, N_q + 2 N_kv], as if from the base QKV GEMM

out = y_qkv.clone()
column = 0
for A_s, B_s, width in zip(A_qkv, B_qkv, widths):
    for t, l in enumerate(slots.tolist()):
        if l != -1:
            out[t, column : column + width] += scale * (x[t] @ A_s[l].T) @ B_s[l].T
    column += width

want_qkv = reference.add_lora_linear(y_qkv, x, A_qkv, B_qkv, None, scale, widths, slots)
check_close(out, want_qkv, RTOL32, "q, k, v slices")
print("slice columns c_s:", [sum(widths[:s]) for s in range(3)], "widths:", widths)

# %% [markdown]
# ## Where `scale` lives
#
# PEFT adapters carry `alpha`, and the LoRA update is scaled by `alpha / r`. vLLM
# folds that factor into `B` when it loads an adapter into a slot, so every layer
# calls the kernels with `scale = 1.0`. Both conventions give the same numbers:

# %%
folded = reference.add_lora_linear(y_base, x, [A], [B * scale], None, 1.0, [N], slots)
check_close(folded, want, 1e-12, "scale folded into B")
print(f"scale={scale} applied in the shrink == scale folded into B")

# %% [markdown]
# ## Why one batch over many adapters is hard
#
# A GPU is fast at one large GEMM. Here each token multiplies by *its own* pair of
# matrices, so the work is `L` small GEMMs of unequal, data-dependent sizes. Two
# obvious ways to do that with torch:
#
# 1. **A loop over adapters.** Find the tokens of each slot (`torch.unique`, which
#    waits for the GPU), gather them, run two small GEMMs, scatter the result back.
#    Launches grow with the number of distinct adapters in the batch, and each
#    GEMM is too small to fill the machine.
# 2. **Gather + `bmm`.** Copy every token's own `A` and `B` into `[T, r, H]` and
#    `[T, N, r]` tensors and run one batched matrix multiply. One launch, but it
#    moves `T * r * (H + N)` weight elements instead of `L * r * (H + N)`: every token
#    re-reads, and first copies, its adapter.
#
# Both must agree with the reference first; then they are timed.


# %%
def per_lora_loop(y, x, A, B, slots, scale):
    out = y.clone()
    for l in torch.unique(slots).tolist():  # a device -> host sync on a GPU
        if l == -1:
            continue
        rows = torch.nonzero(slots == l).squeeze(1)  # [n_l]
        delta = scale * (x[rows] @ A[l].T) @ B[l].T  # [n_l, N]
        out.index_add_(0, rows, delta.to(out.dtype))
    return out


def gather_bmm(y, x, A, B, slots, scale):
    has_lora = (slots != -1).unsqueeze(1)  # [T, 1]
    index = slots.clamp(min=0)  # -1 would wrap to the last slot: mask it instead
    shrunk = torch.bmm(A[index], x.unsqueeze(2))  # [T, r, H] @ [T, H, 1] -> [T, r, 1]
    delta = scale * torch.bmm(B[index], shrunk).squeeze(2)  # [T, N, r] @ [T, r, 1]
    return torch.where(has_lora, y + delta.to(y.dtype), y)


for name, fn in (("per-LoRA loop", per_lora_loop), ("gather + bmm", gather_bmm)):
    check_close(fn(y_base, x, A, B, slots, scale), want, RTOL32, name)
print("both naive approaches agree with the reference")

# %% [markdown]
# Now the cost, at this notebook's size, in the serving dtype of the machine. On the
# CPU (no GPU here), these are **CPU numbers** from torch's CPU kernels: they show the
# shape of the problem, not what a GPU would do. For scale, the table also times the
# base layer's own GEMM `x @ W^T` and a single adapter applied to every token.


# %%
def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


def time_us(fn, repeat=7):
    """Best of ``repeat`` wall-clock runs, in microseconds (after one warm-up run)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


dt = TIMING_DTYPE
xt, Wt, At, Bt, yt = (t.to(dt) for t in (x, W, A, B, y_base))
elt = torch.finfo(dt).bits // 8  # bytes per element
active = int(torch.unique(slots[slots != -1]).numel())
candidates = {
    "base GEMM x @ W^T (no LoRA)": (lambda: xt @ Wt.T, (T * H + N * H + T * N) * elt),
    "one adapter for all tokens": (
        lambda: yt + scale * (xt @ At[0].T) @ Bt[0].T,
        (T * H + R * (H + N) + 2 * T * N) * elt,
    ),
    "per-LoRA loop": (
        lambda: per_lora_loop(yt, xt, At, Bt, slots, scale),
        (T * H + active * R * (H + N) + 2 * T * N) * elt,
    ),
    "gather + bmm": (
        lambda: gather_bmm(yt, xt, At, Bt, slots, scale),
        (T * H + 3 * T * R * (H + N) + 2 * T * N) * elt,  # read slots, write + read copies
    ),
}
rows = []
for name, (fn, nbytes) in candidates.items():
    rows.append((name, time_us(fn), nbytes / 1e6))
lines = ["| approach | time (µs) | bytes moved, roughly (MB) |", "| --- | ---: | ---: |"]
lines += [f"| {n} | {us:,.0f} | {mb:,.1f} |" for n, us, mb in rows]
where = "CPU, torch" if SIMULATOR else torch.cuda.get_device_name()
display(Markdown(f"**{where}**, {dt}, T={T}, {active} distinct adapters\n\n" + "\n".join(lines)))

# The timed functions still compute the right thing in the timing dtype.
rtol = RTOL32 if dt == torch.float32 else 2e-2
for name, fn in (("per-LoRA loop", per_lora_loop), ("gather + bmm", gather_bmm)):
    check_close(fn(yt, xt, At, Bt, slots, scale), want, rtol, f"{name} in {dt}")

# %% [markdown]
# The per-LoRA loop's cost grows with the number of **distinct** adapters in the
# batch, while gather + `bmm` pays for `T` copies of the weights whatever the mix.
# Sweep the number of adapters in use, keeping `T` fixed:

# %%
counts = [c for c in (1, 2, 4, 8, 16, 32) if c <= L]
loop_us, gather_us = [], []
for c in counts:
    mix = torch.arange(T, device=DEVICE) % c  # c adapters, evenly spread
    loop_us.append(time_us(lambda m=mix: per_lora_loop(yt, xt, At, Bt, m, scale), repeat=3))
    gather_us.append(time_us(lambda m=mix: gather_bmm(yt, xt, At, Bt, m, scale), repeat=3))
    ref_c = reference.add_lora_linear(y_base, x, [A], [B], None, scale, [N], mix)
    check_close(per_lora_loop(yt, xt, At, Bt, mix, scale), ref_c, rtol, f"loop, {c}")
    check_close(gather_bmm(yt, xt, At, Bt, mix, scale), ref_c, rtol, f"gather, {c}")

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(counts, loop_us, "o-", label="per-LoRA loop")
ax.plot(counts, gather_us, "s-", label="gather + bmm")
ax.set_xscale("log", base=2)
ax.set_xlabel("distinct adapters in the batch")
ax.set_ylabel("time per layer (µs)")
ax.set_title(f"T={T}, H={H}, N={N}, r={R}, {dt} — {'CPU' if SIMULATOR else 'GPU'}")
ax.legend()
ax.set_ylim(bottom=0)
plt.show()
assert len(loop_us) == len(counts) and all(us > 0 for us in loop_us + gather_us)

# %% [markdown]
# ## What a good kernel must do
#
# Reading the table: the floor is the traffic `T*H + L_active*r*(H+N) + 2*T*N`
# elements, about that of the base GEMM's activations plus each *active* adapter
# read **once**. The loop reads each adapter once but pays per adapter in launches
# and host syncs; the gather reads (and first writes) `T` copies. Punica's answer,
# built in the next notebooks:
#
# 1. **Sort and segment** the tokens by slot once per step (notebook 2), so that the
#    tokens of one adapter sit together;
# 2. **shrink** (notebook 3) and **expand** (notebook 4) kernels in which one block
#    works on a tile of tokens of *one* adapter, loading that adapter's weights once
#    per tile, all slots and all slices in **one launch**, with no host sync.
#
# Every one of them is checked against `punica_numba.reference`, as above.
