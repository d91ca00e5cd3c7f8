"""The public entry points: ``lora_shrink``, ``lora_expand`` and their ``prepare_*`` halves.

Each takes vLLM's metadata in either convention (:mod:`.checks`): the six values of
vLLM v0.8-v0.9's ``meta_args(T)``, or the seven of vLLM 0.33's
``meta_args(T, specialize_active_lora)``. ``prepare_*`` checks a call and returns its
launch, not yet run, so that a caller launching several kernels (the wrapper's
``add_lora_linear``) can check all of them before it changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .checks import (
    NOT_GIVEN,
    check_expand,
    check_shrink,
    expand_convention,
    shrink_convention,
)
from .launching import expand_launch, nothing, shrink_launch

__all__ = ["lora_expand", "lora_shrink", "prepare_expand", "prepare_shrink"]


def prepare_shrink(
    inputs: torch.Tensor,
    lora_a_weights: Sequence[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    *rest,
    num_active_loras: torch.Tensor = NOT_GIVEN,
    scaling: float = NOT_GIVEN,
) -> Callable[[], None]:
    """Check the arguments of :func:`lora_shrink` and return the launch, not yet run."""
    num_active_loras, scaling = shrink_convention(rest, num_active_loras, scaling)
    metadata = (
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
    )
    call = check_shrink(inputs, lora_a_weights, output_tensor, metadata, num_active_loras, scaling)
    if call.idle:
        return nothing
    return shrink_launch(call.inputs, call.weights, call.output, call.metadata, call.scaling)


@torch.no_grad()
def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: Sequence[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    *rest,
    num_active_loras: torch.Tensor = NOT_GIVEN,
    scaling: float = NOT_GIVEN,
) -> None:
    """Shrink: ``output[s, t] += scaling * inputs[t] @ A_s[slot(t)]^T`` for every token with a LoRA.

    Called as vLLM v0.8-v0.9 calls it, ``lora_shrink(inputs, weights, output, <six
    metadata values>, scaling)``, or as vLLM 0.33 does, with ``num_active_loras`` (a
    one-element integer CPU tensor) after ``no_lora_flag_cpu``. ``num_active_loras`` must
    cover every entry of ``lora_ids`` the metadata uses.

    Semantics:
        inputs: [T, H] fp16 / bf16 / fp32, contiguous
        lora_a_weights[s]: [L, r, H] or [L, 1, r, H], the dtype of inputs, contiguous
        output_tensor: [>= S, T, r] floating (fp32 in practice), contiguous; modified in place
        for s, t with l = slot(t) != -1:
            output[s, t, :] += scaling * sum_k inputs[t, k] * A_s[l, :, k]   (fp32 accumulation)
        Rows of tokens without a LoRA, and slices past S, are untouched. Deterministic:
        no floating-point atomics (a split-K launch counts its blocks with an integer one
        and adds its chunks in a fixed order), so the same inputs give the same bits on
        every run.

    Memory traffic: reads T*H + (active slots)*S*r*H elements; reads and writes S*T*r.

    Raises:
        TypeError: a dtype the kernels do not take, mismatched dtypes, or arguments that
            fit neither convention.
        ValueError: a wrong shape, size, layout or device, or metadata that does not fit.
    """
    prepare_shrink(
        inputs,
        lora_a_weights,
        output_tensor,
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
        *rest,
        num_active_loras=num_active_loras,
        scaling=scaling,
    )()


def prepare_expand(
    inputs: torch.Tensor,
    lora_b_weights: Sequence[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    *rest,
    num_active_loras: torch.Tensor = NOT_GIVEN,
    offset_start: int = NOT_GIVEN,
    add_inputs: bool = NOT_GIVEN,
) -> Callable[[], None]:
    """Check the arguments of :func:`lora_expand` and return the launch, not yet run."""
    num_active_loras, offset_start, add_inputs = expand_convention(
        rest, num_active_loras, offset_start, add_inputs
    )
    metadata = (
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
    )
    call = check_expand(
        inputs, lora_b_weights, output_tensor, metadata, num_active_loras, offset_start, add_inputs
    )
    if call.idle:
        return nothing
    return expand_launch(
        call.inputs, call.weights, call.output, call.metadata, call.offset_start, call.add_inputs
    )


@torch.no_grad()
def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: Sequence[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    *rest,
    num_active_loras: torch.Tensor = NOT_GIVEN,
    offset_start: int = NOT_GIVEN,
    add_inputs: bool = NOT_GIVEN,
) -> None:
    """Expand: ``output[t, c_s:c_s+N_s] (+)= inputs[s, t] @ B_s[slot(t)]^T`` per token with a LoRA.

    Called as vLLM v0.8-v0.9 calls it, ``lora_expand(inputs, weights, output, <six metadata
    values>, offset_start=0, add_inputs=False)``, or as vLLM 0.33 does, with
    ``num_active_loras`` (a one-element integer CPU tensor) after ``no_lora_flag_cpu``;
    ``offset_start`` and ``add_inputs`` may come by position after the metadata too.

    Semantics:
        inputs: [>= S, T, r] fp16 / bf16, or fp32 (the shrink buffer); any strides
        lora_b_weights[s]: [L, N_s, r] or [L, 1, N_s, r], fp16 / bf16 / fp32, contiguous;
            inputs must have the weights' dtype or be fp32
        output_tensor: [T, >= offset_start + sum(N_s)] floating, contiguous; modified in place
        c_s = offset_start + N_0 + ... + N_{s-1}            (offset_start defaults to 0)
        for s, t with l = slot(t) != -1, n < N_s:
            output[t, c_s + n] = (output[t, c_s + n] if add_inputs else 0)
                                 + sum_k inputs[s, t, k] * B_s[l, n, k]   (fp32, one rounding)
        Rows of tokens without a LoRA and columns outside the slices are untouched.

    Memory traffic: reads S*T*r + (active slots)*sum(N_s)*r elements; writes T*sum(N_s)
    (and reads them too when add_inputs).

    Raises:
        TypeError: a dtype the kernels do not take, mismatched dtypes, or arguments that
            fit neither convention.
        ValueError: a wrong shape, size, layout, device or offset, or metadata that does not fit.
    """
    prepare_expand(
        inputs,
        lora_b_weights,
        output_tensor,
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
        *rest,
        num_active_loras=num_active_loras,
        offset_start=offset_start,
        add_inputs=add_inputs,
    )()
