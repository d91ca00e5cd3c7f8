"""Every argument of ``lora_shrink`` / ``lora_expand`` checked before anything runs.

Two conventions reach these ops, and both are taken:

* **vLLM v0.8-v0.9** (six metadata values, ``LoRAKernelMeta.meta_args(T)``)::

      lora_shrink(inputs, weights, output, <6 values>, scaling)
      lora_expand(inputs, weights, output, <6 values>, offset_start=0, add_inputs=False)

* **vLLM 0.33** (seven, ``meta_args(T, specialize_active_lora)``): the six, then
  ``num_active_loras``, a one-element integer tensor on the CPU::

      lora_shrink(inputs, weights, output, <7 values>, scaling)
      lora_expand(inputs, weights, output, <7 values>, offset_start=0, add_inputs=False)

They are told apart by the value after ``no_lora_flag_cpu``: a tensor is
``num_active_loras``; a number is ``scaling`` (shrink) or ``offset_start`` (expand),
neither of which can be a tensor. vLLM sizes its grid's LoRA axis by
``num_active_loras``, so a count that leaves out a segment in use would silently skip
those tokens there; here that count is an error, and otherwise the count changes nothing
(the kernels find their work in the tile table, :mod:`.launching`).

Wrong types and dtypes raise ``TypeError``; wrong shapes, sizes, devices and values
``ValueError``; the messages name the argument.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._checks import (
    Stack,
    check_bool,
    check_int,
    check_real,
    check_same_device,
    check_sequence,
    check_stack,
    check_tensor,
)
from .._cuda import KERNEL_DTYPES
from ..meta import host_facts_of

__all__ = [
    "NOT_GIVEN",
    "CheckedExpand",
    "CheckedShrink",
    "check_expand",
    "check_shrink",
    "expand_convention",
    "shrink_convention",
]

_INDEX_DTYPES = (torch.int32,)


class _NotGiven:
    """The default of an argument that may also come by position (so that one given twice
    is told from one given once)."""

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven()


class CheckedShrink(NamedTuple):
    """A shrink whose arguments passed :func:`check_shrink`."""

    inputs: torch.Tensor  # [T, H] contiguous
    weights: list[Stack]  # S stacks of [L, r, H], the dtype of inputs
    output: torch.Tensor  # [>= S, T, r] contiguous
    metadata: tuple  # vLLM's six tensors, fitting T rows and L slots
    scaling: float
    idle: bool  # nothing to launch: no token with a LoRA, or T = 0 or r = 0


class CheckedExpand(NamedTuple):
    """An expand whose arguments passed :func:`check_expand`."""

    inputs: torch.Tensor  # [>= S, T, r]
    weights: list[Stack]  # S stacks of [L, N_s, r]
    output: torch.Tensor  # [T, >= offset_start + sum(N_s)] contiguous
    metadata: tuple  # vLLM's six tensors, fitting T rows and L slots
    offset_start: int
    add_inputs: bool
    idle: bool  # nothing to launch: no token with a LoRA, or T = 0 or no column


def shrink_convention(rest: tuple, num_active_loras, scaling) -> tuple:
    """``(num_active_loras, scaling)`` from what follows ``no_lora_flag_cpu`` in a shrink
    call: ``rest`` (the positional values) and the keywords (:data:`NOT_GIVEN` when not
    given; ``num_active_loras`` is then None, the six-value convention)."""
    if rest and isinstance(rest[0], torch.Tensor):  # vLLM 0.33: num_active_loras first
        num_active_loras = _once("num_active_loras", rest[0], num_active_loras)
        rest = rest[1:]
    if len(rest) > 1:
        raise TypeError(
            f"lora_shrink takes one value after the metadata (scaling), got {len(rest)}"
        )
    if rest:
        scaling = _once("scaling", rest[0], scaling)
    if scaling is NOT_GIVEN:
        raise TypeError("lora_shrink is missing its argument scaling")
    return (None if num_active_loras is NOT_GIVEN else num_active_loras), scaling


def expand_convention(rest: tuple, num_active_loras, offset_start, add_inputs) -> tuple:
    """``(num_active_loras, offset_start, add_inputs)`` from what follows
    ``no_lora_flag_cpu`` in an expand call: ``rest`` and the keywords (:data:`NOT_GIVEN`
    when not given; then ``num_active_loras`` is None, ``offset_start`` 0 and
    ``add_inputs`` False)."""
    if rest and isinstance(rest[0], torch.Tensor):  # vLLM 0.33: num_active_loras first
        num_active_loras = _once("num_active_loras", rest[0], num_active_loras)
        rest = rest[1:]
    if len(rest) > 2:
        raise TypeError(
            "lora_expand takes at most two values after the metadata (offset_start, "
            f"add_inputs), got {len(rest)}"
        )
    if rest:
        offset_start = _once("offset_start", rest[0], offset_start)
    if len(rest) > 1:
        add_inputs = _once("add_inputs", rest[1], add_inputs)
    return (
        None if num_active_loras is NOT_GIVEN else num_active_loras,
        0 if offset_start is NOT_GIVEN else offset_start,
        False if add_inputs is NOT_GIVEN else add_inputs,
    )


def _once(name: str, positional, keyword):
    """An argument given by position, which must not also come as a keyword."""
    if keyword is not NOT_GIVEN:
        raise TypeError(f"{name} was given twice: by position and as a keyword")
    return positional


def check_weights(name: str, weights) -> list[Stack]:
    """A list of stacked LoRA weights of one dtype, as :class:`Stack`\\ s (their
    ``[L, N, K]`` views, and a place to keep what a launch works out about them)."""
    check_sequence(name, weights)
    stacks = []
    for s, w in enumerate(weights):
        stacks.append(check_stack(name, w, s))
        if w.dtype != weights[0].dtype:
            raise TypeError(f"{name}[{s}] is {w.dtype} but {name}[0] is {weights[0].dtype}")
    return stacks


def check_shrink(
    inputs, lora_a_weights, output_tensor, metadata: tuple, num_active_loras, scaling
) -> CheckedShrink:
    """Check a shrink's arguments (:func:`~punica_numba.ops.lora_shrink`); ``metadata`` is
    vLLM's six tensors and ``num_active_loras`` None in the six-value convention."""
    check_tensor("inputs", inputs, ndim=2, dtypes=KERNEL_DTYPES, contiguous=True)
    weights = check_weights("lora_a_weights", lora_a_weights)
    check_tensor("output_tensor", output_tensor, ndim=3, dtypes=KERNEL_DTYPES, contiguous=True)
    scaling = check_real("scaling", scaling)
    if weights[0].dtype != inputs.dtype:
        raise TypeError(
            f"lora_a_weights are {weights[0].dtype} but inputs are {inputs.dtype}; they must match"
        )
    num_tokens, hidden = inputs.shape
    num_loras, rank = weights[0].num_loras, weights[0].rows
    for s, w in enumerate(weights):
        if w.cols != hidden:
            raise ValueError(
                f"lora_a_weights[{s}] has K={w.cols} but inputs have hidden size {hidden}"
            )
        if (w.num_loras, w.rows) != (num_loras, rank):
            raise ValueError(
                f"lora_a_weights[{s}] is {tuple(w.view.shape)} but lora_a_weights[0] is "
                f"{tuple(weights[0].view.shape)}; all slices need the same L and rank"
            )
    if output_tensor.shape[0] < len(weights):
        raise ValueError(
            f"output_tensor has {output_tensor.shape[0]} slice(s), fewer than the "
            f"{len(weights)} weight slice(s)"
        )
    if output_tensor.shape[1:] != (num_tokens, rank):
        raise ValueError(
            f"output_tensor must be [S, T={num_tokens}, r={rank}], got {tuple(output_tensor.shape)}"
        )
    no_lora, in_use = _check_devices_and_metadata(
        inputs,
        output_tensor,
        weights,
        "lora_a_weights",
        num_tokens,
        num_loras,
        metadata,
        count_entries=num_active_loras is not None,
    )
    _check_num_active_loras(num_active_loras, metadata[4].shape[0], no_lora, in_use)
    idle = no_lora or num_tokens == 0 or rank == 0
    return CheckedShrink(inputs, weights, output_tensor, metadata, scaling, idle)


