"""Dense per-token references for every operation, in float64.

These functions are the yardstick for every test, notebook and benchmark. They are
written to be read, not to be fast: each one says, token by token, what the
kernels and the wrapper must compute, in float64 so that rounding in the
reference never hides an error in the kernel. They import nothing of ours.

Conventions shared by all functions:

* ``slots`` is the per-token (or per-sampled-row) GPU slot, an integer tensor of
  length T; ``-1`` means "no LoRA" and such rows are left exactly as they were.
* LoRA weights are stacked over slots: ``[L, N, K]`` or vLLM's ``[L, 1, N, K]``.
* Every function returns a **new float64 tensor**; the inputs are never modified.
  The kernels write in place; the tests compare the written tensor with the
  returned one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "squeeze_weight",
    "lora_shrink",
    "lora_expand",
    "add_bias",
    "add_lora_linear",
    "add_lora_embedding",
    "add_lora_logits",
    "fused_moe_lora",
]


def squeeze_weight(w: torch.Tensor) -> torch.Tensor:
    """``[L, 1, N, K] -> [L, N, K]``; a 3-D weight is returned unchanged."""
    if w.ndim == 4:
        if w.shape[1] != 1:
            raise ValueError(f"a 4-D weight must be [L, 1, N, K], got {tuple(w.shape)}")
        return w[:, 0]
    if w.ndim != 3:
        raise ValueError(f"a weight must be [L, N, K] or [L, 1, N, K], got {tuple(w.shape)}")
    return w


def _tokens_of_each_slot(slots: torch.Tensor):
    """Yield ``(slot, token_indices)`` for every slot other than -1 that occurs."""
    slots = slots.reshape(-1).to(torch.int64)
    for slot in torch.unique(slots).tolist():
        if slot != -1:
            yield slot, torch.nonzero(slots == slot).reshape(-1)


def lora_shrink(
    x: torch.Tensor,
    lora_a_weights: Sequence[torch.Tensor],
    output: torch.Tensor,
    slots: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Reference shrink: ``out[s, t] = output[s, t] + scaling * x[t] @ A_s[slot[t]]^T``.

    Semantics:
        x: [T, K]; lora_a_weights[s]: [L, r, K]; output: [S >= len(A), T, r].
        for s, A in enumerate(lora_a_weights):
            for t with l = slots[t] != -1:
                out[s, t, :] = output[s, t, :] + scaling * x[t] @ A[l].T
        Rows of tokens without a LoRA, and slices past len(A), keep their values.

    Returns:
        float64 tensor shaped like ``output``.
    """
    out = output.to(torch.float64).clone()  # [S, T, r]
    xd = x.to(torch.float64)  # [T, K]
    for s, weight in enumerate(lora_a_weights):
        a = squeeze_weight(weight).to(torch.float64)  # [L, r, K]
        for slot, tokens in _tokens_of_each_slot(slots):
            out[s, tokens] += scaling * (xd[tokens] @ a[slot].T)  # [n, r]
    return out


def lora_expand(
    x: torch.Tensor,
    lora_b_weights: Sequence[torch.Tensor],
    output: torch.Tensor,
    slots: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = False,
) -> torch.Tensor:
    """Reference expand: slice s of width N_s lands in columns ``c_s : c_s + N_s``.

    Semantics:
        x: [S, T, r]; lora_b_weights[s]: [L, N_s, r]; output: [T, >= offset_start + sum(N_s)].
        c_s = offset_start + N_0 + ... + N_{s-1}
        for t with l = slots[t] != -1:
            out[t, c_s:c_s+N_s] = (output[t, c_s:c_s+N_s] if add_inputs else 0)
                                  + x[s, t] @ B_s[l].T
        Rows without a LoRA and columns outside the slices keep their values.

    Returns:
        float64 tensor shaped like ``output``.
    """
    out = output.to(torch.float64).clone()  # [T, W]
    column = offset_start
    for s, weight in enumerate(lora_b_weights):
        b = squeeze_weight(weight).to(torch.float64)  # [L, N_s, r]
        width = b.shape[1]
        xs = x[s].to(torch.float64)  # [T, r]
        for slot, tokens in _tokens_of_each_slot(slots):
            window = out[tokens, column : column + width]  # [n, N_s]
            base = window if add_inputs else torch.zeros_like(window)
            out[tokens, column : column + width] = base + xs[tokens] @ b[slot].T
        column += width
    return out


