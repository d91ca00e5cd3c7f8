"""A tiny multi-tenant engine: one Llama model, many LoRA adapters, one batch.

This is the smallest serving loop in which the wrapper does its real job. A batch
of requests, each naming an adapter id (``0`` for none), is generated together:

* **One token row per token.** A step's tokens are concatenated, request after
  request, into one ``[T, hidden]`` tensor, with no padding (vLLM's layout). The
  prefill step holds every prompt; each decode step holds one token per request.
* **One wrapper call per LoRA layer.** The projections of each decoder layer are
  packed as vLLM packs them: q/k/v as one layer of 3 slices (k and v narrower under
  grouped-query attention), o alone, gate/up as one layer of 2 slices, down alone.
  Each runs the base GEMM, then one
  :meth:`~punica_numba.PunicaWrapperNumba.add_lora_linear` call that adds every
  token's own adapter: the kernels see the whole batch.
* **Metadata every step.** Before each forward pass the step's
  :class:`~punica_numba.LoRAMapping` (one id per token, one per request) goes to
  ``update_metadata``.
* **Attention per request.** Each request has its own KV cache rows; attention
  never mixes requests. The rest of the forward pass (embedding, RMSNorm, RoPE,
  SiLU, LM head) reuses the Hugging Face model's modules, so the engine computes
  what ``LlamaForCausalLM`` computes; sampling is greedy.

The model is built locally from a ``LlamaConfig`` with random weights
(:func:`tiny_llama`); nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._cuda import KERNEL_DTYPES, device_of
from .mapping import LoRAMapping
from .peft import LoRASlots, PackedLinear, PeftAdapter
from .wrapper import PunicaWrapperNumba

__all__ = [
    "Generation",
    "LoRALinear",
    "MultiLoRAEngine",
    "Request",
    "packed_layers",
    "tiny_llama",
]

#: The HF module names of the projections the engine serves LoRA on (PEFT's names).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(
    *,
    vocab_size: int = 128,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
):
    """A ``LlamaForCausalLM`` with random weights, built from a config (nothing downloaded).

    ``num_kv_heads < num_heads`` makes it use grouped-query attention, so the k and v
    slices of the QKV layer are narrower than q. Returned in eval mode on ``device``
    (default: the kernels' device) in ``dtype``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # no end-of-sequence token: every request generates in full
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device=device or device_of(), dtype=dtype).eval()


def packed_layers(model) -> list[PackedLinear]:
    """The engine's LoRA layers for a ``LlamaForCausalLM``: 4 per decoder layer.

    ``qkv_proj`` packs (q, k, v), ``gate_up_proj`` packs (gate, up); ``o_proj`` and
    ``down_proj`` are single. Module names are PEFT's (``model.layers.0.self_attn.q_proj``).
    """
    layers = []
    for i, decoder in enumerate(model.model.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for name, parent, module, leaves in (
            (f"{attn}.qkv_proj", attn, decoder.self_attn, ("q_proj", "k_proj", "v_proj")),
            (f"{attn}.o_proj", attn, decoder.self_attn, ("o_proj",)),
            (f"{mlp}.gate_up_proj", mlp, decoder.mlp, ("gate_proj", "up_proj")),
            (f"{mlp}.down_proj", mlp, decoder.mlp, ("down_proj",)),
        ):
            linears = [getattr(module, leaf) for leaf in leaves]
            layers.append(
                PackedLinear(
                    name=name,
                    modules=tuple(f"{parent}.{leaf}" for leaf in leaves),
                    in_features=linears[0].in_features,
                    output_slices=tuple(lin.out_features for lin in linears),
                )
            )
    return layers


class LoRALinear(nn.Module):
    """The model's linear module(s), packed, plus every token's own LoRA through the wrapper.

    Semantics:
        x: [T, H] -> y: [T, sum N_s]
        y = x @ W^T + bias                       (W = the slices' weights, stacked)
        y[t, slice s] += x[t] @ A_s[slot]^T @ B_s[slot]^T   for tokens with a LoRA
    """

    def __init__(
        self,
        spec: PackedLinear,
        linears: Sequence[nn.Linear],
        slots: LoRASlots,
        punica: PunicaWrapperNumba,
    ):
        super().__init__()
        self.spec, self.slots, self.punica = spec, slots, punica
        # One GEMM for all slices, as vLLM's packed layers do (a copy of the weights).
        self.weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum N_s, H]
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # [T, sum N_s]
        name = self.spec.name
        self.punica.add_lora_linear(
            y,
            x,
            self.slots.lora_a[name],
            self.slots.lora_b[name],
            None,
            1.0,  # the scaling is folded into B when an adapter is loaded
            self.spec.output_slices,
        )
        return y


