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
# # 5. The wrapper: `PunicaWrapperNumba` in a transformer-shaped stack
#
# A serving engine does not call `lora_shrink` and `lora_expand` itself. Once per
# step it hands the step's `LoRAMapping` to a wrapper (`update_metadata`), and then
# every LoRA layer of the model calls one method of that wrapper. `PunicaWrapperNumba`
# has the API of vLLM's `PunicaWrapperGPU`. This notebook drives it through the LoRA
# layers of one transformer block plus the embedding and the LM head, checking every
# layer against `punica_numba.reference`.
#
# **You will learn**
#
# - the call pattern: `update_metadata` once per step, then one `add_*` call per layer;
# - what the index buffers hold: token slots, sampler slots, `sampler_indices_padded`,
#   `embeddings_indices`;
# - how each layer calls the wrapper: QKV (three slices, GQA widths, with a LoRA bias),
#   gate_up (two slices), down, the embedding with extra vocabulary, the logits;
# - how to capture the LoRA layers in a CUDA graph, and what must stay outside the
#   capture.

# %%
import time

import torch
import torch.nn.functional as F
from IPython.display import display

import punica_numba
from punica_numba import LoRAMapping, PunicaWrapperNumba, reference

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
DTYPE = torch.bfloat16

if SIMULATOR:  # tiny, each CUDA thread is a Python thread
    D, Q, KV, FF, V, E, R = 24, 24, 8, 40, 50, 4, 4  # hidden, q, k/v, MLP, vocab, extra, rank
    PROMPTS = [3, 2, 4, 1, 2]  # tokens per request in the first step
else:  # a 7B-class model with grouped-query attention
    D, Q, KV, FF, V, E, R = 4096, 4096, 1024, 14336, 32000, 256, 16
    PROMPTS = [37, 5, 64, 1, 23, 48, 9, 30]
L = 4  # GPU LoRA slots
MAX_TOKENS = 256  # max_num_batched_tokens
print(f"hidden {D}, q {Q}, k/v {KV}, MLP {FF}, vocab {V}+{E}, rank {R}, {L} slots, {DTYPE}")

gen = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DTYPE).to(DEVICE)


def check_close(got, want, what, rtol=2e-2):
    """Finite entries: max |got - want| <= rtol * max |want|; infinities must match."""
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: infinities differ"
    err = (got.double() - want)[finite].abs().max().item()
    scale = max(want[finite].abs().max().item(), 1e-30)
    assert err <= rtol * scale, f"{what}: error {err:.3g} > {rtol} * {scale:.3g}"
    return err / scale


# %% [markdown]
# ## Adapters in slots
#
# Every LoRA layer keeps its adapters stacked over the `L` slots, in vLLM's shapes
# `A: [L, 1, r, in]` and `B: [L, 1, out, r]` (an empty slot holds zeros). Three adapters
# with user-visible ids 11, 22 and 33 are loaded, in no particular order, and slot 1
# is free. The scale `alpha / r` is already folded into `B`, so every call below uses
# `scale = 1.0`.

# %%
lora_index_to_id = [22, None, 11, 33]  # slot -> adapter id


def stacked(rows, cols):
    w = torch.stack([randn(1, rows, cols, scale=cols**-0.5) for _ in range(L)])  # [L, 1, ., .]
    w[lora_index_to_id.index(None)] = 0  # the free slot
    return w


layers = {
    "qkv": dict(widths=(Q, KV, KV), inp=D),
    "gate_up": dict(widths=(FF, FF), inp=D),
    "down": dict(widths=(D,), inp=FF),
}
for layer in layers.values():
    total = sum(layer["widths"])
    layer["W"] = randn(total, layer["inp"], scale=layer["inp"] ** -0.5)  # base [out, in]
    layer["A"] = tuple(stacked(R, layer["inp"]) for _ in layer["widths"])  # [L, 1, r, in]
    layer["B"] = tuple(stacked(n, R) for n in layer["widths"])  # [L, 1, N_s, r]
layers["qkv"]["bias"] = tuple(randn(L, 1, n, scale=0.1) for n in (Q, KV, KV))  # LoRA bias

for name, layer in layers.items():
    shapes = [tuple(a.shape) for a in layer["A"]], [tuple(b.shape) for b in layer["B"]]
    print(f"{name:<8} A {shapes[0]}  B {shapes[1]}")
