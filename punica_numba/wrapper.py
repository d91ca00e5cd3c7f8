"""``PunicaWrapperNumba``: vLLM's ``PunicaWrapperGPU`` API on the Numba kernels.

A serving engine calls ``update_metadata`` once per step, with the step's
``LoRAMapping``; then every LoRA layer of the model calls one ``add_*`` method.
The wrapper keeps the index buffers in fixed-size, preallocated tensors (so CUDA
graphs can capture the layers), turns the mapping into slots and segments, and
launches shrink and expand.

Differences from vLLM v0.8–0.9 (../shared/SPEC.md §7), each on purpose:

* ``add_expand`` honours ``add_inputs`` (vLLM always adds).
* The bias honours ``offset_start`` and is added only to rows of its own slot.
* Every buffer is initialised, and the part past the current batch is reset each
  step (slots -1, offsets 0), so nothing stale or uninitialised is ever read.
* The prompt (sampler) metadata holds up to ``max_num_batched_tokens`` rows, so
  more sampled rows than requests (prompt logprobs, speculative decoding) fit.
* Every method checks its arguments before it launches anything; a rejected call
  changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ._checks import (
    Stack,
    check_bool,
    check_device,
    check_int,
    check_kernel_tensor,
    check_real,
    check_sequence,
    check_stack,
    is_int,
    is_real,
)
from ._cuda import LaunchRecord, eager_stream
from .launch import forced_launch_configs
from .mapping import LongContextLoRAContext, LoRAMapping, convert_mapping
from .meta import LoRAKernelMeta, host_facts_of
from .moe_meta import align_pairs
from .ops.launching import expand_launch, shrink_launch
from .ops.moe import fused_moe_lora
from .staging import HostStaging, separate_twins, twin_of

__all__ = ["PunicaWrapperNumba"]


class PunicaWrapperNumba:
    """Multi-LoRA state and launches for one model, with the API of vLLM's ``PunicaWrapperGPU``.

    Args:
        max_num_batched_tokens: the most tokens (and sampled rows) one step may hold.
        max_batches: the most sequences in a step (kept for vLLM compatibility).
        device: where the index buffers live; the kernels' device (``cuda``, or
            ``cpu`` on the simulator).
        max_loras: L, the number of GPU LoRA slots.

    CUDA graphs: call ``update_metadata`` and each ``add_*`` method once outside
    capture (this compiles the kernels and fixes the launch shapes; a kernel launched
    for the first time inside a capture raises ``FirstLaunchInCaptureError``), and capture
    with a mapping in which at least one token has a LoRA (a batch without any is
    skipped on the host, so nothing would be recorded). After capture, call
    ``update_metadata`` outside the graph with any mapping of the same or fewer
    tokens, write the new inputs into the captured tensors in place, and replay.
    ``update_metadata`` itself is host work and copies; it is not captured.
    """

    def __init__(
        self,
        max_num_batched_tokens: int,
        max_batches: int,
        device: torch.device | str,
        *,
        max_loras: int,
        **kwargs,
    ):
        self.max_num_batched_tokens = check_int(
            "max_num_batched_tokens", max_num_batched_tokens, minimum=1
        )
        self.max_batches = check_int("max_batches", max_batches, minimum=1)
        self._max_loras = check_int("max_loras", max_loras, minimum=1)
        self.device = check_device("device", device)
        n = self.max_num_batched_tokens
        i64 = dict(dtype=torch.int64, device=self.device)
        # The index buffers of vLLM's base class, initialised rather than empty.
        self._token_lora_indices = torch.full((n,), -1, **i64)  # [N] slot per token
        self._sampler_indices = torch.full((n,), -1, **i64)  # [N] slot per sampled row
        self._sampler_indices_padded = torch.zeros(n, **i64)  # [N]
        self._embeddings_indices = torch.zeros(2, n, **i64)  # [2, N]
        self._long_lora_indices = torch.zeros(n, **i64)  # [N]
        self.indices_len: list[int | None] = [0, 0, 0, 0, None]
        self.is_prefill = False
        # update_metadata makes everything on the host and sends it (module staging).
        twins = separate_twins(self.device)
        self._index_staging = HostStaging(
            [(b, twin_of(b) if twins else b) for b in self._index_buffers()]
        )
        self.token_mapping_meta = LoRAKernelMeta.make(
            self._max_loras, n, self.device, host_twin=twins
        )
        self.prompt_mapping_meta = LoRAKernelMeta.make(
            self._max_loras, n, self.device, host_twin=twins
        )
        # The device every tensor of a layer call must be on, exactly as the buffers have it
        # (``cuda:0`` where ``device`` may say ``cuda``).
        self._kernel_device = self._token_lora_indices.device
        self._meta_args_made: dict[tuple, tuple] = {}  # see _meta_views

    # -- metadata ----------------------------------------------------------------------

    @property
    def max_loras(self) -> int:
        """L, the number of GPU LoRA slots."""
        return self._max_loras

    def update_metadata(
        self,
        mapping: LoRAMapping,
        lora_index_to_id: Sequence[int | None],
        max_loras: int,
        vocab_size: int,
        extra_vocab_size: int,
        long_lora_context: LongContextLoRAContext | None = None,
        **kwargs,
    ) -> None:
        """Take one step's mapping: slots, sampler and embedding indices, and segments.

        Semantics:
            indices = convert_mapping(mapping, lora_index_to_id, max_loras, ...)
            each index buffer[:n] = its indices; the rest reset (-1 slots, 0 offsets)
            token_mapping_meta.prepare_tensors(token_lora_indices)
            prompt_mapping_meta.prepare_tensors(sampler_indices)

        ``max_loras`` is the value vLLM's model manager passes (the number of slots
        plus one); it only decides where ``sampler_indices_padded`` sends rows
        without a LoRA.

        Everything is computed on the host, from the mapping's lists, into host twins
        of the buffers, which are then sent with one asynchronous copy each on the
        current stream (:mod:`punica_numba.staging`): no kernel and no device sync (it
        waits only, if they are still running, for the copies of its previous call).
        Work queued before the call still reads the old metadata, work queued after it
        the new. Call it outside CUDA-graph capture.

        Raises:
            ValueError: more tokens or sampled rows than ``max_num_batched_tokens``,
                an adapter id not in ``lora_index_to_id``, or a slot >= ``max_loras``
                of the constructor. Nothing is changed then.
        """
        if not isinstance(mapping, LoRAMapping):
            raise TypeError(f"mapping must be a LoRAMapping, got {type(mapping).__name__}")
        for name, rows in (
            ("index_mapping", mapping.index_mapping),
            ("prompt_mapping", mapping.prompt_mapping),
        ):
            if len(rows) > self.max_num_batched_tokens:
                raise ValueError(
                    f"mapping.{name} holds {len(rows)} entries, more than "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}"
                )
        # All of it on the host, from the mapping's lists: no kernel, no device sync.
        indices = convert_mapping(
            mapping,
            lora_index_to_id,
            max_loras,
            vocab_size,
            extra_vocab_size,
            "cpu",
            long_lora_context,
        )
        for name, slots in (
            ("index_mapping", indices.base_indices),
            ("prompt_mapping", indices.sampler_indices),
        ):
            if slots.numel() and int(slots.max()) >= self._max_loras:
                raise ValueError(
                    f"mapping.{name} uses slot {int(slots.max())}, but this wrapper has "
                    f"max_loras={self._max_loras} slots (lora_index_to_id is longer than that)"
                )

        self.is_prefill = mapping.is_prefill
        long_lora = indices.long_lora_indices
        if long_lora is None:
            long_lora = torch.zeros(0, dtype=torch.int64)
        staging = self._index_staging
        staging.wait()  # (the twins' last copies are done)
        for buffer, values, rest in zip(
            self._index_buffers(),
            (
                indices.base_indices,
                indices.sampler_indices,
                indices.sampler_indices_padded,
                indices.embeddings_indices,
                long_lora,
            ),
            (-1, -1, 0, 0, 0),
        ):
            _fill_front(staging.host(buffer), values, rest)
        staging.send()
        self.indices_len = list(indices.indices_len)
        self.token_mapping_meta.prepare_slots(indices.base_indices)
        self.prompt_mapping_meta.prepare_slots(indices.sampler_indices)

    def _index_buffers(self) -> tuple[torch.Tensor, ...]:
        """vLLM's index buffers, in the order update_metadata fills them."""
        return (
            self._token_lora_indices,
            self._sampler_indices,
            self._sampler_indices_padded,
            self._embeddings_indices,
            self._long_lora_indices,
        )

    @property
    def token_lora_indices(self) -> torch.Tensor:
        """``[T]`` int64: the slot of each token of this step, -1 for none."""
        return self._token_lora_indices[: self.indices_len[0]]

    @property
    def sampler_indices(self) -> torch.Tensor:
        """``[P]`` int64: the slot of each sampled row, -1 for none."""
        return self._sampler_indices[: self.indices_len[1]]

    @property
    def sampler_indices_padded(self) -> torch.Tensor:
        """``[P]`` int64: ``p + s'[p] * P``, -1 slots sent to ``max_loras - 1``."""
        return self._sampler_indices_padded[: self.indices_len[2]]

    @property
    def embeddings_indices(self) -> torch.Tensor:
        """``[2, T]`` int64: each token's row offsets into the extra and full vocabulary."""
        return self._embeddings_indices[:, : self.indices_len[3]]

    @property
    def long_lora_indices(self) -> torch.Tensor:
        """``[T]`` int64: each token's long-context RoPE offset (zeros without a context)."""
        return self._long_lora_indices[: self.indices_len[0]]

    # -- the layers' calls -------------------------------------------------------------
    #
    # Each method checks every argument once, in one pass, with the wrapper's own
    # argument names, and only then launches: the checked launch halves of the ops
    # (``shrink_launch`` / ``expand_launch``) take the checked values as they are,
    # and the metadata is this wrapper's own, so none of it is checked twice.

    def add_shrink(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked,
        scale: float,
        *,
        add_inputs: bool = True,
        **kwargs,
    ):
        """``y[s] += scale * x @ A_s[slot]^T`` per token: the first half of a LoRA layer.

        ``add_inputs=False`` (not in vLLM's call) stores the products instead, as
        ``add_expand``'s does: ``y`` then needs no zeros first in the rows of tokens with
        a LoRA, which saves a fill before each call.

        Semantics:
            x: [..., H] (flattened to [T, H]); y: [S, T, r] fp32; A_s: [L, (1,) r, H]
            for s, t with l = slot(t) != -1:
                y[s, t] = (y[s, t] if add_inputs else 0) + scale * x[t] @ A_s[l].T
            Rows of tokens without a LoRA are untouched.
        """
        x2 = self._flat(x)
        a = self._lora_a(lora_a_stacked, x2)
        rows, rank = x2.shape[0], a[0].rows
        self._check_buffer("y", y, len(a), rows, rank)
        scale = check_real("scale", scale)
        add_inputs = check_bool("add_inputs", add_inputs)
        meta = self._meta_args(self.token_mapping_meta, rows, "x", ("lora_a_stacked", a))
        if meta is not None and rank:
            shrink_launch(x2, a, y, meta, scale, add_inputs)()

    def add_expand(self, y: torch.Tensor, x: torch.Tensor, lora_b_stacked, *args, **kwargs) -> None:
        """Slice by slice, ``x[s] @ B_s[slot]^T`` (and the slot's bias) into ``y``'s columns.

        Takes vLLM 0.33's call, ``add_expand(y, x, lora_b_stacked, output_slices,
        offset_start=0, add_inputs=True)``, and vLLM v0.8-v0.9's, with
        ``lora_bias_stacked`` (None, or a bias per slice) before ``output_slices``; the
        value after ``lora_b_stacked`` tells them apart (ints are output slices).

        Semantics:
            x: [S, T, r]; y: [..., W] (viewed as [T, W]); B_s: [L, (1,) N_s, r];
            bias_s: [L, (1,) N_s] or None; c_s = offset_start + N_0 + ... + N_{s-1}
            for t with l = slot(t) != -1:
                y[t, c_s:c_s+N_s] = (y[t, c_s:c_s+N_s] if add_inputs else 0)
                                    + x[s, t] @ B_s[l].T + bias_s[l]
            Rows without a LoRA and columns outside the slices are untouched.
        """
        lora_bias_stacked, output_slices, offset_start, add_inputs = _expand_call(args, kwargs)
        y2 = self._rows(y)
        check_kernel_tensor("x", x, self._kernel_device)
        if x.ndim != 3:
            raise ValueError(f"x must be [S, T, r], got shape {tuple(x.shape)}")
        b = self._lora_b(lora_b_stacked, output_slices, x.shape[2], "x")
        self._check_expand_input("x", x, b)
        rows = x.shape[1]
        self._check_rows(y2, rows, "x")
        offset_start = check_int("offset_start", offset_start, minimum=0)
        add_inputs = check_bool("add_inputs", add_inputs)
        widths = self._check_columns(y2, offset_start, b)
        bias = self._check_bias(lora_bias_stacked, widths)
        meta = self._meta_args(self.token_mapping_meta, rows, "x", ("lora_b_stacked", b))
        if meta is not None and sum(widths):
            expand_launch(x, b, y2, meta, offset_start, add_inputs)()
        self._add_bias(y2, bias, widths, offset_start)

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs,
    ) -> None:
        """``y[t] (+)= x[t] @ B[slot]^T``, where ``x`` is each token's looked-up LoRA-A row.

        Semantics:
            x: [T, r] (the LoRA dtype); y: [T, D]; B: [L, (1,) D, r]
            for t with l = slot(t) != -1:  y[t] = (y[t] if add_inputs else 0) + x[t] @ B[l].T
        """
        y2 = self._rows(y)
        check_kernel_tensor("x", x, self._kernel_device)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
        b = [self._one_lora_b(lora_b_stacked, None, x.shape[1], "x", None)]
        x3 = x.unsqueeze(0)  # [1, T, r]
        self._check_expand_input("x", x3, b)
        rows = x.shape[0]
        self._check_rows(y2, rows, "x")
        add_inputs = check_bool("add_inputs", add_inputs)
        widths = self._check_columns(y2, 0, b)
        meta = self._meta_args(self.token_mapping_meta, rows, "x", ("lora_b_stacked", b))
        if meta is not None and widths[0]:
            expand_launch(x3, b, y2, meta, 0, add_inputs)()

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked,
        lora_b_stacked,
        *args,
        buffer: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        """A LoRA linear layer: shrink into an fp32 buffer, then expand (plus bias) into ``y``.

        Takes vLLM 0.33's call, ``add_lora_linear(y, x, lora_a_stacked, lora_b_stacked,
        scale, output_slices, *, buffer=None)``, and vLLM v0.8-v0.9's, with
        ``lora_bias_stacked`` (None, or a bias per slice) before ``scale``; the value after
        ``lora_b_stacked`` tells them apart (a number is the scale). Either may come by
        keyword.

        Semantics:
            x: [..., H] -> [T, H]; y: [..., sum N_s] -> [T, sum N_s]
            A_s: [L, (1,) r, H]; B_s: [L, (1,) N_s, r]; bias_s: [L, (1,) N_s] or None
            buffer: [S, T, r] fp32; a given buffer is added to; without one the shrink
                stores into a buffer of its own (as if it were zeros, with no fill)
            for t with l = slot(t) != -1, each slice s:
                y[t, c_s:c_s+N_s] += bias_s[l] + (buffer[s, t] + scale * x[t] @ A_s[l].T) @ B_s[l].T
        """
        lora_bias_stacked, scale, output_slices = _linear_call(args, kwargs)
        y2 = self._rows(y)
        x2 = self._flat(x)
        rows = x2.shape[0]
        self._check_rows(y2, rows, "x")
        a = self._lora_a(lora_a_stacked, x2)
        rank = a[0].rows
        b = self._lora_b(lora_b_stacked, output_slices, rank, "lora_a_stacked")
        if len(a) != len(b):
            raise ValueError(
                f"lora_a_stacked, lora_b_stacked and output_slices must have one entry per "
                f"slice; got {len(a)}, {len(b)}, {len(output_slices)}"
            )
        widths = self._check_columns(y2, 0, b)
        bias = self._check_bias(lora_bias_stacked, widths)
        scale = check_real("scale", scale)
        if buffer is not None:
            self._check_buffer("buffer", buffer, len(b), rows, rank)
            self._check_expand_input("buffer", buffer, b)
        meta = self._meta_args(
            self.token_mapping_meta, rows, "x", ("lora_a_stacked", a), ("lora_b_stacked", b)
        )
        if meta is not None:
            _shrink_then_expand(x2, a, buffer, b, y2, meta, scale)
        self._add_bias(y2, bias, widths, 0)

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: float,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        """The LM head's LoRA, per *sampled row* (the prompt mapping), into the logits.

        Semantics:
            x: [P, Hd]; y: [P, V]; A: [L, (1,) r, Hd]; B: [L, (1,) V_b <= V, r]
            for p with l = sampler_slot(p) != -1:
                y[p, :V_b] += scale * (x[p] @ A[l].T) @ B[l].T
        """
        y2 = self._rows(y)
        x2 = self._flat(x)
        rows = x2.shape[0]
        self._check_rows(y2, rows, "x")
        a = [self._one_lora_a(lora_a_stacked, x2, None, None)]
        rank = a[0].rows
        b = [self._one_lora_b(lora_b_stacked, None, rank, "lora_a_stacked", None)]
        self._check_columns(y2, 0, b)
        scale = check_real("scale", scale)
        if buffer is not None:
            check_kernel_tensor("buffer", buffer, self._kernel_device)
            if buffer.ndim != 2:
                raise ValueError(f"buffer must be [P, r], got shape {tuple(buffer.shape)}")
            self._check_buffer("buffer", buffer.unsqueeze(0), 1, rows, rank)
            self._check_expand_input("buffer", buffer.unsqueeze(0), b)
        meta = self._meta_args(
            self.prompt_mapping_meta, rows, "x", ("lora_a_stacked", a), ("lora_b_stacked", b)
        )
        if meta is not None:
            buffer = None if buffer is None else buffer.unsqueeze(0)
            _shrink_then_expand(x2, a, buffer, b, y2, meta, scale)

    # -- mixture of experts ------------------------------------------------------------

    def moe_lora_align_block_size(
        self,
        topk_ids: torch.Tensor,
        num_tokens: int,
        block_size: int,
        num_experts: int,
        max_loras: int,
        adapter_enabled: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        pad_sorted_ids: bool = False,
        naive_block_assignment: bool = False,
        token_lora_mapping: torch.Tensor | None = None,
    ) -> tuple:
        """This step's (token, expert) pairs sorted by slot and expert into blocks, for
        :meth:`add_lora_fused_moe`: :func:`punica_numba.moe_meta.align_pairs` on the
        tokens' slots of the last :meth:`update_metadata`, or on ``token_lora_mapping``
        where given. On the device, no sync.

        Returns vLLM 0.33's four values, ``(token_lora_mapping, sorted_token_ids,
        expert_ids, num_tokens_post_padded)``: the slots used, then the blocks, the
        middle two flat (``[max_loras * EM]``, ``[max_loras * NB]``) as vLLM returns
        them (view them ``[max_loras, -1]``). With an ``expert_map`` the experts of
        ``topk_ids`` are global ones, counted by the map's length, and the blocks name
        local experts. ``naive_block_assignment=True`` (vLLM's choice for sparse
        batches) returns ``(token_lora_mapping, None, topk_ids[:num_tokens].reshape(-1),
        None)``: the pairs' experts as they are, left to :meth:`add_lora_fused_moe`.

        Semantics:
            topk_ids: [>= num_tokens, top_k] integer (its first num_tokens rows are used)
            pair t * top_k + k -> row slot(t), blocks of block_size pairs of one expert
        """
        naive = check_bool("naive_block_assignment", naive_block_assignment)
        if naive and expert_map is not None:
            raise ValueError(
                "naive_block_assignment=True takes no expert_map: the pairs keep their "
                "experts as topk_ids names them"
            )
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} is more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.ndim != 2:
            raise ValueError("topk_ids must be a 2-D tensor [tokens, top_k]")
        if topk_ids.shape[0] < num_tokens:
            raise ValueError(
                f"topk_ids has {topk_ids.shape[0]} rows, fewer than num_tokens={num_tokens}"
            )
        if token_lora_mapping is None:
            token_lora_mapping = self.token_mapping_meta.token_lora_mapping[:num_tokens]
        if naive:
            return token_lora_mapping, None, topk_ids[:num_tokens].reshape(-1), None
        num_experts = check_int("num_experts", num_experts, minimum=1)
        if isinstance(expert_map, torch.Tensor):
            num_experts = expert_map.numel()  # (topk_ids holds global experts)
        blocks = align_pairs(
            topk_ids[:num_tokens],
            token_lora_mapping,
            num_experts,
            block_size,
            max_loras,
            adapter_enabled,
            expert_map,
            pad_sorted_ids,
        )
        return (
            token_lora_mapping,
            blocks.sorted_token_ids.reshape(-1),
            blocks.expert_ids.reshape(-1),
            blocks.num_tokens_post_padded,
        )

    def add_lora_fused_moe(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked,
        lora_b_stacked,
        topk_weights: torch.Tensor,
        sorted_token_ids: torch.Tensor | None,
        expert_ids: torch.Tensor,
        num_tokens_post_padded: torch.Tensor | None,
        max_lora_rank: int,
        top_k_num: int,
        shrink_config,
        expand_config,
        adapter_enabled: torch.Tensor,
        mul_routed_weight: bool = False,
        fully_sharded: bool = False,
        offset: int = 0,
        token_lora_mapping: torch.Tensor | None = None,
        add_inputs: bool = True,
    ) -> None:
        """The experts' LoRA of a mixture-of-experts layer (w13 or w2), vLLM's call: every
        pair of :meth:`moe_lora_align_block_size`'s blocks through its slot's and expert's
        A and B, into the pair's row of ``y`` (:func:`punica_numba.ops.moe.fused_moe_lora`).

        The blocks hold ``shrink_config["BLOCK_SIZE_M"]`` pairs (64 when not given), as the
        align step was told; the configurations' other entries tune vLLM's Triton kernels
        and are not used. ``sorted_token_ids`` and ``expert_ids`` may be flat or
        ``[L, -1]``. ``add_inputs=False`` stores each pair's delta in place of what y
        held there (pairs in no block are untouched). Without blocks (vLLM's naive block
        assignment: ``sorted_token_ids`` None, ``expert_ids`` each pair's expert), the
        pairs are sorted here by ``token_lora_mapping`` and those experts, into blocks
        of one pair. Not supported: ``fully_sharded=True`` (an all-reduce of the
        intermediate across tensor-parallel ranks).

        Those of ``reference.fused_moe_lora`` (P = M * top_k pairs).

        Semantics:
            y: [M, top_k, >= offset + S * N]; x: [M, K], or [P, K] with mul_routed_weight
            A_s: [L, E, r, K]; B_s: [L, E, N, r]; r == max_lora_rank; top_k == top_k_num
            row(p), w = (x[p], topk_weights[t, k]) if mul_routed_weight else (x[t], 1)
            for each pair p = t * top_k + k of slot l = slot(t), expert e = topk_ids[t, k]:
                y[t, k, offset + s*N : offset + (s+1)*N] += w * (row(p) @ A_s[l, e].T) @ B_s[l, e].T
        """
        if check_bool("fully_sharded", fully_sharded):
            raise ValueError(
                "fully_sharded=True (the intermediate all-reduced across tensor-parallel "
                "ranks) is not supported"
            )
        check_kernel_tensor("y", y, self._kernel_device)
        check_sequence("lora_a_stacked", lora_a_stacked)
        check_kernel_tensor("lora_a_stacked[0]", lora_a_stacked[0], self._kernel_device)
        if lora_a_stacked[0].ndim != 4:
            raise ValueError(
                f"lora_a_stacked[0] must be [L, E, r, K], got {tuple(lora_a_stacked[0].shape)}"
            )
        num_loras, rank = lora_a_stacked[0].shape[0], lora_a_stacked[0].shape[2]
        if check_int("max_lora_rank", max_lora_rank, minimum=0) != rank:
            raise ValueError(f"max_lora_rank={max_lora_rank}, but lora_a_stacked has rank {rank}")
        if y.ndim != 3 or check_int("top_k_num", top_k_num, minimum=1) != y.shape[1]:
            raise ValueError(f"y must be [M, top_k_num={top_k_num}, W], got shape {tuple(y.shape)}")
        if not isinstance(shrink_config, Mapping):
            raise TypeError(f"shrink_config must be a dict, got {type(shrink_config).__name__}")
        block_size = check_int(
            "shrink_config['BLOCK_SIZE_M']", shrink_config.get("BLOCK_SIZE_M", 64)
        )
        if sorted_token_ids is None:  # vLLM's naive block assignment: blocks of one pair
            blocks = self._blocks_of_one_pair(
                y, expert_ids, token_lora_mapping, lora_a_stacked[0], adapter_enabled
            )
            sorted_token_ids, expert_ids, num_tokens_post_padded = blocks
            block_size = 1
        elif num_tokens_post_padded is None:
            raise ValueError("num_tokens_post_padded is None, but sorted_token_ids is given")
        rows = []
        for name, t in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids)):
            if not isinstance(t, torch.Tensor) or t.ndim not in (1, 2):
                raise ValueError(f"{name} must be a flat or [L, -1] tensor")
            if t.ndim == 1 and t.shape[0] % max(num_loras, 1):
                raise ValueError(
                    f"{name} has {t.shape[0]} entries, not a whole row for each of the "
                    f"{num_loras} slots"
                )
            rows.append(t.view(num_loras, -1) if t.ndim == 1 else t)
        fused_moe_lora(
            y,
            x,
            lora_a_stacked,
            lora_b_stacked,
            topk_weights,
            rows[0],
            rows[1],
            num_tokens_post_padded,
            adapter_enabled,
            block_size=block_size,
            mul_routed_weight=check_bool("mul_routed_weight", mul_routed_weight),
            offset=offset,
            add_inputs=check_bool("add_inputs", add_inputs),
        )

    @staticmethod
    def _blocks_of_one_pair(y, expert_ids, token_lora_mapping, lora_a, adapter_enabled):
        """The blocks of vLLM's naive assignment: each pair's expert (``expert_ids``, one
        per pair) and its token's slot (``token_lora_mapping``), sorted by
        :func:`~punica_numba.moe_meta.align_pairs` into blocks of one pair."""
        num_tokens, top_k = y.shape[0], y.shape[1]
        if not isinstance(token_lora_mapping, torch.Tensor):
            raise ValueError(
                "sorted_token_ids is None (vLLM's naive block assignment), so "
                "token_lora_mapping must be given"
            )
        if not isinstance(expert_ids, torch.Tensor) or expert_ids.numel() != num_tokens * top_k:
            raise ValueError(
                f"sorted_token_ids is None, so expert_ids must hold each pair's expert "
                f"({num_tokens} x {top_k}), got "
                f"{tuple(expert_ids.shape) if isinstance(expert_ids, torch.Tensor) else expert_ids}"
            )
        num_loras, num_experts = lora_a.shape[0], lora_a.shape[1]
        return align_pairs(
            expert_ids.reshape(num_tokens, top_k),
            token_lora_mapping,
            num_experts,
            1,
            num_loras,
            adapter_enabled,
        )

    # -- checks: each argument once ----------------------------------------------------

    def _rows(self, y) -> torch.Tensor:
        """``y`` as a ``[rows, columns]`` view of the same memory (it is written in place)."""
        check_kernel_tensor("y", y, self._kernel_device)
        if y.ndim < 1 or not y.is_contiguous():
            raise ValueError(f"y must be a contiguous tensor, got strides {y.stride()}")
        return y if y.ndim == 2 else y.view(-1, y.shape[-1])

    def _flat(self, x) -> torch.Tensor:
        """``x`` as a contiguous ``[T, H]``: itself, a view, or (when strided) a copy."""
        check_kernel_tensor("x", x, self._kernel_device)
        if x.ndim < 2:
            raise ValueError(f"x must be [..., H], got shape {tuple(x.shape)}")
        x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            raise ValueError(
                f"x must be contiguous, got strides {x2.stride()} for shape {tuple(x2.shape)}"
            )
        return x2

    @staticmethod
    def _check_rows(y2: torch.Tensor, rows: int, x_name: str) -> None:
        if y2.shape[0] != rows:
            raise ValueError(f"y has {y2.shape[0]} rows but {x_name} has {rows}; they must match")

    def _stack(self, name: str, w, index: int | None) -> Stack:
        """One stacked weight (``name[index]``, or ``name`` when index is None), on our device."""
        stack = check_stack(name, w, index)
        if stack.device != self._kernel_device:
            raise ValueError(
                f"{_indexed(name, index)} is on {stack.device}, but the kernels run on "
                f"{self._kernel_device} here"
            )
        return stack

    def _one_lora_a(self, w, x2, first: Stack | None, index: int | None) -> Stack:
        """A LoRA-A stack ``[L, r, H]`` for ``x2`` (its dtype and H), like ``first``."""
        a = self._stack("lora_a_stacked", w, index)
        if a.dtype != x2.dtype:
            raise TypeError(
                f"{_indexed('lora_a_stacked', index)} is {a.dtype} but x is {x2.dtype}; "
                "they must match"
            )
        if a.cols != x2.shape[1]:
            raise ValueError(
                f"{_indexed('lora_a_stacked', index)} has K={a.cols} but x has hidden size "
                f"{x2.shape[1]}"
            )
        if first is not None and (a.num_loras, a.rows) != (first.num_loras, first.rows):
            raise ValueError(
                f"{_indexed('lora_a_stacked', index)} is {tuple(a.view.shape)} but "
                f"lora_a_stacked[0] is {tuple(first.view.shape)}; all slices need the same "
                "L and rank"
            )
        return a

    def _lora_a(self, lora_a_stacked, x2) -> list[Stack]:
        """The LoRA-A slices for ``x2``: one dtype (x's), H, slot count and rank."""
        check_sequence("lora_a_stacked", lora_a_stacked)
        stacks = []
        for s, w in enumerate(lora_a_stacked):
            stacks.append(self._one_lora_a(w, x2, stacks[0] if stacks else None, s))
        return stacks

    def _one_lora_b(self, w, width, rank: int, rank_of: str, index: int | None, first=None):
        """A LoRA-B stack ``[L, N, r]``: N == ``width`` (unless None), rank ``rank`` (that
        of ``rank_of``), and the dtype and slot count of ``first`` (unless None)."""
        b = self._stack("lora_b_stacked", w, index)
        if width is not None and b.rows != width:
            raise ValueError(
                f"output_slices[{index}] is {width} but lora_b_stacked[{index}] has {b.rows} "
                "output rows"
            )
        if first is not None and b.dtype != first.dtype:
            raise TypeError(
                f"lora_b_stacked[{index}] is {b.dtype} but lora_b_stacked[0] is {first.dtype}"
            )
        if first is not None and b.num_loras != first.num_loras:
            raise ValueError(
                f"lora_b_stacked[{index}] holds {b.num_loras} slots but lora_b_stacked[0] holds "
                f"{first.num_loras}"
            )
        if b.cols != rank:
            raise ValueError(
                f"{_indexed('lora_b_stacked', index)} has rank {b.cols} but {rank_of} has rank "
                f"{rank}"
            )
        return b

    def _lora_b(self, lora_b_stacked, output_slices, rank: int, rank_of: str) -> list[Stack]:
        """The LoRA-B slices: one per entry of ``output_slices``, each as wide as its entry,
        of rank ``rank``, one dtype and slot count."""
        check_sequence("lora_b_stacked", lora_b_stacked)
        check_sequence("output_slices", output_slices)
        if len(lora_b_stacked) != len(output_slices):
            raise ValueError(
                f"lora_b_stacked has {len(lora_b_stacked)} slices but output_slices has "
                f"{len(output_slices)}"
            )
        stacks = []
        for s, (w, width) in enumerate(zip(lora_b_stacked, output_slices)):
            first = stacks[0] if stacks else None
            stacks.append(self._one_lora_b(w, width, rank, rank_of, s, first))
        return stacks

    def _check_buffer(self, name: str, out, slices: int, rows: int, rank: int) -> None:
        """A shrink output: ``[>= slices, rows, rank]``, contiguous, of a kernel dtype."""
        check_kernel_tensor(name, out, self._kernel_device)
        if out.ndim != 3:
            raise ValueError(f"{name} must be 3-D [S, T, r], got shape {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous, got strides {out.stride()} for shape "
                f"{tuple(out.shape)}"
            )
        shape = out.shape
        if shape[0] < slices or shape[1] != rows or shape[2] != rank:
            raise ValueError(
                f"{name} must be [S >= {slices}, T={rows}, r={rank}], got {tuple(shape)}"
            )

    @staticmethod
    def _check_expand_input(name: str, x: torch.Tensor, b: list[Stack]) -> None:
        """An expand input ``[>= S, T, r]`` (rank checked with B): B's dtype, or fp32."""
        if x.dtype != b[0].dtype and x.dtype != torch.float32:
            raise TypeError(
                f"{name} is {x.dtype} but lora_b_stacked are {b[0].dtype}; {name} must have "
                "the weights' dtype or be float32"
            )
        if x.shape[0] < len(b):
            raise ValueError(
                f"{name} has {x.shape[0]} slice(s), fewer than the {len(b)} of lora_b_stacked"
            )

    @staticmethod
    def _check_columns(y2: torch.Tensor, offset_start: int, b: list[Stack]) -> list[int]:
        """``y`` wide enough for the slices from ``offset_start``; return their widths."""
        widths = [s.rows for s in b]
        if y2.shape[1] < offset_start + sum(widths):
            raise ValueError(
                f"y has {y2.shape[1]} columns, too few for offset_start={offset_start} plus "
                f"slices of widths {widths}"
            )
        return widths

    def _meta_args(self, meta: LoRAKernelMeta, rows: int, x_name: str, *weights):
        """The six metadata arguments for ``rows`` activation rows, or None when there is
        nothing to launch (no row, or no token with a LoRA).

        ``weights`` are ``(name, stacks)`` pairs. The metadata is this wrapper's own, so
        its host-side facts are trusted: rows must fit the buffers and the prepared
        tokens, and every weight must hold the slots in use. No device sync.
        """
        if rows > self.max_num_batched_tokens:
            raise ValueError(
                f"{x_name} has {rows} rows, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        facts = meta.host
        if facts.num_tokens > rows:
            raise ValueError(
                f"the metadata was prepared for {facts.num_tokens} tokens, more than the "
                f"{rows} rows of {x_name}"
            )
        for name, stacks in weights:
            if facts.max_slot_in_use >= stacks[0].num_loras:
                raise ValueError(
                    f"the metadata uses slot {facts.max_slot_in_use}, but {name} hold only "
                    f"{stacks[0].num_loras} slot(s)"
                )
        if facts.max_slot_in_use < 0 or rows == 0:
            return None
        return self._meta_views(meta, rows)

    def _meta_views(self, meta: LoRAKernelMeta, rows: int) -> tuple:
        """``meta.meta_args(rows)``, made once per row count and kept: they are views of
        buffers the metadata allocates once and only ever writes in place."""
        known = self._meta_args_made.get((id(meta), rows))
        if known is None:  # (the entry holds ``meta`` itself, so its id is not reused)
            known = self._meta_args_made[(id(meta), rows)] = (meta, meta.meta_args(rows))
        return known[1]

    def _check_bias(self, lora_bias_stacked, widths: list[int]) -> list | None:
        """Check the bias tuple now, so that a bad one is rejected before any launch;
        return each slice's bias as ``[L, N_s]`` (or None)."""
        if lora_bias_stacked is None:
            return None
        check_sequence("lora_bias_stacked", lora_bias_stacked)
        if len(lora_bias_stacked) != len(widths):
            raise ValueError(
                f"lora_bias_stacked has {len(lora_bias_stacked)} slices but output_slices has "
                f"{len(widths)}"
            )
        biases = []
        for s, (bias, width) in enumerate(zip(lora_bias_stacked, widths)):
            if bias is None:
                biases.append(None)
                continue
            check_kernel_tensor(f"lora_bias_stacked[{s}]", bias, self._kernel_device)
            good = bias.ndim in (2, 3) and bias.shape[0] == self._max_loras
            flat = bias.reshape(self._max_loras, -1) if good else bias
            if not good or flat.shape != (self._max_loras, width):
                raise ValueError(
                    f"lora_bias_stacked[{s}] must be [L={self._max_loras}, (1,) {width}], got "
                    f"{tuple(bias.shape)}"
                )
            biases.append(flat)
        return biases

    def _add_bias(self, y2, biases, widths: list[int], offset_start: int) -> None:
        """``y[t, c_s:c_s+N_s] += bias_s[slot(t)]`` for rows with a LoRA; no host sync."""
        if biases is None:
            return
        slots = self._token_lora_indices[: y2.shape[0]]  # [T]; -1 past this step's tokens
        has_lora = (slots >= 0).unsqueeze(1)  # [T, 1]
        column = offset_start
        for bias, width in zip(biases, widths):
            if bias is not None:
                rows = bias[slots.clamp(min=0)]  # [T, N_s]
                window = y2[:, column : column + width]
                window += torch.where(
                    has_lora, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)
                )
            column += width


