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
# # 2. Metadata: sort and segment
#
# The kernels of notebooks 3 and 4 never walk the tokens in batch order. They walk
# **segments**: the tokens sorted by slot, so that all the tokens of one adapter sit
# next to each other and one block can load that adapter's weights once for a whole
# tile of tokens. This notebook builds that metadata, `LoRAKernelMeta`, by hand from
# a token → slot list, compares it with the library's, draws it, and states the
# properties it must have.
#
# **You will learn**
#
# - how a batch of requests becomes a token → slot list (`LoRAMapping` →
#   `convert_mapping`);
# - how a stable sort, a `bincount` and a `cumsum` give the five metadata tensors,
#   and how they compare with `LoRAKernelMeta.prepare_tensors`;
# - what a segment looks like before and after sorting (a picture);
# - the properties every metadata must satisfy, asserted on awkward cases, and why
#   the buffers have fixed sizes (CUDA graphs, padded batches).

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display
from matplotlib.colors import ListedColormap

import punica_numba
from punica_numba import LoRAKernelMeta, LoRAMapping, convert_mapping, reference

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
# Metadata launches no kernel, so the large checks below can be large on both machines;
# on a GPU they use the sizes of a busy serving step.
BIG_T, BIG_L = (300, 16) if SIMULATOR else (8192, 64)
print(f"device: {DEVICE}; large checks at T={BIG_T} tokens, L={BIG_L} slots")

# %% [markdown]
# ## From requests to a token → slot list
#
# A step of the server holds a few requests. Each names an adapter by its
# user-visible id (`0` = no adapter) and contributes some tokens. The adapters that
# are loaded sit in GPU **slots**; `lora_index_to_id[slot]` says which id is where,
# and a free slot holds `None`. `LoRAMapping` carries one id per token (and one per
# sampled row); `convert_mapping` turns ids into slots, `-1` for "no adapter".

# %%
L = 4  # GPU slots
lora_index_to_id = [3, None, 12, 7]  # slot 1 is free
requests = [  # (adapter id, tokens this step)
    (7, 3),
    (0, 2),
    (3, 4),
    (7, 1),
    (12, 2),
    (0, 3),
    (3, 2),
]
index_mapping = [adapter for adapter, n in requests for _ in range(n)]  # one id per token
prompt_mapping = [adapter for adapter, _ in requests]  # one id per request
mapping = LoRAMapping(index_mapping, prompt_mapping, is_prefill=True)

# vLLM's model manager passes L + 1 as max_loras (the extra block of the logits layer).
indices = convert_mapping(mapping, lora_index_to_id, L + 1, 32000, 256, DEVICE)
slots = indices.base_indices  # [T] int64, -1 = no adapter
T = slots.numel()

slot_of = {i: s for s, i in enumerate(lora_index_to_id) if i is not None}
expected = [slot_of[i] if i > 0 else -1 for i in index_mapping]
assert slots.tolist() == expected
print("token:", list(range(T)))
print("id:   ", index_mapping)
print("slot: ", slots.tolist())

# %% [markdown]
# ## Step 1: a stable sort by slot
#
# `torch.sort(slots, stable=True)` returns the slots in ascending order and, in
# `indices`, which token each position came from. **Stable** means that tokens with
# the same slot keep their batch order, so each request's tokens stay together and
# in order, and the result is the same on every run. Tokens without an adapter
# (`-1`) sort first.

# %%
sorted_slots, order = torch.sort(slots, stable=True)  # [T], [T]
print("position:      ", list(range(T)))
print("sorted token:  ", order.tolist())
print("its slot:      ", sorted_slots.tolist())

assert torch.equal(slots[order], sorted_slots)
assert bool((sorted_slots[1:] >= sorted_slots[:-1]).all()), "not sorted"
same = sorted_slots[1:] == sorted_slots[:-1]
assert bool((order[1:][same] > order[:-1][same]).all()), "ties out of batch order: not stable"

# %% [markdown]
# ## Step 2: count, and cut into segments
#
# `bincount(slots + 1)` counts the tokens of every slot `-1 .. L-1` in one pass
# (entry `j` is slot `j - 1`). The slots that occur become the **active** ids, in
# ascending order; their counts, and the running sum of the counts, say where each
# segment starts in the sorted order:
#
# ```
# segment i = order[start[i] : start[i] + count[i]]   all tokens of slot active[i]
# ```
#
# The library keeps these in **fixed-size** buffers (so a CUDA graph can capture the
# kernels that read them): `L + 1` entries for the ids and counts (every slot, plus
# `-1`) and `L + 2` for the starts. Unused ids are `-1` and unused counts `0`: a
# kernel skips an id of `-1`, whether it means "no adapter" or "no segment".