def add_bias(
    y: torch.Tensor,
    lora_bias_stacked: Sequence[torch.Tensor | None],
    output_slices: Sequence[int],
    slots: torch.Tensor,
    offset_start: int = 0,
) -> torch.Tensor:
    """Reference bias: the bias of slot l is added to the rows of slot l, slice by slice.

    Semantics:
        bias_s: [L, N_s] or [L, 1, N_s]; c_s = offset_start + N_0 + ... + N_{s-1}
        for t with l = slots[t] != -1:  out[t, c_s:c_s+N_s] = y[t, c_s:c_s+N_s] + bias_s[l]
        A ``None`` bias slice adds nothing. Rows without a LoRA are unchanged.
    """
    out = y.to(torch.float64).clone()
    column = offset_start
    for bias, width in zip(lora_bias_stacked, output_slices):
        if bias is not None:
            b = bias.reshape(bias.shape[0], -1).to(torch.float64)  # [L, N_s]
            for slot, tokens in _tokens_of_each_slot(slots):
                out[tokens, column : column + width] += b[slot]
        column += width
    return out


def add_lora_linear(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Sequence[torch.Tensor],
    lora_b_stacked: Sequence[torch.Tensor],
    lora_bias_stacked: Sequence[torch.Tensor | None] | None,
    scale: float,
    output_slices: Sequence[int],
    slots: torch.Tensor,
    offset_start: int = 0,
) -> torch.Tensor:
    """Reference LoRA linear layer, per token and per slice.

    Semantics:
        x: [T, H]; y: [T, >= offset_start + sum(N_s)]; A_s: [L, r, H]; B_s: [L, N_s, r]
        for t with l = slots[t] != -1, for each slice s:
            out[t, c_s:c_s+N_s] = y[t, c_s:c_s+N_s] + bias_s[l]
                                  + scale * (x[t] @ A_s[l].T) @ B_s[l].T
    """
    out = y.to(torch.float64).clone()
    if lora_bias_stacked is not None:
        out = add_bias(out, lora_bias_stacked, output_slices, slots, offset_start)
    rank = squeeze_weight(lora_b_stacked[0]).shape[-1]
    buffer = torch.zeros(
        len(lora_a_stacked), x.shape[0], rank, dtype=torch.float64, device=x.device
    )
    buffer = lora_shrink(x, lora_a_stacked, buffer, slots, scale)  # [S, T, r]
    return lora_expand(buffer, lora_b_stacked, out, slots, offset_start, add_inputs=True)


def add_lora_embedding(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    slots: torch.Tensor,
    add_inputs: bool = True,
) -> torch.Tensor:
    """Reference embedding LoRA: ``x`` is already the looked-up LoRA-A row of each token.

    Semantics:
        x: [T, r]; y: [T, D]; B: [L, D, r] or [L, 1, D, r]
        for t with l = slots[t] != -1:  out[t] = (y[t] if add_inputs else 0) + x[t] @ B[l].T
    """
    return lora_expand(x.unsqueeze(0), [lora_b_stacked], y, slots, 0, add_inputs)