#: Recorded calls a LoRA-A weight keeps in ``_shrink_then_expand``, by addresses and by
#: key (the oldest is forgotten first): a few, for calls that come back in turns, such as
#: a buffer that the allocator hands out at one of two addresses, or two token counts
#: that alternate.
REPLAYS_PER_WEIGHT = 4

#: The largest buffer of its own (bytes) a recorded call keeps for its replays, which
#: then allocate nothing: 64 KiB holds 1024 tokens at rank 16 (one slice), decode's
#: sizes, where the host time of a call is most of its time. Larger ones are allocated
#: each call, as a capture's always are (they come from the caller's graph's memory).
KEPT_BUFFER_BYTES = 64 << 10


class _Replay(NamedTuple):
    """A call a LoRA-A weight led: the record of its launches and everything they depend
    on, the objects whose ids are in the key, so that no other object can take them,
    and the buffer of its own that it keeps (None when the call gives one or allocates
    each time)."""

    key: tuple
    keep: tuple
    record: LaunchRecord
    buffer: torch.Tensor | None = None


def _new_buffer(*shape: int, device, one_slot: bool) -> torch.Tensor:
    """The fp32 buffer of a call that gave none. The shrink stores into it (it reads
    nothing from it) and the expand uses only the rows the shrink wrote, so it is mostly
    left unfilled: a fill would be one more launch (about 5 µs of host time on the H200's
    host, ``torch.zeros`` against ``torch.empty``).

    Where the weight stacks hold one slot (``one_slot``) it is filled with zeros: there
    the expand's blocks load their tokens' buffer rows before they know the tokens'
    slots (``kernels.expand_lanes`` and ``kernels.expand_mma``, "One slot"), the rows of
    tokens without a LoRA too. Those values never reach an output, but they would be
    reads of memory nothing wrote, which compute-sanitizer's initcheck reports (it did,
    on the H200 at 5d81db4: the one-slot lane-split expand, 3456 reads over the edge
    cases' wrapper tests)."""
    if one_slot:
        return torch.zeros(*shape, dtype=torch.float32, device=device)
    return torch.empty(*shape, dtype=torch.float32, device=device)