# %%
counts_by_slot = torch.bincount(slots + 1, minlength=L + 1)  # [L+1]: slot -1 .. L-1
present = torch.nonzero(counts_by_slot).squeeze(1)  # [k] (this reads back to the host)
k = present.numel()

active_lora_ids = torch.full((L + 1,), -1, dtype=torch.int32, device=DEVICE)
num_tokens_per_lora = torch.zeros(L + 1, dtype=torch.int32, device=DEVICE)
lora_token_start_loc = torch.zeros(L + 2, dtype=torch.int32, device=DEVICE)
active_lora_ids[:k] = (present - 1).to(torch.int32)  # ascending, -1 first if present
num_tokens_per_lora[:k] = counts_by_slot[present].to(torch.int32)
lora_token_start_loc[1 : k + 1] = torch.cumsum(num_tokens_per_lora[:k], 0)

print("active_lora_ids:     ", active_lora_ids.tolist())
print("num_tokens_per_lora: ", num_tokens_per_lora.tolist())
print("lora_token_start_loc:", lora_token_start_loc.tolist())
assert int(num_tokens_per_lora.sum()) == T
assert int(lora_token_start_loc[k]) == T

# %% [markdown]
# ## The library's `LoRAKernelMeta`
#
# `LoRAKernelMeta.make(L, max_num_tokens, device)` allocates the buffers once;
# `prepare_tensors(slots)` fills them each step, the same way but without the host
# read-back that `nonzero` needs above (it moves the present slots to the front with
# a second stable sort). Our hand-built tensors must equal its, field by field. It
# also keeps `no_lora_flag_cpu`, a one-element CPU tensor, so that a call on a batch
# without any adapter can skip the launch without asking the GPU.

# %%
MAX_TOKENS = 32  # what the buffers are sized for: the most tokens a step may hold
meta = LoRAKernelMeta.make(L, MAX_TOKENS, DEVICE)
meta.prepare_tensors(slots)

assert torch.equal(meta.token_indices_sorted_by_lora_ids[:T], order.to(torch.int32))
assert torch.equal(meta.active_lora_ids, active_lora_ids)
assert torch.equal(meta.num_tokens_per_lora, num_tokens_per_lora)
assert torch.equal(meta.lora_token_start_loc, lora_token_start_loc)
assert torch.equal(meta.token_lora_mapping[:T], slots.to(torch.int32))
assert meta.no_lora_flag_cpu.device.type == "cpu" and not bool(meta.no_lora_flag_cpu)
print("hand-built metadata == LoRAKernelMeta.prepare_tensors")
display(meta)  # its table of segments

# %% [markdown]
# ### Made on the host
#
# A serving engine holds each step's slots on the host already: they come from the
# `LoRAMapping`'s lists. On a GPU, `prepare_tensors` runs a small torch operation for
# every line of its computation (214, views among them) and reads two numbers back;
# `prepare_slots(slots)` computes the same buffers with NumPy on a host copy of them
# (`punica_numba.host_meta`: a bincount, a stable argsort, a cumsum and a searchsorted
# per tile table) and sends each buffer with one asynchronous copy
# (`punica_numba.staging`), no kernel and no sync. The wrapper's `update_metadata` takes
# this path. The result is the same, field by field; `host_twin=True` asks for the host
# copy also where the buffers are on the CPU, as they are on the simulator.

# %%
on_the_host = LoRAKernelMeta.make(L, MAX_TOKENS, DEVICE, host_twin=True)
on_the_host.prepare_slots(slots.tolist())  # a plain list of ints
for name in (
    "token_lora_mapping",
    "token_indices_sorted_by_lora_ids",
    "active_lora_ids",
    "num_tokens_per_lora",
    "lora_token_start_loc",
    "no_lora_flag_cpu",
):
    assert torch.equal(getattr(on_the_host, name), getattr(meta, name)), name
print("prepare_slots (made on the host) == prepare_tensors")

# %% [markdown]
# ## A picture of the segments
#
# Each square is a token, coloured by its slot (grey: no adapter). Top: batch order,
# the way requests arrived. Bottom: sorted order, cut into segments.