def check_expand(
    inputs,
    lora_b_weights,
    output_tensor,
    metadata: tuple,
    num_active_loras,
    offset_start,
    add_inputs,
) -> CheckedExpand:
    """Check an expand's arguments (:func:`~punica_numba.ops.lora_expand`); ``metadata``
    is vLLM's six tensors and ``num_active_loras`` None in the six-value convention."""
    check_tensor("inputs", inputs, ndim=3, dtypes=KERNEL_DTYPES)
    weights = check_weights("lora_b_weights", lora_b_weights)
    check_tensor("output_tensor", output_tensor, ndim=2, dtypes=KERNEL_DTYPES, contiguous=True)
    offset_start = check_int("offset_start", offset_start, minimum=0)
    add_inputs = check_bool("add_inputs", add_inputs)
    if inputs.dtype not in (weights[0].dtype, torch.float32):
        raise TypeError(
            f"inputs are {inputs.dtype} but lora_b_weights are {weights[0].dtype}; inputs must "
            "have the weights' dtype or be float32"
        )
    _, num_tokens, rank = inputs.shape
    num_loras = weights[0].num_loras
    for s, w in enumerate(weights):
        if w.num_loras != num_loras:
            raise ValueError(
                f"lora_b_weights[{s}] holds {w.num_loras} slots but lora_b_weights[0] holds "
                f"{num_loras}"
            )
        if w.cols != rank:
            raise ValueError(f"lora_b_weights[{s}] has rank {w.cols} but inputs have rank {rank}")
    if inputs.shape[0] < len(weights):
        raise ValueError(
            f"inputs have {inputs.shape[0]} slice(s), fewer than the {len(weights)} weight slice(s)"
        )
    widths = [w.rows for w in weights]
    if output_tensor.shape[0] != num_tokens:
        raise ValueError(
            f"output_tensor has {output_tensor.shape[0]} rows but inputs have {num_tokens} tokens"
        )
    if output_tensor.shape[1] < offset_start + sum(widths):
        raise ValueError(
            f"output_tensor has {output_tensor.shape[1]} columns, too few for offset_start="
            f"{offset_start} plus slices of widths {widths}"
        )
    no_lora, in_use = _check_devices_and_metadata(
        inputs,
        output_tensor,
        weights,
        "lora_b_weights",
        num_tokens,
        num_loras,
        metadata,
        count_entries=num_active_loras is not None,
    )
    _check_num_active_loras(num_active_loras, metadata[4].shape[0], no_lora, in_use)
    idle = no_lora or num_tokens == 0 or sum(widths) == 0
    return CheckedExpand(inputs, weights, output_tensor, metadata, offset_start, add_inputs, idle)


