"""A preallocated KV cache: one contiguous row of positions per request slot, per layer.

A serving engine keeps each request's keys and values from one step to the next, so
that a decode step computes only its new token's. This cache is the simplest form
that a CUDA graph can capture: every tensor is allocated once, at its largest
(``slots x max_len`` positions per layer), and a step only writes into it in place and
reads views of it, so the addresses a captured graph holds never change.

* **Layout.** ``k[layer]`` and ``v[layer]`` are ``[slots, kv_heads, max_len, head_dim]``:
  request slot ``b`` owns ``k[layer][b]``, its position ``p`` the row ``[:, p]``.
  A batch of B requests takes slots ``0 .. B-1``; the views ``keys(layer, B)`` are the
  ``[B, kv_heads, max_len, head_dim]`` slabs that batched attention reads.
* **Visibility.** A decode step reads every position of its slot's row, and masks
  those past the token's own (:meth:`KVCache.decode_bias`): one length for the whole
  batch, so one attention call serves requests of any lengths, and the shape is the
  same at every step (the graph's). Positions never written are masked, so what they
  hold (zeros) is never read into a result.

Requests never see each other's rows: a slot is only ever written by its request's
tokens and only ever read by them.
"""

from __future__ import annotations

import torch

from ._checks import check_int

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of ``slots`` requests, ``max_len`` positions each, for every layer.

    Args:
        layers: decoder layers.
        slots: requests the cache holds at once (the most in a batch).
        kv_heads, head_dim: the attention's key/value heads and their width.
        max_len: the most positions a request may reach (prompt plus new tokens).
        dtype, device: the model's.

    Memory: ``2 * layers * slots * kv_heads * max_len * head_dim`` elements, allocated
    once (zeros).
    """

    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.layers = check_int("layers", layers, minimum=1)
        self.slots = check_int("slots", slots, minimum=1)
        self.kv_heads = check_int("kv_heads", kv_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.max_len = check_int("max_len", max_len, minimum=1)
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kvh, S, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kvh, S, d]
        # [S] the positions and a 0-d zero, for visibility masks (made once: no launch per step)
        self._positions = torch.arange(max_len, device=device)
        self._zero = torch.zeros((), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together."""
        return 2 * self.k.numel() * self.k.element_size()

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store each token's key and value at its slot and position.

        Semantics:
            slots, positions: [T] int64; k, v: [T, kv_heads, head_dim] (any strides)
            for t: self.k[layer, slots[t], :, positions[t]] = k[t]   (same for v)
        Two launches (one scatter each), no sync; the indices are not checked on the
        device (the engine makes them).
        """
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def keys(self, layer: int, batch: int) -> torch.Tensor:
        """``[batch, kv_heads, max_len, head_dim]``: slots ``0 .. batch-1`` of ``layer``, a view."""
        return self.k[layer, :batch]

    def values(self, layer: int, batch: int) -> torch.Tensor:
        """``[batch, kv_heads, max_len, head_dim]``: slots ``0 .. batch-1`` of ``layer``, a view."""
        return self.v[layer, :batch]

    def decode_bias(self, positions: torch.Tensor) -> torch.Tensor:
        """The additive attention mask of one decode token per slot over the whole row.

        Semantics:
            positions: [B] int64 (row b's token sits at positions[b])
            bias[b, 0, 0, p] = 0 if p <= positions[b] else -inf      -> [B, 1, 1, max_len]
        in the cache's dtype. Made once per step and shared by every layer (two launches).
        """
        visible = self._positions <= positions[:, None]  # [B, S] bool
        return torch.where(visible, self._zero, float("-inf"))[:, None, None, :]
