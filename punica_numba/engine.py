"""A small multi-tenant serving loop: one Llama model, many LoRA adapters, one batch.

This is the smallest serving engine in which the wrapper does its real job. A batch
of requests, each naming an adapter id (``0`` for none), is generated together:

* **One token row per token, one wrapper call per LoRA layer.** A forward pass's
  tokens are rows of one ``[T, hidden]`` tensor (vLLM's layout). The projections of
  each decoder layer are packed as vLLM packs them: q/k/v as one layer of 3 slices (k
  and v narrower under grouped-query attention), o alone, gate/up as one layer of 2
  slices, down alone. Each runs the base GEMM, then one
  :meth:`~punica_numba.PunicaWrapperNumba.add_lora_linear` call that adds every
  token's own adapter: the kernels see the whole batch.
* **A preallocated KV cache** (:class:`~punica_numba.kv_cache.KVCache`): one
  contiguous row of positions per request slot and layer, allocated once for
  ``max_batches`` requests of ``max_seq_len`` positions. Request ``b`` of a batch
  owns slot ``b``; no request ever reads another's slot.
* **Prefill: every prompt in one pass.** The prompts are concatenated, without
  padding, into one forward pass; attention runs over all of them at once under a
  block-diagonal causal mask (a token sees the earlier tokens of its own prompt
  only), and the keys and values go to each request's slot. Each request's last row
  gives its first new token.
* **Decode: one forward pass of the whole batch per step.** Row ``b`` is request
  ``b``'s newest token; attention is one batched call over the cache, each row
  masked to its own positions. Sampling (greedy: argmax) and feeding the tokens back
  stay on the device: the step writes its tokens into the next step's input and into
  a ``[batch, steps]`` table the host reads once, at the end.
* **Metadata once per phase.** ``update_metadata`` runs once for the prefill's
  mapping and once for the decode steps' (one token per request: the same mapping at
  every step), not once per step.
* **CUDA graphs** (on a GPU; ``use_cuda_graphs``). A batch runs in the smallest
  *bucket* of rows that holds it (:data:`BATCH_BUCKETS`, up to ``max_batches``): rows
  past its requests are padding, with no adapter, in cache slots no request of the
  batch owns. The decode step of each (bucket, number of distinct adapters) is run
  eagerly once (its first step: the wrapper's warm-up), then captured into a graph
  that every later step replays; ``update_metadata`` stays outside the graph. The
  adapters' count is in the key because the kernels' launch configuration is chosen
  from it (tokens per adapter) when the graph is captured, and because a batch with
  no adapter launches no LoRA kernel at all (its graph is the base model's). In the
  graph each LoRA layer's shrink runs on a second stream beside its base GEMM (both
  read only the layer's input), and the expand joins them
  (:meth:`LoRALinear._beside_the_gemm`); the eager first step takes the same path, so
  that it compiles every kernel the capture launches. On the simulator there are no
  graphs: the same step runs eagerly.
* **Requests that finish early stay in the batch, masked.** With a ``stop_token``, a
  request is finished once it has generated it; it keeps its row (the batch, and so
  the graph, keeps its shape) and what it computes after is dropped. The host checks
  every :data:`STOP_CHECK_EVERY` steps whether every request has finished (one sync),
  and stops the batch then.

The rest of the forward pass (embedding, RMSNorm, SiLU, LM head) reuses the Hugging
Face model's modules; rotary embeddings come from a table made once by the model's
own rotary module; so the engine computes what ``LlamaForCausalLM`` computes. The
model is built locally from a ``LlamaConfig`` with random weights
(:func:`tiny_llama`); nothing is downloaded.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._cuda import KERNEL_DTYPES, SIMULATOR, device_of
from .kv_cache import KVCache
from .mapping import LoRAMapping
from .peft import LoRASlots, PackedLinear, PeftAdapter
from .wrapper import PunicaWrapperNumba

__all__ = [
    "BATCH_BUCKETS",
    "Generation",
    "LoRALinear",
    "MultiLoRAEngine",
    "Request",
    "packed_layers",
    "tiny_llama",
]

#: The row counts a decode step runs at (capped at ``max_batches``, which is a bucket
#: too): a batch takes the smallest that holds it, so a handful of CUDA graphs serve
#: every batch size. Powers of two waste at most half a step's rows on padding.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

#: With a ``stop_token``, the host reads whether every request has finished once per
#: this many decode steps (each read waits for the device); between reads the steps
#: are queued without a sync, and finished requests compute a few masked steps more.
STOP_CHECK_EVERY = 8

#: Captured decode graphs kept at most (the least recently used one is dropped first).
MAX_GRAPHS = 16

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
        side_stream=None,
    ):
        super().__init__()
        self.spec, self.slots, self.punica = spec, slots, punica
        #: A ``torch.cuda.Stream`` for the shrink beside the base GEMM in a graph's step.
        self.side_stream = side_stream
        #: Whether calls take :meth:`_beside_the_gemm` (the engine sets it for a decode
        #: step it captures, and for that step's eager warm-up before).
        self.beside = False
        # One GEMM for all slices, as vLLM's packed layers do (a copy of the weights).
        self.weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum N_s, H]
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.beside and self.side_stream is not None:
            return self._beside_the_gemm(x)
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

    def _beside_the_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in a graph's decode step (and in its eager warm-up): the LoRA
        shrink on ``side_stream`` while the base GEMM runs, then the expand into y.

        The shrink and the GEMM read only x, so the graph holds them as two branches that
        the GPU runs at once, and the expand, which adds into y, joins them. At a decode
        step's few rows each kernel alone leaves most of the GPU's memory bandwidth
        unused (docs/demo/h200_profile.txt), so they may share it. On the H200 at
        84119e4 the demo's decode step took 0.777 and 0.785 ms so, 0.796 and 0.858 ms
        one after the other (docs/demo.md). The same sums as :meth:`forward`'s: the
        shrink adds into zeros what the wrapper's own call stores. Storing instead
        (``add_shrink(..., add_inputs=False)``, no fill: one launch fewer per layer on the
        side stream) measured no faster in the demo on the H200: 0.781 and 0.784 ms a
        decode step at e444f71 and 6309d5c against 0.757 and 0.755 at 7704909 and 0c14391
        (separate runs, whose steps without adapters also went from 0.587 to 0.604 ms).
        """
        name = self.spec.name
        lora_a = self.slots.lora_a[name]
        main, side = torch.cuda.current_stream(), self.side_stream
        # Allocated on the main stream, which waits for the side stream before the
        # expand: nothing reuses the memory before the expand has read it.
        shape = (len(lora_a), x.shape[0], lora_a[0].shape[-2])  # [S, T, r]
        buffer = torch.empty(shape, dtype=torch.float32, device=x.device)
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            buffer.zero_()
            self.punica.add_shrink(buffer, x, lora_a, 1.0)
        y = F.linear(x, self.weight, self.bias)  # [T, sum N_s]
        main.wait_stream(side)
        self.punica.add_expand(y, buffer, self.slots.lora_b[name], self.spec.output_slices)
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
class _Rows:
    """One forward pass's token rows and what attention needs to know of them.

    Attributes:
        tokens: ``[T]`` int64 token ids.
        positions: ``[T]`` int64, each token's position in its request.
        slots: ``[T]`` int64, each token's KV-cache slot (its request's index).
        bias: the additive attention mask: ``[T, T]`` over the pass's own tokens
            (prefill), or ``[T, 1, 1, max_len]`` over each row's cache slot (decode).
        decode: whether row ``b`` is request ``b``'s one new token (attention reads
            the cache) rather than a prefill (attention over the pass's tokens).
        sample: ``[B]`` int64, the rows whose logits are returned (each request's
            last), or None for every row.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    bias: torch.Tensor
    decode: bool
    sample: torch.Tensor | None = None


class _DecodeState:
    """The fixed tensors a bucket's decode steps read and write (a graph's inputs and outputs).

    Attributes (``R`` rows, the bucket; ``N`` = the cache's ``max_len``):
        tokens: ``[R]`` int64, each row's newest token (the step's input).
        positions: ``[R]`` int64, that token's position.
        slots: ``[R]`` int64, ``arange(R)``: row ``b`` is cache slot ``b``.
        out: ``[R, N]`` int64, the tokens generated so far (column k = new token k).
        step: ``[1]`` int64, the column the next step writes.
        stop: ``[1]`` int64, the stop token (-1: none).
        done: ``[R]`` bool, whether a row has generated the stop token.
    """

    def __init__(self, rows: int, max_len: int, device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        self.rows = rows
        self.tokens = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slots = torch.arange(rows, **i64)
        self.out = torch.zeros(rows, max_len, **i64)
        self.step = torch.zeros(1, **i64)
        self.stop = torch.full((1,), -1, **i64)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)

    def begin(self, first: torch.Tensor, lengths: torch.Tensor, stop_token: int | None) -> None:
        """Start a batch: its B requests' first new tokens (from the prefill) and prompt
        lengths (where their next tokens sit); rows past B are padding at position 0."""
        batch = first.shape[0]
        self.tokens.zero_()
        self.tokens[:batch] = first
        self.positions.zero_()
        self.positions[:batch] = lengths
        self.out.zero_()
        self.out[:batch, 0] = first
        self.step.fill_(1)
        self.stop.fill_(-1 if stop_token is None else stop_token)
        torch.eq(self.tokens, self.stop, out=self.done)
        self.done[batch:] = False

    def feed_back(self, next_tokens: torch.Tensor) -> None:
        """After a step: its tokens become the next step's input, one position on.

        Semantics:
            out[b, step] = next[b];  done[b] |= next[b] == stop
            tokens = next;  positions += 1;  step += 1
        All on the device, in place (capturable); no sync.
        """
        self.out.scatter_(1, self.step.expand(self.rows, 1), next_tokens[:, None])
        self.done |= next_tokens == self.stop
        self.tokens.copy_(next_tokens)
        self.positions += 1
        self.step += 1


@dataclass
class _Graph:
    """A captured decode step and its output: the ``[R, V]`` float32 logits it writes."""

    graph: object  # torch.cuda.CUDAGraph
    logits: torch.Tensor


class MultiLoRAEngine:
    """Serve a batch of requests, each with its own LoRA adapter, on one Llama model.

    Args:
        model: a ``LlamaForCausalLM`` on the kernels' device (:func:`tiny_llama`); the
            engine reuses its embedding, norms, rotary embedding and LM head, and packs
            copies of its projection weights. Build the engine before handing the model
            to PEFT (PEFT replaces the projections in place).
        max_loras: L, the GPU slots for adapters.
        max_lora_rank: the rank every slot is padded to.
        max_num_batched_tokens: the most tokens one prefill may hold (all prompts).
        max_batches: the most requests in a batch (the KV cache's slots, the largest
            bucket).
        max_seq_len: the most positions a request may reach, prompt and new tokens
            (the KV cache's length; default: the model's ``max_position_embeddings``).
        use_cuda_graphs: replay each decode step from a CUDA graph (default: on a GPU;
            never on the simulator). An attribute; it may be switched between calls.

    Memory: the KV cache holds ``2 * layers * max_batches * kv_heads * max_seq_len *
    head_dim`` elements of the model's dtype (:attr:`kv_cache`).
    """

    def __init__(
        self,
        model,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_num_batched_tokens: int = 4096,
        max_batches: int = 256,
        max_seq_len: int | None = None,
        use_cuda_graphs: bool | None = None,
    ):
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type != device_of().type:
            raise ValueError(f"the model must be on {device_of()}, got {self.device}")
        if self.dtype not in KERNEL_DTYPES:
            raise TypeError(f"the model's dtype must be one of {KERNEL_DTYPES}, got {self.dtype}")
        for name, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_batches", max_batches),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.model = model
        self.config = model.config
        positions = self.config.max_position_embeddings
        max_seq_len = positions if max_seq_len is None else max_seq_len
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
            raise ValueError(f"max_seq_len must be an int, got {max_seq_len!r}")
        if not 1 <= max_seq_len <= positions:
            raise ValueError(
                f"max_seq_len must lie in [1, max_position_embeddings={positions}], "
                f"got {max_seq_len}"
            )
        if use_cuda_graphs and SIMULATOR:
            raise ValueError("use_cuda_graphs=True needs a GPU; the simulator has no CUDA graphs")
        self.use_cuda_graphs = (not SIMULATOR) if use_cuda_graphs is None else use_cuda_graphs
        self.max_batches, self.max_seq_len = max_batches, max_seq_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batches) + (max_batches,)
        # The stream a captured decode step runs each LoRA shrink on, beside the base
        # GEMM (LoRALinear._beside_the_gemm); None: one stream (the simulator).
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The wrapper's rows: a prefill's tokens, or a decode step's bucket.
        self.punica = PunicaWrapperNumba(
            max(max_num_batched_tokens, max_batches), max_batches, self.device, max_loras=max_loras
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
            lora = dict(slots=self.slots, punica=self.punica, side_stream=self._side_stream)
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
        self.kv_cache = KVCache(
            len(self.layers),
            max_batches,
            self.num_kv_heads,
            self.head_dim,
            max_seq_len,
            dtype=self.dtype,
            device=self.device,
        )
        self._cos, self._sin = self._rotary_tables(max_seq_len)  # [S, d] each
        self._states: dict[int, _DecodeState] = {}  # bucket -> its tensors
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()

    def _rotary_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin``: ``[length, head_dim]`` in the model's dtype, position p in row p,
        from the model's own rotary module (each position's values depend on it alone)."""
        positions = torch.arange(length, device=self.device)[None]  # [1, S]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions)  # [1, S, d] each
        return cos[0].contiguous(), sin[0].contiguous()

    # -- adapters ----------------------------------------------------------------------

    @property
    def lora_index_to_id(self) -> list[int | None]:
        """The adapter id in each GPU slot (None = free)."""
        return self.slots.lora_index_to_id

    def load_adapter(self, adapter_id: int, adapter: str | os.PathLike | PeftAdapter) -> int:
        """Load a PEFT adapter folder into a free slot under ``adapter_id``; return the slot.

        Captured graphs stay valid: a slot's weights are overwritten in place.
        """
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
        on_step: Callable[[int], None] | None = None,
        stop_token: int | None = None,
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` greedy tokens for every request, all in one batch.

        One prefill (every prompt, one pass; it gives each request's first new token),
        then up to ``max_new_tokens - 1`` decode steps, each one forward pass of the
        whole batch (a CUDA-graph replay where graphs are on). ``stop_token``: a
        request ends with the first one it generates (that token included), and the
        batch ends once every request has ended (checked every
        :data:`STOP_CHECK_EVERY` steps). ``keep_logits`` keeps each new token's
        logits (one copy per step). ``progress`` shows a tqdm bar over the steps
        (None: only on a terminal). ``on_step(k)``, if given, is called at the start
        of step k, once its metadata is prepared (step 0 is the prefill: the demo
        prints its segments from it).

        Raises:
            ValueError: no requests or more than ``max_batches``; ``max_new_tokens <
                1``; an adapter id that is not loaded; a token id outside the
                vocabulary; prompts of more than ``max_num_batched_tokens`` tokens; a
                request that would pass ``max_seq_len`` positions. Nothing runs then.
        """
        from tqdm.auto import tqdm

        requests = list(requests)
        self._check(requests, max_new_tokens, stop_token)
        ids = [r.adapter_id for r in requests]
        state = self._state(self._bucket(len(requests)))
        kept: list[torch.Tensor] = []  # per step: [B, V] float32
        bar = tqdm(
            total=max_new_tokens,
            desc="generating",
            unit="step",
            disable=None if progress is None else not progress,
        )

        self._prepare(ids, [len(r.prompt) for r in requests], prefill=True)
        if on_step is not None:
            with tqdm.external_write_mode():  # what it prints goes above the bar
                on_step(0)
        steps = self._prefill(requests, state, stop_token, kept if keep_logits else None)
        bar.update(1)
        if max_new_tokens > 1:
            self._prepare(ids, [1] * len(requests), prefill=False)
            key = (state.rows, len({i for i in ids if i}))  # (bucket, distinct adapters)
            for k in range(1, max_new_tokens):
                if on_step is not None:
                    on_step(k)
                logits = self._decode(state, key)  # [R, V] float32
                steps += 1
                if keep_logits:
                    kept.append(logits[: len(requests)].clone())
                bar.update(1)
                if stop_token is not None and k % STOP_CHECK_EVERY == 0:
                    if bool(state.done[: len(requests)].all()):  # (a sync)
                        break
        bar.close()
        return self._generations(state, len(requests), steps, kept, stop_token)

    def _check(self, requests: list[Request], max_new_tokens: int, stop_token) -> None:
        """Reject a call this engine cannot serve, before anything runs."""
        if not requests or len(requests) > self.max_batches:
            raise ValueError(f"need 1 to {self.max_batches} requests, got {len(requests)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.config.vocab_size
        if stop_token is not None and (
            isinstance(stop_token, bool)
            or not isinstance(stop_token, int)
            or not 0 <= stop_token < vocab
        ):
            raise ValueError(
                f"stop_token must be None or a token id in [0, {vocab}), got {stop_token!r}"
            )
        for i, r in enumerate(requests):
            if not isinstance(r, Request):
                raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
            if r.adapter_id != 0 and r.adapter_id not in self.slots:
                raise ValueError(
                    f"request {i} asks for adapter id {r.adapter_id}, which is not loaded "
                    f"(slots: {self.lora_index_to_id})"
                )
            low, high = min(r.prompt), max(r.prompt)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise ValueError(
                    f"request {i}'s prompt holds token {bad}, outside the vocabulary [0, {vocab})"
                )
        prompt_tokens = sum(len(r.prompt) for r in requests)
        if prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"the prompts hold {prompt_tokens} tokens, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens} (one prefill takes them all)"
            )
        longest = max(len(r.prompt) for r in requests) + max_new_tokens
        if longest > self.max_seq_len:
            limit = self.config.max_position_embeddings
            what = (
                f"the model's max_position_embeddings={limit}"
                if self.max_seq_len == limit
                else f"max_seq_len={self.max_seq_len}"
            )
            raise ValueError(f"a request would reach {longest} tokens, more than {what}")

    def _bucket(self, batch: int) -> int:
        """The smallest bucket that holds ``batch`` rows."""
        return next(b for b in self.buckets if b >= batch)

    def _state(self, bucket: int) -> _DecodeState:
        state = self._states.get(bucket)
        if state is None:
            state = self._states[bucket] = _DecodeState(bucket, self.max_seq_len, self.device)
        return state

    def _prepare(self, ids: list[int], lengths: list[int], *, prefill: bool) -> None:
        """``update_metadata`` for a pass whose request b holds ``lengths[b]`` token rows."""
        self.punica.update_metadata(
            LoRAMapping(
                index_mapping=[i for i, n in zip(ids, lengths) for _ in range(n)],
                prompt_mapping=ids,  # one sampled row per request
                is_prefill=prefill,
            ),
            self.lora_index_to_id,
            self.slots.max_loras + 1,  # vLLM passes the slot count plus one
            self.config.vocab_size,
            0,  # no extra vocabulary: adapters here do not add tokens
        )

    # -- prefill -----------------------------------------------------------------------

    def _prefill(self, requests, state: _DecodeState, stop_token, kept) -> int:
        """Run every prompt in one pass; start ``state`` from its tokens; return 1 (steps)."""
        rows = self._prefill_rows(requests)
        logits = self._forward(rows)  # [B, V] float32
        first = self._sample(logits)  # [B]
        lengths = torch.tensor([len(r.prompt) for r in requests], device=self.device)
        state.begin(first, lengths, stop_token)
        if kept is not None:
            kept.append(logits)
        return 1

    def _prefill_rows(self, requests: Sequence[Request]) -> _Rows:
        """The prompts, concatenated: request b's tokens at positions 0 .. n_b - 1 of slot b,
        under a block-diagonal causal mask, each request's last row sampled."""
        lengths = [len(r.prompt) for r in requests]
        device = self.device
        tokens = torch.tensor([t for r in requests for t in r.prompt], device=device)  # [T]
        positions = torch.tensor([p for n in lengths for p in range(n)], device=device)  # [T]
        slots = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], device=device)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1  # [B]
        same = slots[:, None] == slots[None, :]  # [T, T]: the same request
        causal = positions[None, :] <= positions[:, None]  # [T, T]: not later
        zero = torch.zeros((), dtype=self.dtype, device=device)
        bias = torch.where(same & causal, zero, float("-inf"))  # [T, T]
        return _Rows(tokens, positions, slots, bias, decode=False, sample=last)

    # -- decode ------------------------------------------------------------------------

    def _decode(self, state: _DecodeState, key: tuple[int, int]) -> torch.Tensor:
        """One decode step of the bucket's rows: eager, or the replay of its graph (captured
        after its first, eager, step). Returns the ``[R, V]`` float32 logits."""
        if not self.use_cuda_graphs:
            return self._decode_step(state)
        graph = self._graphs.get(key)
        if graph is None:
            # The warm-up takes the capture's path, so that it compiles every kernel the
            # capture launches (the shrink that adds into a zeroed buffer, not the one
            # that stores): a first launch, which compiles, must not happen in a capture.
            with self._beside_the_gemms():
                logits = self._decode_step(state)  # the warm-up, and this step's result
                self._graphs[key] = self._capture(state)
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
            return logits
        self._graphs.move_to_end(key)
        graph.graph.replay()
        return graph.logits

    @contextmanager
    def _beside_the_gemms(self):
        """Within: every LoRA layer runs its shrink beside its base GEMM
        (:meth:`LoRALinear._beside_the_gemm`)."""
        layers = [layer for per_decoder in self.layers for layer in per_decoder.values()]
        for layer in layers:
            layer.beside = True
        try:
            yield
        finally:
            for layer in layers:
                layer.beside = False

    def _capture(self, state: _DecodeState) -> _Graph:
        """Capture one decode step on ``state``'s tensors (nothing runs; replays will)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode_step(state)
        return _Graph(graph, logits)

    def _decode_step(self, state: _DecodeState) -> torch.Tensor:
        """One decode step, all on the device: forward, argmax, tokens fed back.

        Semantics (R rows, the bucket):
            logits = forward(tokens at positions, over each row's cache slot)  [R, V] f32
            next = argmax(logits);  state.feed_back(next)
        """
        rows = _Rows(
            state.tokens,
            state.positions,
            state.slots,
            self.kv_cache.decode_bias(state.positions),  # [R, 1, 1, S]
            decode=True,
        )
        logits = self._forward(rows)  # [R, V] float32
        self._feed_back(state, self._sample(logits))
        return logits

    @staticmethod
    def _feed_back(state: _DecodeState, next_tokens: torch.Tensor) -> None:
        """``state.feed_back(next_tokens)`` (a method of its own, so a profile can time it)."""
        state.feed_back(next_tokens)

    def _generations(self, state, batch: int, steps: int, kept, stop_token) -> list[Generation]:
        """Read the tokens back (one sync) and cut each request at its stop token."""
        table = state.out[:batch, :steps].tolist()
        logits = torch.stack(kept, dim=1) if kept else None  # [B, steps, V]
        out = []
        for b, tokens in enumerate(table):
            if stop_token is not None and stop_token in tokens:
                tokens = tokens[: tokens.index(stop_token) + 1]
            rows = None if logits is None else logits[b, : len(tokens)]
            out.append(Generation(tokens, rows))
        return out

    # -- the forward pass --------------------------------------------------------------

    def _forward(self, rows: _Rows) -> torch.Tensor:
        """One forward pass over the rows; the float32 logits of the sampled rows.

        Semantics:
            h = embed(tokens)                                          [T, D]
            per layer: h += o(attention(rope(q, k), v)); h += down(silu(gate) * up)
            logits = lm_head(norm(h[sample]))                          [B or T, V] f32
        Writes each row's key and value into its cache slot at its position.
        """
        hf = self.model.model
        T = rows.tokens.shape[0]
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        h = hf.embed_tokens(rows.tokens)  # [T, D]
        cos, sin = self._cos[rows.positions], self._sin[rows.positions]  # [T, d] each
        for i, (decoder, lora) in enumerate(zip(hf.layers, self.layers)):
            x = decoder.input_layernorm(h)  # [T, D]
            qkv = lora["qkv"](x)  # [T, (nh + 2 kvh) d]
            qk = self._rotary(qkv[:, : (nh + kvh) * d].view(T, nh + kvh, d), cos, sin)
            q, k = qk.split([nh, kvh], dim=1)  # [T, nh, d], [T, kvh, d]
            v = qkv[:, (nh + kvh) * d :].view(T, kvh, d)  # [T, kvh, d]
            h = h + lora["o"](self._attention(i, q, k, v, rows))
            x = decoder.post_attention_layernorm(h)  # [T, D]
            gate, up = lora["gate_up"](x).chunk(2, dim=-1)  # [T, I] each
            h = h + lora["down"](decoder.mlp.act_fn(gate) * up)
        if rows.sample is not None:
            h = h[rows.sample]  # [B, D]
        return self.model.lm_head(hf.norm(h)).float()  # [B or T, V]

    @staticmethod
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of queries and keys together (the same ops as the model's).

        Semantics:
            x: [T, heads, d]; cos, sin: [T, d]
            out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])
        """
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, d]
        return (x * cos[:, None]) + (rotated * sin[:, None])

    def _attention(self, layer: int, q, k, v, rows: _Rows) -> torch.Tensor:
        """Attention of each row over its own request's tokens; writes the cache first.

        q: [T, nh, d]; k, v: [T, kvh, d]. Returns [T, nh * d], contiguous.

        Decode (row b = request b): one call over the cache's slots ``0 .. T-1``; each
        KV head's query heads are the rows of one query block (no key is repeated).
        Prefill: one call over the pass's own keys under its block-diagonal causal mask.
        """
        self.kv_cache.write(layer, rows.slots, rows.positions, k, v)
        T, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
        repeat = self.num_heads // kvh  # query heads per KV head (GQA)
        if rows.decode:
            out = F.scaled_dot_product_attention(
                q.reshape(T, kvh, repeat, d),  # query head g * repeat + j reads KV head g
                self.kv_cache.keys(layer, T),  # [T, kvh, S, d]
                self.kv_cache.values(layer, T),
                attn_mask=rows.bias,  # [T, 1, 1, S]
            )  # [T, kvh, repeat, d]
            return out.reshape(T, -1).contiguous()
        keys = k.transpose(0, 1).repeat_interleave(repeat, dim=0)  # [nh, T, d]
        values = v.transpose(0, 1).repeat_interleave(repeat, dim=0)  # [nh, T, d]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=rows.bias
        )  # [1, nh, T, d]
        return out[0].transpose(0, 1).reshape(T, -1).contiguous()

    @staticmethod
    def _sample(logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: ``[R, V]`` -> ``[R]`` int64, each row's argmax (on the device)."""
        return logits.argmax(dim=-1)