def _check_devices_and_metadata(
    inputs,
    output_tensor,
    weights,
    weights_name: str,
    num_rows: int,
    num_loras: int,
    metadata,
    *,
    count_entries: bool = False,
) -> tuple[bool, int]:
    """The checks shrink and expand share: one device for the tensors, and metadata that
    fits ``num_rows`` rows and ``num_loras`` slots. Returns :func:`_check_metadata`'s
    ``(no_lora, in_use)``."""
    check_same_device(
        {
            "inputs": inputs,
            "output_tensor": output_tensor,
            **{f"{weights_name}[{s}]": w.view for s, w in enumerate(weights)},
        }
    )
    return _check_metadata(
        num_rows, num_loras, weights_name, inputs.device, *metadata, count_entries=count_entries
    )


def _check_metadata(
    num_rows: int,
    num_loras: int,
    weights_name: str,
    device: torch.device,
    token_lora_mapping,
    token_indices_sorted_by_lora_ids,
    num_tokens_per_lora,
    lora_token_start_loc,
    lora_ids,
    no_lora_flag_cpu,
    *,
    count_entries: bool = False,
) -> tuple[bool, int]:
    """Check the six metadata arguments for ``num_rows`` activation rows and weights of
    ``num_loras`` slots. Return whether no token has a LoRA (nothing to launch) and, with
    ``count_entries``, how many leading entries of ``lora_ids`` are in use (up to the last
    one with tokens; 0 without: metadata built elsewhere then needs no more device work)."""
    named = {
        "token_lora_mapping": token_lora_mapping,
        "token_indices_sorted_by_lora_ids": token_indices_sorted_by_lora_ids,
        "num_tokens_per_lora": num_tokens_per_lora,
        "lora_token_start_loc": lora_token_start_loc,
        "lora_ids": lora_ids,
    }
    for name, t in named.items():
        check_tensor(name, t, ndim=1, dtypes=_INDEX_DTYPES)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the activations are on {device}")
    check_tensor("no_lora_flag_cpu", no_lora_flag_cpu, dtypes=(torch.bool,), on_kernel_device=False)
    if no_lora_flag_cpu.device.type != "cpu" or no_lora_flag_cpu.numel() != 1:
        raise ValueError(
            "no_lora_flag_cpu must be a one-element bool tensor on the CPU, got "
            f"{no_lora_flag_cpu.numel()} element(s) on {no_lora_flag_cpu.device}"
        )
    for name in ("token_lora_mapping", "token_indices_sorted_by_lora_ids"):
        if named[name].shape[0] < num_rows:
            raise ValueError(
                f"{name} holds {named[name].shape[0]} entries, fewer than the {num_rows} "
                "token rows of the activation (the metadata was made for fewer tokens)"
            )
    if num_tokens_per_lora.shape[0] != lora_ids.shape[0]:
        raise ValueError(
            f"num_tokens_per_lora has {num_tokens_per_lora.shape[0]} entries but lora_ids has "
            f"{lora_ids.shape[0]}; they must match"
        )
    if lora_token_start_loc.shape[0] != lora_ids.shape[0] + 1:
        raise ValueError(
            f"lora_token_start_loc must have len(lora_ids) + 1 = {lora_ids.shape[0] + 1} "
            f"entries, got {lora_token_start_loc.shape[0]}"
        )
    meta = host_facts_of(lora_ids)  # ours: host-side facts, no device sync
    if meta is None:
        # Metadata built some other way: nothing on the host says which slots it uses,
        # so read its largest slot, its token count and the entries in use back (one
        # sync) rather than let a kernel read weights or rows that do not exist.
        largest, counted, in_use = -1, 0, 0
        if lora_ids.numel():
            read = [lora_ids.max().to(torch.int64), num_tokens_per_lora.sum()]
            if count_entries:  # the last entry with tokens, 1-based
                order = torch.arange(1, lora_ids.shape[0] + 1, device=lora_ids.device)
                read.append(torch.where(num_tokens_per_lora > 0, order, 0).max())
            largest, counted, *entries = torch.stack(read).tolist()
            in_use = entries[0] if entries else 0
        if largest >= num_loras:
            raise ValueError(
                f"lora_ids uses slot {largest}, but {weights_name} hold only {num_loras} slot(s)"
            )
        if counted > num_rows:
            raise ValueError(
                f"num_tokens_per_lora counts {counted} tokens, more than the {num_rows} token "
                "rows of the activation"
            )
    else:
        if meta.max_slot_in_use >= num_loras:
            raise ValueError(
                f"the metadata uses slot {meta.max_slot_in_use}, but {weights_name} hold only "
                f"{num_loras} slot(s)"
            )
        if meta.num_tokens > num_rows:
            raise ValueError(
                f"the metadata was prepared for {meta.num_tokens} tokens, more than the "
                f"{num_rows} token rows of the activation"
            )
        in_use = meta.segments
    return bool(no_lora_flag_cpu.item()), in_use