assert not layers["qkv"]["A"][0][1].any(), "the free slot holds zeros"

# %% [markdown]
# ## Step 1: the mapping, and `update_metadata`
#
# Five (or eight) requests arrive, with adapters 11, none, 33, 22, 11, ...; each
# contributes its prompt's tokens. `index_mapping` holds one adapter id per token and
# `prompt_mapping` one per row that reaches the sampler (here: one per request, its
# last token). `update_metadata(mapping, lora_index_to_id, max_loras, vocab_size,
# extra_vocab_size)` converts ids to slots and prepares the segments of both mappings;
# vLLM's model manager passes `max_loras = L + 1`.

# %%
adapters = [11, 0, 33, 22, 11, 0, 33, 22][: len(PROMPTS)]
wrapper = PunicaWrapperNumba(MAX_TOKENS, 16, DEVICE, max_loras=L)


def step_mapping(adapters, tokens_per_request):
    index = [a for a, n in zip(adapters, tokens_per_request) for _ in range(n)]
    return LoRAMapping(index, list(adapters), is_prefill=True)


mapping = step_mapping(adapters, PROMPTS)
wrapper.update_metadata(mapping, lora_index_to_id, L + 1, V, E)

T, P = len(mapping.index_mapping), len(mapping.prompt_mapping)
slot_of = {i: s for s, i in enumerate(lora_index_to_id) if i is not None}
slots = torch.tensor([slot_of.get(i, -1) for i in mapping.index_mapping], device=DEVICE)
sampler = torch.tensor([slot_of.get(i, -1) for i in mapping.prompt_mapping], device=DEVICE)
assert torch.equal(wrapper.token_lora_indices, slots)
assert torch.equal(wrapper.sampler_indices, sampler)
# sampler_indices_padded[p] = p + s'[p] * P, where s' sends -1 to the extra block L.
padded = torch.arange(P, device=DEVICE) + torch.where(sampler == -1, L, sampler) * P
assert torch.equal(wrapper.sampler_indices_padded, padded)
e = slots.clamp(min=0)  # a token without adapter reads slot 0's rows (harmless, see below)
assert torch.equal(wrapper.embeddings_indices, torch.stack([e * E, e * (V + E)]))
print(f"T={T} tokens, P={P} sampled rows")
print("token slots:   ", wrapper.token_lora_indices.tolist()[:40])
print("sampler slots: ", wrapper.sampler_indices.tolist())
print("sampler padded:", wrapper.sampler_indices_padded.tolist())
display(wrapper.token_mapping_meta)  # its segments
assert [seg.slot for seg in wrapper.token_mapping_meta.segments()] == sorted(set(slots.tolist()))

# %% [markdown]
# ## The embedding, with extra vocabulary
#
# An adapter may add up to `E` new tokens (ids `V .. V+E-1`). The model's embedding
# table therefore has `V + L*E` rows: the base vocabulary, then an `E`-row block of
# added embeddings per slot. `embeddings_indices[0] = slot * E` moves an added token of
# slot `l` into its slot's block. The LoRA part is special: `A` is a lookup table
# `[L, V+E, r]`, read with `F.embedding` at `token + embeddings_indices[1]` (=
# `token + slot * (V+E)`) in its 2-D view; only the expand runs as a kernel,
# through `add_lora_embedding`.

# %%
token_ids = torch.randint(0, V, (T,), generator=gen).to(DEVICE)
added = (slots != -1) & (torch.arange(T, device=DEVICE) % 3 == 0)  # some LoRA tokens
token_ids[added] = V + torch.randint(0, E, (int(added.sum()),), generator=gen).to(DEVICE)

emb_table = randn(V + L * E, D)  # base vocabulary, then each slot's added rows
emb_A = randn(L, V + E, R)  # [L, V+E, r]: a lookup table, not a matrix product
emb_B = stacked(D, R)  # [L, 1, D, r]

is_added = token_ids > V - 1
base_rows = token_ids + wrapper.embeddings_indices[0] * is_added  # [T]
y_emb = F.embedding(base_rows, emb_table)  # [T, D]
a_rows = F.embedding(token_ids + wrapper.embeddings_indices[1], emb_A.view(-1, R))  # [T, r]
before = y_emb.clone()
wrapper.add_lora_embedding(y_emb, a_rows, emb_B, add_inputs=True)