def _shrink_then_expand(x2, a, buffer, b, y2, meta, scale: float) -> None:
    """``buffer (+)= scale * x2 @ A^T`` then ``y2 += buffer @ B^T``, slice by slice, on
    checked arguments: the shrink adds to a given buffer, and stores into one of the
    wrapper's own when ``buffer`` is None. Both launches are made ready before either
    runs; a step with nothing to do (rank 0, or no column) is skipped, as the ops skip
    it.

    A serving engine makes the same calls step after step, so the launches of a call
    are recorded (:class:`~punica_numba._cuda.LaunchRecord`, about a tenth more host
    time than making them) the first time its key comes (:func:`_replay_key`:
    everything they depend on but where x, the buffer and y sit), and kept per weight.
    The same call at the same addresses replays the record (as one CUDA graph, outside
    a capture); at other addresses it is the record with the pointers moved
    (:meth:`~punica_numba._cuda.LaunchRecord.replay_at`, its launches one by one). Both
    skip choosing configurations and describing arguments: most of the host time of a
    call. A small buffer of its own is kept with the record and used again, on the
    stream the call was recorded on (its calls there run one after another, so no
    replay writes it while another reads it).

    An engine's eager passes allocate their activations anew, and the allocator need
    not hand out the same addresses twice: the demo's prefill on the H200 did not, so
    that while records waited for a call to come back to its addresses, each of its
    calls was prepared in full. At 7704909 its 16 LoRA calls took 0.94 ms of host time
    replayed at recorded addresses, 1.17 ms moved and 3.17 ms prepared afresh (a
    3-slice call of 2015 tokens: 28 µs a replay, 41 µs a move, in bursts).
    """
    accumulate = buffer is not None
    own = None  # ("own", stream) when the call uses a buffer its record keeps
    one_slot = b[0].num_loras == 1  # (the stacks' slots: checked equal)
    shape = (len(b), x2.shape[0], a[0].rows)
    if buffer is None:
        stream = eager_stream()
        if stream is not None and 4 * shape[0] * shape[1] * shape[2] <= KEPT_BUFFER_BYTES:
            own = ("own", stream)
        else:
            buffer = _new_buffer(*shape, device=x2.device, one_slot=one_slot)
    # Where the tensors sit tells most calls apart and is cheap to read.
    where = (x2.data_ptr(), y2.data_ptr(), own or buffer.data_ptr())
    launched = a[0].launch.setdefault("shrink_then_expand", {})
    replays = launched.setdefault("where", {})  # where -> _Replay
    latest = launched.setdefault("key", {})  # key -> the latest _Replay recorded
    key = _replay_key(x2, a, own or buffer, b, y2, meta, scale, accumulate)
    known = replays.get(where)
    if known is not None and known.key == key:
        known.record.replay(capturing=False if own else None)  # (own: eager_stream read it)
        return
    moved = latest.get(key)
    if moved is not None and moved.record.moving is not None:
        moved.record.replay_at((x2, moved.buffer if own else buffer, y2))
        return
    if own:
        buffer = _new_buffer(*shape, device=x2.device, one_slot=one_slot)
    launches = []
    if a[0].rows:
        launches.append(shrink_launch(x2, a, buffer, meta, scale, accumulate))
    if any(s.rows for s in b):
        # Just behind this call's own shrink (when there is one), the expand may load B
        # before its wait (ops.choice.choose_expand).
        launches.append(expand_launch(buffer, b, y2, meta, 0, True, bool(launches)))
    with LaunchRecord((x2, buffer, y2)) as record:
        for launch in launches:
            launch()
    if record.replayable:  # (a[0] holds the entry, so it keeps a[1:] only)
        replay = _Replay(key, (a[1:], b, meta), record, buffer if own else None)
        _remember(replays, where, replay)
        _remember(latest, key, replay)