def add_lora_logits(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    scale: float,
    sampler_slots: torch.Tensor,
) -> torch.Tensor:
    """Reference logits LoRA, indexed by the sampler (prompt) mapping.

    Semantics:
        x: [P, Hd]; y: [P, V]; A: [L, r, Hd]; B: [L, V_b <= V, r]
        for p with l = sampler_slots[p] != -1:
            out[p, :V_b] = y[p, :V_b] + scale * (x[p] @ A[l].T) @ B[l].T
    """
    width = squeeze_weight(lora_b_stacked).shape[1]
    return add_lora_linear(
        y, x, [lora_a_stacked], [lora_b_stacked], None, scale, [width], sampler_slots
    )


def fused_moe_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Sequence[torch.Tensor],
    lora_b_stacked: Sequence[torch.Tensor],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slots: torch.Tensor,
    *,
    mul_routed_weight: bool = False,
    offset: int = 0,
    adapter_enabled: torch.Tensor | None = None,
    add_inputs: bool = True,
) -> torch.Tensor:
    """Reference MoE LoRA: each token's adapter on each of its top-k experts, as vLLM's
    ``add_lora_fused_moe`` defines it.

    A token t routed to experts ``topk_ids[t, :]`` is k pairs (t, k). The shrink reads the
    pair's input row: the token's own row for the gate/up projection (w13, whose input is
    the hidden state: ``x`` has one row per token), the pair's row for the down
    projection (w2, whose input is each expert's own activation: ``x`` has a row per
    pair, ``t * top_k + k``); ``mul_routed_weight`` is set for w2 and says which. The
    expand writes each slice of the pair's delta into its own row of ``y``
    (``[M, top_k, W]``), times the pair's routing weight when ``mul_routed_weight``.

    Semantics:
        x: [M, K] (rows per token) or [M * top_k, K] (mul_routed_weight: rows per pair)
        A_s: [L, E, r, K]; B_s: [L, E, N, r]; y: [M, top_k, >= offset + S * N]
        topk_ids: [M, top_k] expert per pair (-1: none); topk_weights: [M, top_k]
        slots: [M] (-1: no LoRA); adapter_enabled: [>= L] (0: slot off), or None (all on)
        for t with l = slots[t] != -1 and adapter_enabled[l], k with e = topk_ids[t, k] != -1:
            row = x[t * top_k + k] if mul_routed_weight else x[t]
            w = topk_weights[t, k] if mul_routed_weight else 1
            for each slice s (c = offset + s*N):
                out[t, k, c : c+N] = (y[t, k, c : c+N] if add_inputs else 0)
                                     + w * (row @ A_s[l, e].T) @ B_s[l, e].T
    """
    out = y.to(torch.float64).clone()
    num_tokens, top_k = topk_ids.shape
    width = lora_b_stacked[0].shape[2]
    # Every pair (t, k) with a LoRA that is on and an expert, as index vectors.
    slot = slots.reshape(-1)[:num_tokens].to(torch.int64)[:, None].expand(num_tokens, top_k)
    expert = topk_ids.to(torch.int64)
    keep = (slot != -1) & (expert != -1)
    if adapter_enabled is not None:
        keep &= adapter_enabled.to(torch.bool)[slot.clamp(min=0)]
    t, k = torch.nonzero(keep, as_tuple=True)  # [Q] each
    l, e = slot[t, k], expert[t, k]  # [Q] each
    rows = x[t * top_k + k if mul_routed_weight else t].to(torch.float64)  # [Q, K]
    weight = (
        topk_weights[t, k].to(torch.float64) if mul_routed_weight else torch.ones_like(rows[:, 0])
    )
    if not add_inputs:
        out[t, k, offset : offset + len(lora_b_stacked) * width] = 0.0
    for s, (a, b) in enumerate(zip(lora_a_stacked, lora_b_stacked)):
        inner = torch.einsum("qrk,qk->qr", a[l, e].to(torch.float64), rows)  # [Q, r]
        delta = torch.einsum("qnr,qr->qn", b[l, e].to(torch.float64), inner)  # [Q, N]
        start = offset + s * width
        out[t, k, start : start + width] += weight[:, None] * delta
    return out