for t in range(T):  # the base rows: an added token reads its own slot's block
    tok, s = int(token_ids[t]), int(slots[t])
    row = emb_table[V + s * E + tok - V] if tok >= V else emb_table[tok]
    assert torch.equal(before[t], row)
    if s != -1:
        assert torch.equal(a_rows[t], emb_A[s, tok])
want = reference.add_lora_embedding(before, a_rows, emb_B, slots)
check_close(y_emb, want, "embedding")
print(f"embedding agrees with the reference ({int(added.sum())} tokens from the extra vocabulary)")

# %% [markdown]
# ## QKV, gate_up and down: `add_lora_linear`
#
# A linear layer with LoRA runs its base GEMM and then one call,
# `add_lora_linear(y, x, A, B, bias, scale, output_slices)`, which shrinks all slices
# into a zeroed fp32 buffer in one launch, expands them into `y` in a second launch,
# and adds each token's slot bias. For QKV under GQA the slices have widths
# `(Q, KV, KV)`; for gate_up `(FF, FF)`; for down one slice. The glue between layers
# stands in for attention and the activation, so each layer sees realistic inputs.


# %%
def lora_linear(name, x):
    layer = layers[name]
    y = x @ layer["W"].T  # base GEMM: [T, sum N_s]
    before = y.clone()
    bias = layer.get("bias")
    wrapper.add_lora_linear(y, x, layer["A"], layer["B"], bias, 1.0, layer["widths"])
    want = reference.add_lora_linear(
        before, x, layer["A"], layer["B"], bias, 1.0, layer["widths"], wrapper.token_lora_indices
    )
    err = check_close(y, want, name)
    no_lora = wrapper.token_lora_indices == -1
    assert torch.equal(y[no_lora], before[no_lora]), f"{name}: a token without adapter changed"
    print(f"{name:<8} {tuple(x.shape)} -> {tuple(y.shape)}: agrees (relative error {err:.1e})")
    return y


qkv = lora_linear("qkv", y_emb)
attn = qkv[:, :Q].contiguous()  # stands in for attention's output (the width of q)
gate_up = lora_linear("gate_up", attn)
act = F.silu(gate_up[:, :FF]) * gate_up[:, FF:]  # SwiGLU
hidden = lora_linear("down", act)
assert hidden.shape == (T, D)

# %% [markdown]
# ## The logits: the sampler mapping
#
# The LM head runs on the sampled rows only (here the last token of each request), so
# it uses the **prompt** (sampler) mapping: one slot per row `p`. Two LoRA pieces:
#
# 1. the logits of the adapter's **added tokens** `V .. V+E-1`: each slot's added
#    embeddings `[L, E, D]` times the hidden states give `[L, E, P]`; a block of `-inf`
#    is appended for "no adapter", the result is flattened to `[(L+1)*P, E]`, and
#    `sampler_indices_padded` picks, for every row, its own slot's logits (or `-inf`);
# 2. the LoRA delta on the whole (padded) vocabulary, `add_lora_logits`.

# %%
last = torch.tensor(PROMPTS, device=DEVICE).cumsum(0) - 1  # each request's last token
h = hidden[last]  # [P, D]
lm_head = randn(V + E, D, scale=D**-0.5)  # the padded vocabulary
logits = h @ lm_head.T  # [P, V+E]

added_emb = emb_table[V:].view(L, E, D)  # the slots' added token embeddings
extra = added_emb @ h.T  # [L, E, P]
extra = torch.cat([extra, torch.full((1, E, P), float("-inf"), dtype=DTYPE, device=DEVICE)])
extra = extra.transpose(1, 2).reshape((L + 1) * P, E)  # row s*P + p: slot s, row p
logits[:, V:] = extra.index_select(0, wrapper.sampler_indices_padded)  # [P, E]
for p, s in enumerate(sampler.tolist()):
    if s == -1:
        assert torch.isinf(logits[p, V:]).all(), "a row without adapter must not see added tokens"
    else:
        own = added_emb[s].double() @ h[p].double()  # [E]: slot s's added-token logits
        check_close(logits[p, V:], own, f"added-token logits of row {p}")

lm_A, lm_B = stacked(R, D), stacked(V + E, R)
before = logits.clone()
wrapper.add_lora_logits(logits, h, lm_A, lm_B, 1.0)
want = reference.add_lora_logits(before, h, lm_A, lm_B, 1.0, wrapper.sampler_indices)
check_close(logits, want, "logits")
print(f"logits {tuple(logits.shape)} agree; rows without adapter see -inf for added tokens")