def _remember(calls: dict, key, call: _Replay) -> None:
    """``calls[key] = call``, forgetting the oldest call when there are
    :data:`REPLAYS_PER_WEIGHT` already."""
    calls.pop(key, None)  # (so that it counts as the newest)
    if len(calls) >= REPLAYS_PER_WEIGHT:
        del calls[next(iter(calls))]
    calls[key] = call


def _replay_key(x2, a, buffer, b, y2, meta, scale: float, accumulate: bool) -> tuple:
    """Everything the launches of ``_shrink_then_expand`` depend on but the addresses of
    x, the buffer and y (the caller's look-up holds those): how their memory is read
    (shape, strides, dtype, device) and how it is aligned (a choice of 16-byte loads
    depends on it); the checked weights (``check_stack`` gives a new Stack when a weight
    changes); the metadata and what the host knows of it; the configurations forced on
    the heuristic (every other input of it is in the key already); the scale; and
    whether the shrink adds. ``buffer`` is ``("own", stream)`` for a buffer of the
    call's own (its layout follows from x and the weights)."""
    facts = host_facts_of(meta[4])  # the wrapper's own metadata: never None
    return (
        _read_as(x2),
        buffer if type(buffer) is tuple else _read_as(buffer),
        _read_as(y2),
        *map(id, a),  # (as many as of b: checked)
        *map(id, b),
        id(meta),
        facts.num_tokens,
        facts.max_slot_in_use,
        facts.active_slots,
        scale.hex(),  # its exact bits (0.0 == -0.0, but their launches differ)
        accumulate,  # (a given buffer may sit where the wrapper's own was)
        forced_launch_configs(),
    )