@dataclass(frozen=True)
class Request:
    """A request: its prompt's token ids and its adapter id (``0`` = the base model)."""

    prompt: tuple[int, ...]
    adapter_id: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt:
            raise ValueError("a request needs at least one prompt token")


@dataclass
class Generation:
    """What the engine generated for one request.

    Attributes:
        tokens: the new tokens, greedy.
        logits: ``[new tokens, vocab]`` float32, the logits each new token was chosen
            from (step k's row predicts ``tokens[k]``); None unless asked for.
    """

    tokens: list[int]
    logits: torch.Tensor | None = None


@dataclass
class _Step:
    """One forward pass's token rows: request b owns ``starts[b] : starts[b] + lengths[b]``."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    starts: list[int]
    lengths: list[int]
    past: list[int]  # tokens of request b already in the KV cache

    @property
    def decode(self) -> bool:
        return all(n == 1 for n in self.lengths)


class MultiLoRAEngine:
    """Serve a batch of requests, each with its own LoRA adapter, on one Llama model.

    Args:
        model: a ``LlamaForCausalLM`` on the kernels' device (:func:`tiny_llama`); the
            engine reuses its embedding, norms, rotary embedding and LM head, and packs
            copies of its projection weights. Build the engine before handing the model
            to PEFT (PEFT replaces the projections in place).
        max_loras: L, the GPU slots for adapters.
        max_lora_rank: the rank every slot is padded to.
        max_num_batched_tokens: the most tokens one step may hold (the prefill of a batch).
        max_batches: the most requests in a batch.
    """

    def __init__(
        self,
        model,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_num_batched_tokens: int = 4096,
        max_batches: int = 256,
    ):
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type != device_of().type:
            raise ValueError(f"the model must be on {device_of()}, got {self.device}")
        if self.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the model's dtype must be one of {KERNEL_DTYPES}, got {self.dtype}")
        self.model = model
        self.config = model.config
        self.max_batches = max_batches
        self.punica = PunicaWrapperNumba(
            max_num_batched_tokens, max_batches, self.device, max_loras=max_loras
        )
        specs = packed_layers(model)
        self.slots = LoRASlots(
            specs,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )
        self.layers = []  # per decoder layer: {"qkv": ..., "o": ..., "gate_up": ..., "down": ...}
        for i, decoder in enumerate(model.model.layers):
            attn, mlp = decoder.self_attn, decoder.mlp
            qkv, o, gate_up, down = specs[4 * i : 4 * i + 4]
            lora = dict(slots=self.slots, punica=self.punica)
            self.layers.append(
                {
                    "qkv": LoRALinear(qkv, [attn.q_proj, attn.k_proj, attn.v_proj], **lora),
                    "o": LoRALinear(o, [attn.o_proj], **lora),
                    "gate_up": LoRALinear(gate_up, [mlp.gate_proj, mlp.up_proj], **lora),
                    "down": LoRALinear(down, [mlp.down_proj], **lora),
                }
            )
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.num_heads = self.config.num_attention_heads
        self.num_kv_heads = self.config.num_key_value_heads

    # -- adapters ----------------------------------------------------------------------

    @property
    def lora_index_to_id(self) -> list[int | None]:
        """The adapter id in each GPU slot (None = free)."""
        return self.slots.lora_index_to_id

    def load_adapter(self, adapter_id: int, adapter: str | os.PathLike | PeftAdapter) -> int:
        """Load a PEFT adapter folder into a free slot under ``adapter_id``; return the slot."""
        return self.slots.load(adapter_id, adapter)

    def evict_adapter(self, adapter_id: int) -> int:
        """Free ``adapter_id``'s slot; return it."""
        return self.slots.evict(adapter_id)

    # -- generation --------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[Request],
        max_new_tokens: int,
        *,
        keep_logits: bool = False,
        progress: bool | None = False,
        on_step=None,
    ) -> list[Generation]:
        """Generate ``max_new_tokens`` greedy tokens for every request, all in one batch.

        One prefill step (every prompt), then ``max_new_tokens - 1`` decode steps (one
        token per request); ``update_metadata`` before each. ``progress`` shows a tqdm
        bar over the steps (None: only on a terminal). ``on_step(step_index)``, if given,
        is called after each step's metadata is prepared (the demo prints the prefill's
        segments from it).
        """
        from tqdm.auto import tqdm

        requests = list(requests)
        if not requests or len(requests) > self.max_batches:
            raise ValueError(f"need 1 to {self.max_batches} requests, got {len(requests)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, r in enumerate(requests):
            if r.adapter_id != 0 and r.adapter_id not in self.slots:
                raise ValueError(
                    f"request {i} asks for adapter id {r.adapter_id}, which is not loaded "
                    f"(slots: {self.lora_index_to_id})"
                )
        prompt_tokens = sum(len(r.prompt) for r in requests)
        if prompt_tokens > self.punica.max_num_batched_tokens:
            raise ValueError(
                f"the prompts hold {prompt_tokens} tokens, more than max_num_batched_tokens="
                f"{self.punica.max_num_batched_tokens} (one prefill step takes them all)"
            )
        longest = max(len(r.prompt) for r in requests) + max_new_tokens
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"a request would reach {longest} tokens, more than the model's "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        cache = self._empty_cache(len(requests), longest)
        ids = [r.adapter_id for r in requests]
        generated: list[list[int]] = [[] for _ in requests]
        kept: list[torch.Tensor] = []  # per step: [B, V] float32

        step = self._prefill_step(requests)
        bar = tqdm(
            total=max_new_tokens,
            desc="generating",
            unit="step",
            disable=None if progress is None else not progress,
        )
        for k in range(max_new_tokens):
            self.punica.update_metadata(
                LoRAMapping(
                    index_mapping=[i for i, n in zip(ids, step.lengths) for _ in range(n)],
                    prompt_mapping=ids,  # one sampled row per request
                    is_prefill=(k == 0),
                ),
                self.lora_index_to_id,
                self.slots.max_loras + 1,  # vLLM passes the slot count plus one
                self.config.vocab_size,
                0,  # no extra vocabulary: adapters here do not add tokens
            )
            if on_step is not None:
                with tqdm.external_write_mode():  # what it prints goes above the bar
                    on_step(k)
            logits = self._forward(step, cache)  # [B, V] float32
            next_tokens = logits.argmax(dim=-1)  # [B]
            if keep_logits:
                kept.append(logits)
            for b, t in enumerate(next_tokens.tolist()):
                generated[b].append(t)
            step = _Step(
                tokens=next_tokens,
                positions=torch.tensor(
                    [p + n for p, n in zip(step.past, step.lengths)], device=self.device
                ),
                starts=list(range(len(requests))),
                lengths=[1] * len(requests),
                past=[p + n for p, n in zip(step.past, step.lengths)],
            )
            bar.update(1)
        bar.close()
        stacked = torch.stack(kept, dim=1) if keep_logits else None  # [B, steps, V]
        return [
            Generation(tokens, None if stacked is None else stacked[b])
            for b, tokens in enumerate(generated)
        ]

    def _prefill_step(self, requests: Sequence[Request]) -> _Step:
        lengths = [len(r.prompt) for r in requests]
        starts = [sum(lengths[:b]) for b in range(len(requests))]
        tokens = [t for r in requests for t in r.prompt]  # [T]
        positions = [p for n in lengths for p in range(n)]  # [T]
        return _Step(
            tokens=torch.tensor(tokens, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            starts=starts,
            lengths=lengths,
            past=[0] * len(requests),
        )

    def _empty_cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.num_kv_heads, length, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),  # K: [B, kvh, S, d]
                torch.zeros(shape, dtype=self.dtype, device=self.device),  # V: [B, kvh, S, d]
            )
            for _ in self.layers
        ]

    # -- the forward pass --------------------------------------------------------------

    def _forward(self, step: _Step, cache) -> torch.Tensor:
        """One forward pass over the step's token rows; the logits of each request's last row."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        hf = self.model.model
        T = step.tokens.shape[0]
        h = hf.embed_tokens(step.tokens)  # [T, D]
        cos, sin = hf.rotary_emb(h, step.positions[None])  # [1, T, d] each
        for decoder, lora, (cache_k, cache_v) in zip(hf.layers, self.layers, cache):
            x = decoder.input_layernorm(h)  # [T, D]
            q, k, v = lora["qkv"](x).split(
                [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2], dim=-1
            )
            q = q.view(T, self.num_heads, self.head_dim)  # [T, nh, d]
            k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
            v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
            q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
            attn = self._attention(q, k, v, cache_k, cache_v, step)  # [T, nh * d]
            h = h + lora["o"](attn)
            x = decoder.post_attention_layernorm(h)  # [T, D]
            gate, up = lora["gate_up"](x).chunk(2, dim=-1)  # [T, I] each
            h = h + lora["down"](decoder.mlp.act_fn(gate) * up)
        last = [s + n - 1 for s, n in zip(step.starts, step.lengths)]  # each request's last row
        hidden = hf.norm(h[last])  # [B, D]
        return self.model.lm_head(hidden).float()  # [B, V]

    def _attention(self, q, k, v, cache_k, cache_v, step: _Step) -> torch.Tensor:
        """Causal attention of each request over its own cached tokens; writes the cache.

        q: [T, nh, d]; k, v: [T, kvh, d]; cache_k, cache_v: [B, kvh, S_max, d].
        Returns [T, nh * d].
        """
        repeat = self.num_heads // self.num_kv_heads  # query heads per KV head (GQA)
        T = q.shape[0]
        if step.decode:  # one token per request, row b = request b: one batched call
            batch = torch.arange(T, device=q.device)
            pos = step.positions  # [B]
            cache_k[batch, :, pos] = k
            cache_v[batch, :, pos] = v
            length = max(step.past) + 1
            keys = cache_k[:, :, :length].repeat_interleave(repeat, dim=1)  # [B, nh, S, d]
            values = cache_v[:, :, :length].repeat_interleave(repeat, dim=1)  # [B, nh, S, d]
            visible = torch.arange(length, device=q.device) <= pos[:, None]  # [B, S]
            out = F.scaled_dot_product_attention(
                q[:, :, None], keys, values, attn_mask=visible[:, None, None]
            )  # [B, nh, 1, d]
            return out.reshape(T, -1)
        out = torch.empty_like(q)  # [T, nh, d]
        for b, (start, n, past) in enumerate(zip(step.starts, step.lengths, step.past)):
            rows = slice(start, start + n)
            cache_k[b, :, past : past + n] = k[rows].transpose(0, 1)
            cache_v[b, :, past : past + n] = v[rows].transpose(0, 1)
            keys = cache_k[b, :, : past + n].repeat_interleave(repeat, dim=0)  # [nh, S, d]
            values = cache_v[b, :, : past + n].repeat_interleave(repeat, dim=0)  # [nh, S, d]
            query_pos = past + torch.arange(n, device=q.device)  # [n]
            visible = torch.arange(past + n, device=q.device) <= query_pos[:, None]  # [n, S]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys, values, attn_mask=visible
            ).transpose(0, 1)  # [n, nh, d]
        return out.reshape(T, -1)