# %%
palette = ["#bbbbbb", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
cmap = ListedColormap(palette[: L + 1])


def draw_segments(ax, slots, order, meta, title):
    """Tokens coloured by slot: batch order above, sorted order below."""
    before = slots.cpu().numpy() + 1
    after = slots[order].cpu().numpy() + 1
    ax.imshow(np.stack([before, after]), cmap=cmap, vmin=0, vmax=L, aspect="equal")
    for row, tokens in ((0, range(len(before))), (1, order.tolist())):
        for col, token in enumerate(tokens):
            ax.text(col, row, str(token), ha="center", va="center", fontsize=8)
    for seg in meta.segments():
        ax.axvline(seg.start - 0.5, ymin=0, ymax=0.5, color="black", lw=2)
        label = "none" if seg.slot == -1 else f"slot {seg.slot}"
        ax.text(seg.start + seg.count / 2 - 0.5, 1.75, label, ha="center", va="top", fontsize=9)
    ax.set_yticks([0, 1], ["batch order", "sorted"])
    ax.set_xticks([])
    ax.set_title(title)


fig, ax = plt.subplots(figsize=(10, 2.4))
draw_segments(ax, slots, order, meta, "tokens by slot (numbers: token index)")
plt.show()
assert [s.slot for s in meta.segments()] == sorted(set(slots.tolist()))

# %% [markdown]
# ## The segments are all a kernel needs
#
# With the segments, shrink becomes one small dense product per segment: gather the
# segment's rows of `x`, multiply by *its* slot's `A`. This loop is what a kernel
# does in parallel, and it must agree with the reference, which knows nothing about
# segments.


# %%
def shrink_by_segments(x, A, meta, num_rows, scale):
    """[T, r] float64: for each segment, scale * x[its tokens] @ A[its slot]^T."""
    out = torch.zeros(num_rows, A.shape[1], dtype=torch.float64, device=x.device)
    _, order, counts, starts, ids, no_lora = meta.meta_args(num_rows)
    if bool(no_lora):
        return out  # nothing to launch
    for slot, count, start in zip(ids.tolist(), counts.tolist(), starts.tolist()):
        if slot == -1 or count == 0:
            continue  # tokens without adapter, or an unused entry
        tokens = order[start : start + count].long()  # [count]
        out[tokens] = scale * x[tokens].double() @ A[slot].double().T
    return out


gen = torch.Generator().manual_seed(0)
H, R = 24, 3
x = torch.randn(T, H, generator=gen).to(DEVICE)
A = torch.randn(L, R, H, generator=gen).to(DEVICE)
got = shrink_by_segments(x, A, meta, T, 0.5)
want = reference.lora_shrink(x, [A], torch.zeros(1, T, R, device=DEVICE), slots, 0.5)[0]
assert torch.allclose(got, want, rtol=0, atol=1e-12)
print("shrink by segments == reference.lora_shrink")

# %% [markdown]
# ## The properties that must hold
#
# For any token → slot list of `n <= max_num_tokens` tokens:
#
# 1. `sorted[:n]` is a permutation of `0 .. n-1`, and past `n` the identity;
# 2. the slots along `sorted[:n]` never decrease, and equal slots keep batch order;
# 3. the used entries of `active_lora_ids` are exactly the distinct slots, ascending;
#    the unused ones are `-1` with a count of `0`;
# 4. `count[i]` is the number of tokens of `active_lora_ids[i]`; the counts sum to `n`
#    (except when no token has an adapter: then there is nothing to compute, and every
#    entry is unused);
# 5. `start[0] = 0` and `start[i+1] = start[i] + count[i]`;
# 6. every token of segment `i` has slot `active_lora_ids[i]`;
# 7. `no_lora_flag_cpu` is True exactly when no token has an adapter.
#
# The function below asserts all of them, and the same segment-wise shrink is checked
# against the reference. It is run on the awkward cases that break sloppy code.


# %%
def check_metadata(meta, slots):
    n, L = slots.numel(), meta.max_loras
    order = meta.token_indices_sorted_by_lora_ids.cpu().long()
    ids = meta.active_lora_ids.cpu().long()
    counts = meta.num_tokens_per_lora.cpu().long()
    starts = meta.lora_token_start_loc.cpu().long()
    s = slots.cpu().long()
    assert sorted(order[:n].tolist()) == list(range(n))  # 1
    assert order[n:].tolist() == list(range(n, meta.max_num_tokens))
    along = s[order[:n]]
    assert bool((along[1:] >= along[:-1]).all())  # 2
    ties = along[1:] == along[:-1]
    assert bool((order[1:n][ties] > order[: n - 1][ties]).all()) if n > 1 else True
    no_lora = bool((s == -1).all())
    assert bool(meta.no_lora_flag_cpu) == no_lora  # 7
    distinct = [] if no_lora else sorted(set(s.tolist()))  # 3
    k = len(distinct)
    assert ids[:k].tolist() == distinct and ids.shape == (L + 1,)
    assert bool((ids[k:] == -1).all()) and bool((counts[k:] == 0).all())
    assert [int((s == d).sum()) for d in distinct] == counts[:k].tolist()  # 4
    assert int(counts.sum()) == (0 if no_lora else n)
    assert int(starts[0]) == 0 and starts.shape == (L + 2,)  # 5
    assert torch.equal(starts[1 : k + 1], torch.cumsum(counts[:k], 0))
    for i in range(k):  # 6
        segment = order[starts[i] : starts[i] + counts[i]]
        assert bool((s[segment] == ids[i]).all())


def awkward_cases(num_tokens, num_loras, gen):
    zipf = torch.from_numpy(np.random.default_rng(1).zipf(1.5, num_tokens) - 1)
    zipf = zipf.clamp(max=num_loras - 1)
    zipf[torch.rand(num_tokens, generator=gen) < 0.1] = -1
    return {
        "no tokens": [],
        "one token with an adapter": [num_loras - 1],
        "one token without": [-1],
        "no adapter anywhere": [-1] * 7,
        "every token its own slot": torch.randperm(num_loras, generator=gen).tolist(),
        "all on one slot": [2] * 9,
        "uniform with -1": torch.randint(-1, num_loras, (num_tokens,), generator=gen).tolist(),
        "a few popular slots (zipf)": zipf.tolist(),
    }


for name, case in awkward_cases(BIG_T, BIG_L, gen).items():
    case = torch.tensor(case, dtype=torch.int64, device=DEVICE)
    m = LoRAKernelMeta.make(BIG_L, BIG_T, DEVICE)
    m.prepare_tensors(case)
    check_metadata(m, case)
    n = case.numel()
    xs = torch.randn(n, 8, generator=gen).to(DEVICE)
    As = torch.randn(BIG_L, 2, 8, generator=gen).to(DEVICE)
    ref = reference.lora_shrink(xs, [As], torch.zeros(1, n, 2, device=DEVICE), case, 1.0)[0]
    assert torch.allclose(shrink_by_segments(xs, As, m, n, 1.0), ref, rtol=0, atol=1e-9)
    print(f"{name:<28} n={n:<5} segments={len(m.segments()):<3} properties hold")

# %% [markdown]
# ## Fixed sizes, padding and CUDA graphs
#
# A CUDA graph records kernel launches with their arguments fixed, so the metadata
# must live in the same tensors every step: `prepare_tensors` writes into the
# buffers `make` allocated and never reallocates. Under graphs the activation is
# also **padded** to the captured batch size: `x` may have more rows than the step
# has tokens. `meta_args(rows)` hands the ops the metadata for `rows` activation
# rows; the padding rows belong to no segment, so the kernels leave them alone.

# %%
step_tokens, padded_rows = T, 24  # 17 real tokens in a graph captured for 24
x_padded = torch.randn(padded_rows, H, generator=gen).to(DEVICE)
mapping_args = meta.meta_args(padded_rows)
print("meta_args shapes:", [tuple(t.shape) for t in mapping_args])

slots_padded = torch.cat([slots, torch.full((padded_rows - T,), -1, device=DEVICE)])
got = shrink_by_segments(x_padded, A, meta, padded_rows, 1.0)
want = reference.lora_shrink(
    x_padded, [A], torch.zeros(1, padded_rows, R, device=DEVICE), slots_padded, 1.0
)[0]
assert torch.allclose(got, want, rtol=0, atol=1e-12)
assert not got[T:].any(), "a padding row was touched"
assert meta.token_lora_mapping[T:].eq(-1).all(), "slots past the step must read -1"
print(f"rows {T}..{padded_rows - 1} are padding: in no segment, untouched")

# %% [markdown]
# Next: notebook 3 turns `shrink_by_segments` into a kernel in which one block takes
# one tile of one segment.