def _check_num_active_loras(num_active_loras, entries: int, no_lora: bool, in_use: int) -> None:
    """vLLM 0.33's ``num_active_loras`` (None in the six-value convention): a one-element
    integer tensor on the CPU, from 0 to ``entries`` (``len(lora_ids)``), and, when some
    token has a LoRA, at least ``in_use``, the entries of ``lora_ids`` the metadata uses
    (fewer would leave tokens out)."""
    if num_active_loras is None:
        return
    if not isinstance(num_active_loras, torch.Tensor):
        raise TypeError(
            "num_active_loras must be a one-element integer tensor on the CPU (vLLM 0.33's "
            f"convention), got {type(num_active_loras).__name__}"
        )
    dtype = num_active_loras.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"num_active_loras must be an integer tensor, got {dtype}")
    if num_active_loras.device.type != "cpu" or num_active_loras.numel() != 1:
        raise ValueError(
            "num_active_loras must be a one-element tensor on the CPU, got "
            f"{num_active_loras.numel()} element(s) on {num_active_loras.device}"
        )
    count = int(num_active_loras.item())
    if not 0 <= count <= entries:
        raise ValueError(f"num_active_loras is {count}, outside [0, len(lora_ids)={entries}]")
    if not no_lora and count < in_use:
        raise ValueError(
            f"num_active_loras is {count}, but the metadata uses the first {in_use} entries "
            "of lora_ids: the tokens of the others would be left out"
        )
