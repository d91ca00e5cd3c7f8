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

import contextlib
import re
from collections.abc import Sequence

import torch

from ._checks import (
    check_device,
    check_int,
    check_real,
    check_sequence,
    check_tensor,
    check_weight,
)
from ._cuda import KERNEL_DTYPES
from .mapping import LongContextLoRAContext, LoRAMapping, convert_mapping
from .meta import LoRAKernelMeta
from .ops import prepare_expand, prepare_shrink

__all__ = ["PunicaWrapperNumba"]


@contextlib.contextmanager
def _argument_names(**ours):
    """Re-raise an op's ValueError / TypeError with the wrapper's argument names, so the
    message names what the caller passed (``lora_b_stacked``, not ``lora_b_weights``)."""
    try:
        yield
    except (ValueError, TypeError) as error:
        message = str(error)
        for op_name, name in ours.items():
            message = re.sub(rf"\b{op_name}\b", name, message)
        raise type(error)(message) from None


class PunicaWrapperNumba:
    """Multi-LoRA state and launches for one model, with the API of vLLM's ``PunicaWrapperGPU``.

    Args:
        max_num_batched_tokens: the most tokens (and sampled rows) one step may hold.
        max_batches: the most sequences in a step (kept for vLLM compatibility).
        device: where the index buffers live; the kernels' device (``cuda``, or
            ``cpu`` on the simulator).
        max_loras: L, the number of GPU LoRA slots.

    CUDA graphs: call ``update_metadata`` and each ``add_*`` method once outside
    capture (this compiles the kernels and fixes the launch shapes), and capture
    with a mapping in which at least one token has a LoRA (a batch without any is
    skipped on the host, so nothing would be recorded). After capture, call
    ``update_metadata`` outside the graph with any mapping of the same or fewer
    tokens, write the new inputs into the captured tensors in place, and replay.
    ``update_metadata`` itself syncs with the device and cannot be captured.
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
        self.token_mapping_meta = LoRAKernelMeta.make(self._max_loras, n, self.device)
        self.prompt_mapping_meta = LoRAKernelMeta.make(self._max_loras, n, self.device)

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
        without a LoRA. Syncs with the device; call it outside CUDA-graph capture.

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
        indices = convert_mapping(
            mapping,
            lora_index_to_id,
            max_loras,
            vocab_size,
            extra_vocab_size,
            self.device,
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
        tokens, prompts = indices.indices_len[0], indices.indices_len[1]
        _fill_front(self._token_lora_indices, indices.base_indices, -1)
        _fill_front(self._sampler_indices, indices.sampler_indices, -1)
        _fill_front(self._sampler_indices_padded, indices.sampler_indices_padded, 0)
        _fill_front(self._embeddings_indices, indices.embeddings_indices, 0)
        long_lora = indices.long_lora_indices
        _fill_front(
            self._long_lora_indices,
            long_lora
            if long_lora is not None
            else torch.zeros(0, dtype=torch.int64, device=self.device),
            0,
        )
        self.indices_len = list(indices.indices_len)
        self.token_mapping_meta.prepare_tensors(self._token_lora_indices[:tokens])
        self.prompt_mapping_meta.prepare_tensors(self._sampler_indices[:prompts])

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

    def add_shrink(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked, scale: float, **kwargs):
        """``y[s] += scale * x @ A_s[slot]^T`` per token: the first half of a LoRA layer.

        Semantics:
            x: [..., H] (flattened to [T, H]); y: [S, T, r] fp32; A_s: [L, (1,) r, H]
            for s, t with l = slot(t) != -1:  y[s, t] += scale * x[t] @ A_s[l].T
        """
        self._plan_shrink(y, x, lora_a_stacked, scale)()

    def add_expand(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked,
        lora_bias_stacked,
        output_slices: Sequence[int],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs,
    ) -> None:
        """Slice by slice, ``x[s] @ B_s[slot]^T`` (and the slot's bias) into ``y``'s columns.

        Semantics:
            x: [S, T, r]; y: [..., W] (viewed as [T, W]); B_s: [L, (1,) N_s, r];
            bias_s: [L, (1,) N_s] or None; c_s = offset_start + N_0 + ... + N_{s-1}
            for t with l = slot(t) != -1:
                y[t, c_s:c_s+N_s] = (y[t, c_s:c_s+N_s] if add_inputs else 0)
                                    + x[s, t] @ B_s[l].T + bias_s[l]
            Rows without a LoRA and columns outside the slices are untouched.
        """
        y2 = self._rows(y, "y")
        bias = self._check_bias(lora_bias_stacked, output_slices, y2)
        self._plan_expand(y2, x, lora_b_stacked, output_slices, offset_start, add_inputs)()
        self._add_bias(y2, bias, output_slices, offset_start)

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
        check_tensor("x", x, ndim=2)
        width = check_weight("lora_b_stacked", lora_b_stacked).shape[1]
        self._plan_expand(
            self._rows(y, "y"), x.unsqueeze(0), (lora_b_stacked,), (width,), 0, add_inputs
        )()

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked,
        lora_b_stacked,
        lora_bias_stacked,
        scale: float,
        output_slices: Sequence[int],
        *,
        buffer: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        """A LoRA linear layer: shrink into an fp32 buffer, then expand (plus bias) into ``y``.

        Semantics:
            x: [..., H] -> [T, H]; y: [..., sum N_s] -> [T, sum N_s]
            A_s: [L, (1,) r, H]; B_s: [L, (1,) N_s, r]; bias_s: [L, (1,) N_s] or None
            buffer: [S, T, r] fp32; zeros when not given (a given buffer is added to)
            for t with l = slot(t) != -1, each slice s:
                y[t, c_s:c_s+N_s] += bias_s[l] + (buffer[s, t] + scale * x[t] @ A_s[l].T) @ B_s[l].T
        """
        check_sequence("lora_a_stacked", lora_a_stacked)
        check_sequence("lora_b_stacked", lora_b_stacked)
        check_sequence("output_slices", output_slices)
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError(
                f"lora_a_stacked, lora_b_stacked and output_slices must have one entry per "
                f"slice; got {len(lora_a_stacked)}, {len(lora_b_stacked)}, {len(output_slices)}"
            )
        y2 = self._rows(y, "y")
        bias = self._check_bias(lora_bias_stacked, output_slices, y2)
        flat_x = self._flat(x)
        if buffer is None:
            check_tensor("lora_b_stacked[0]", lora_b_stacked[0], ndim=(3, 4))
            rank = lora_b_stacked[0].shape[-1]
            buffer = torch.zeros(
                len(output_slices), flat_x.shape[0], rank, dtype=torch.float32, device=flat_x.device
            )
        shrink = self._plan_shrink(buffer, flat_x, lora_a_stacked, scale, y_name="buffer")
        expand = self._plan_expand(
            y2, buffer, lora_b_stacked, output_slices, 0, True, x_name="buffer"
        )
        shrink()
        expand()
        self._add_bias(y2, bias, output_slices, 0)

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
        y2 = self._rows(y, "y")
        flat_x = self._flat(x)
        if flat_x.shape[0] > self.max_num_batched_tokens:
            raise ValueError(
                f"x has {flat_x.shape[0]} rows, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        check_tensor("lora_a_stacked", lora_a_stacked, ndim=(3, 4))
        check_tensor("lora_b_stacked", lora_b_stacked, ndim=(3, 4))
        rows = flat_x.shape[0]
        if buffer is None:
            buffer = torch.zeros(
                rows, lora_b_stacked.shape[-1], dtype=torch.float32, device=flat_x.device
            )
        check_tensor("buffer", buffer, ndim=2)
        meta = self.prompt_mapping_meta.meta_args(rows)
        self._check_rows(y2, rows)
        scale = check_real("scale", scale)
        with _argument_names(inputs="x", lora_a_weights="lora_a_stacked", output_tensor="buffer"):
            shrink = prepare_shrink(flat_x, [lora_a_stacked], buffer.unsqueeze(0), *meta, scale)
        with _argument_names(inputs="buffer", lora_b_weights="lora_b_stacked", output_tensor="y"):
            expand = prepare_expand(
                buffer.unsqueeze(0), [lora_b_stacked], y2, *meta, offset_start=0, add_inputs=True
            )
        shrink()
        expand()

    # -- helpers -----------------------------------------------------------------------

    def _rows(self, y: torch.Tensor, name: str) -> torch.Tensor:
        """``y`` as a ``[rows, columns]`` view of the same memory (it is written in place)."""
        check_tensor(name, y, dtypes=KERNEL_DTYPES)
        if y.ndim < 1 or not y.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor, got strides {y.stride()}")
        return y.view(-1, y.shape[-1])

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, dtypes=KERNEL_DTYPES)
        if x.ndim < 2:
            raise ValueError(f"x must be [..., H], got shape {tuple(x.shape)}")
        return x.reshape(-1, x.shape[-1])

    def _check_rows(self, y2: torch.Tensor, rows: int) -> None:
        if y2.shape[0] != rows:
            raise ValueError(f"y has {y2.shape[0]} rows but x has {rows}; they must match")

    def _token_meta_args(self, rows: int):
        if rows > self.max_num_batched_tokens:
            raise ValueError(
                f"x has {rows} token rows, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        return self.token_mapping_meta.meta_args(rows)

    def _plan_shrink(self, y, x, lora_a_stacked, scale, y_name="y"):
        flat_x = self._flat(x)
        check_sequence("lora_a_stacked", lora_a_stacked)
        meta = self._token_meta_args(flat_x.shape[0])
        scale = check_real("scale", scale)
        with _argument_names(inputs="x", lora_a_weights="lora_a_stacked", output_tensor=y_name):
            return prepare_shrink(flat_x, lora_a_stacked, y, *meta, scale)

    def _plan_expand(
        self, y2, x, lora_b_stacked, output_slices, offset_start, add_inputs, x_name="x"
    ):
        check_sequence("lora_b_stacked", lora_b_stacked)
        check_sequence("output_slices", output_slices)
        if len(lora_b_stacked) != len(output_slices):
            raise ValueError(
                f"lora_b_stacked has {len(lora_b_stacked)} slices but output_slices has "
                f"{len(output_slices)}"
            )
        for s, (b, width) in enumerate(zip(lora_b_stacked, output_slices)):
            rows = check_weight(f"lora_b_stacked[{s}]", b).shape[1]
            if rows != width:
                raise ValueError(
                    f"output_slices[{s}] is {width} but lora_b_stacked[{s}] has {rows} output rows"
                )
        check_tensor(x_name, x, ndim=3)
        self._check_rows(y2, x.shape[1])
        meta = self._token_meta_args(x.shape[1])
        with _argument_names(inputs=x_name, lora_b_weights="lora_b_stacked", output_tensor="y"):
            return prepare_expand(
                x,
                list(lora_b_stacked),
                y2,
                *meta,
                offset_start=offset_start,
                add_inputs=add_inputs,
            )

    def _check_bias(self, lora_bias_stacked, output_slices, y2) -> list | None:
        """Check the bias tuple now, so that a bad one is rejected before any launch."""
        if lora_bias_stacked is None:
            return None
        check_sequence("lora_bias_stacked", lora_bias_stacked)
        check_sequence("output_slices", output_slices)
        if len(lora_bias_stacked) != len(output_slices):
            raise ValueError(
                f"lora_bias_stacked has {len(lora_bias_stacked)} slices but output_slices has "
                f"{len(output_slices)}"
            )
        biases = []
        for s, (bias, width) in enumerate(zip(lora_bias_stacked, output_slices)):
            if bias is None:
                biases.append(None)
                continue
            check_tensor(f"lora_bias_stacked[{s}]", bias, dtypes=KERNEL_DTYPES)
            good = bias.ndim in (2, 3) and bias.shape[0] == self._max_loras
            flat = bias.reshape(self._max_loras, -1) if good else bias
            if not good or flat.shape != (self._max_loras, width):
                raise ValueError(
                    f"lora_bias_stacked[{s}] must be [L={self._max_loras}, (1,) {width}], got "
                    f"{tuple(bias.shape)}"
                )
            biases.append(flat)
        if y2.shape[0] > self.max_num_batched_tokens:
            raise ValueError(
                f"y has {y2.shape[0]} rows, more than max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        return biases

    def _add_bias(self, y2, biases, output_slices, offset_start: int) -> None:
        """``y[t, c_s:c_s+N_s] += bias_s[slot(t)]`` for rows with a LoRA; no host sync."""
        if biases is None:
            return
        slots = self._token_lora_indices[: y2.shape[0]]  # [T]; -1 past this step's tokens
        has_lora = (slots >= 0).unsqueeze(1)  # [T, 1]
        column = offset_start
        for bias, width in zip(biases, output_slices):
            if bias is not None:
                rows = bias[slots.clamp(min=0)]  # [T, N_s]
                window = y2[:, column : column + width]
                window += torch.where(
                    has_lora, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)
                )
            column += width


def _fill_front(buffer: torch.Tensor, values: torch.Tensor, rest: int) -> None:
    """``buffer[..., :n] = values`` and ``buffer[..., n:] = rest`` (nothing stale stays)."""
    n = values.shape[-1]
    buffer[..., :n].copy_(values)
    buffer[..., n:].fill_(rest)