# %% [markdown]
# ## Step 2: decoding
#
# The next step is a decode step: every request still running adds one token, one
# request has finished and a new one without adapter has arrived. The engine calls
# `update_metadata` with the new mapping, and every layer runs again.

# %%
decoding = adapters[1:] + [0]  # the first request finished, a new one (no adapter) came
mapping2 = step_mapping(decoding, [1] * len(decoding))
wrapper.update_metadata(mapping2, lora_index_to_id, L + 1, V, E)
T2 = len(decoding)
assert wrapper.token_lora_indices.tolist() == [slot_of.get(a, -1) for a in decoding]
meta2 = wrapper.token_mapping_meta
assert meta2.token_lora_mapping[T2:].eq(-1).all(), "slots past the step are reset to -1"
x2 = randn(T2, D)
display(wrapper.token_mapping_meta)
qkv2 = lora_linear("qkv", x2)
assert qkv2.shape == (T2, Q + 2 * KV)

# %% [markdown]
# ## Capturing the LoRA layers in a CUDA graph
#
# At decode sizes a layer's kernels need microseconds, while launching them from
# Python costs far more (notebook 6). A CUDA graph records the launches once and
# replays them with a single call. The rules, from `PunicaWrapperNumba`'s docstring:
#
# - **outside the capture**: `update_metadata` (it reads back to the host), and one
#   call of each `add_*` method first, which compiles the kernels and fixes their
#   launch shapes;
# - **the captured mapping** must give at least one token an adapter: a batch without
#   any is skipped on the host, so nothing would be recorded;
# - **after the capture**: call `update_metadata` outside the graph with any mapping of
#   the same or fewer tokens (the graph keeps reading the same metadata buffers), copy
#   the new inputs into the captured input tensor, and replay. Rows past the step's
#   tokens are padding: their slot is `-1`.
#
# This cell needs a GPU; on the simulator there is nothing to capture.


# %%
def qkv_reference(x, y_base, slots):
    layer = layers["qkv"]
    return reference.add_lora_linear(
        y_base, x, layer["A"], layer["B"], layer["bias"], 1.0, layer["widths"], slots
    )


if not SIMULATOR:
    layer = layers["qkv"]
    G = 16  # the captured batch: 16 decode tokens
    graph_adapters = [11, 22, 33, 0] * (G // 4)
    wrapper.update_metadata(step_mapping(graph_adapters, [1] * G), lora_index_to_id, L + 1, V, E)
    static_x = randn(G, D)  # the captured input: later steps copy into it
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def qkv_layer():
        y = static_x @ layer["W"].T
        wrapper.add_lora_linear(
            y, static_x, layer["A"], layer["B"], layer["bias"], 1.0, layer["widths"]
        )
        return y

    with torch.cuda.stream(side):  # warm up on the capture stream, outside the capture
        for _ in range(2):
            qkv_layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_y = qkv_layer()  # allocated from the graph's memory pool

    # A later step: new adapters (fewer tokens than captured), new inputs; then replay.
    new_adapters = [33, 0, 0, 22, 11, 11, 0, 33, 22, 11, 33, 0, 22]  # 13 of 16 rows
    wrapper.update_metadata(
        step_mapping(new_adapters, [1] * len(new_adapters)), lora_index_to_id, L + 1, V, E
    )
    new_x = randn(G, D)
    static_x.copy_(new_x)
    graph.replay()
    padding = [-1] * (G - len(new_adapters))  # rows 13..15 are padding: no adapter
    slots_g = torch.tensor([slot_of.get(a, -1) for a in new_adapters] + padding, device=DEVICE)
    want = qkv_reference(new_x, new_x @ layer["W"].T, slots_g)
    check_close(static_y, want, "graph replay")
    print("the replayed graph agrees with the reference for the new step's mapping")

    def time_us(fn, n=200):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    print(
        f"QKV layer (base GEMM + LoRA), {G} tokens: eager {time_us(qkv_layer):.0f} µs, "
        f"graph replay {time_us(graph.replay):.0f} µs per step"
    )
else:
    print("simulator: no CUDA graphs here; on a GPU this cell captures and replays the layer")
    check_close(
        qkv2,
        qkv_reference(x2, x2 @ layers["qkv"]["W"].T, wrapper.token_lora_indices),
        "step 2 again",
    )