#: A multiple of every alignment (bytes) a launch choice depends on (16 bytes, the most).
_ALIGNMENTS = 256


def _read_as(t: torch.Tensor) -> tuple:
    """How ``t``'s memory is read, and its address modulo :data:`_ALIGNMENTS` in place of
    the address (``memory_layout`` keeps the address itself)."""
    return (t.data_ptr() % _ALIGNMENTS, t.shape, t.stride(), t.dtype, t.device)


#: The two calls of ``add_lora_linear`` and ``add_expand``: the names of what follows
#: ``lora_b_stacked``, in order, in vLLM 0.33 and in vLLM v0.8-v0.9 (with the bias).
_LINEAR_CALLS = (("scale", "output_slices"), ("lora_bias_stacked", "scale", "output_slices"))
_EXPAND_CALLS = (
    ("output_slices", "offset_start", "add_inputs"),
    ("lora_bias_stacked", "output_slices", "offset_start", "add_inputs"),
)


def _linear_call(args: tuple, kwargs: dict) -> tuple:
    """``(lora_bias_stacked, scale, output_slices)`` of an ``add_lora_linear`` call in
    either convention: vLLM 0.33's when the first value after ``lora_b_stacked`` is a
    number (the scale) or, with nothing there, when no bias is named. A bias named by
    keyword is taken in both."""
    with_bias = (not is_real(args[0])) if args else "lora_bias_stacked" in kwargs
    named = _bind("add_lora_linear", _LINEAR_CALLS[with_bias], args, kwargs, {})
    bias = named.get("lora_bias_stacked", kwargs.get("lora_bias_stacked"))
    return bias, named["scale"], named["output_slices"]


def _expand_call(args: tuple, kwargs: dict) -> tuple:
    """``(lora_bias_stacked, output_slices, offset_start, add_inputs)`` of an ``add_expand``
    call in either convention: vLLM 0.33's when the first value after ``lora_b_stacked``
    is a sequence of ints (the output slices) or, with nothing there, when no bias is
    named."""
    if args:
        first = args[0]
        with_bias = not (
            isinstance(first, (list, tuple)) and first and all(is_int(n) for n in first)
        )
    else:
        with_bias = "lora_bias_stacked" in kwargs
    defaults = {"offset_start": 0, "add_inputs": True}
    named = _bind("add_expand", _EXPAND_CALLS[with_bias], args, kwargs, defaults)
    return (
        named.get("lora_bias_stacked", kwargs.get("lora_bias_stacked")),
        named["output_slices"],
        named["offset_start"],
        named["add_inputs"],
    )


def _bind(method: str, names: tuple, args: tuple, kwargs: dict, defaults: dict) -> dict:
    """``names`` bound to the positional ``args`` then to ``kwargs`` (which may hold other
    keywords too, ignored as vLLM's wrapper ignores them), with ``defaults`` for the rest;
    TypeError for too many values, one given twice or one missing."""
    if len(args) > len(names):
        raise TypeError(
            f"{method} takes {len(names)} values after lora_b_stacked ({', '.join(names)}), "
            f"got {len(args)}"
        )
    named = dict(zip(names, args))
    for name in names[len(args) :]:
        if name in kwargs:
            named[name] = kwargs[name]
        elif name in defaults:
            named[name] = defaults[name]
        else:
            raise TypeError(f"{method} is missing its argument {name}")
    for name in names[: len(args)]:
        if name in kwargs:
            raise TypeError(f"{method} got {name} twice: by position and as a keyword")
    return named


def _indexed(name: str, index: int | None) -> str:
    """``name[index]``, or ``name`` for a lone tensor (index None); for messages."""
    return name if index is None else f"{name}[{index}]"


def _fill_front(buffer: torch.Tensor, values: torch.Tensor, rest: int) -> None:
    """``buffer[..., :n] = values`` and ``buffer[..., n:] = rest`` (nothing stale stays)."""
    n = values.shape[-1]
    buffer[..., :n].copy_(values)
    buffer[..., n:].fill_(rest)
