"""Tensor-parallel LoRA: vLLM's sharded LoRA linear layers over ``torch.distributed``.

With tensor parallelism (TP) a linear layer ``y = x @ W^T`` is split over
``tp`` ranks (one GPU each), and so are its LoRA weights. Every rank holds the
*whole* batch mapping (each token's slot) and its own :class:`PunicaWrapperNumba`;
only the weights, and for row-parallel layers the input features, are split.
The four layer kinds (vLLM v0.8–0.9, ``layers.py`` and ``fully_sharded_layers.py``):

============================================  =============  ===========  =======================
layer                                         A on rank k    B on rank k  collective
============================================  =============  ===========  =======================
:class:`ColumnParallelLinearWithLoRA`         all of A       rows of B    none (or gather y)
:class:`ColumnParallelLinearWithShardedLoRA`  ``r/tp`` rows  rows of B    all-gather the buffer
:class:`RowParallelLinearWithLoRA`            columns of A   all of B     all-reduce y
:class:`RowParallelLinearWithShardedLoRA`     columns of A   rows of B    all-reduce buffer and y
============================================  =============  ===========  =======================

"rows of B" means the output rows ``N_s/tp`` of every slice, so packed layers
(gate_up, q/k/v with GQA widths) give each rank its shard of every slice; the
column classes cover one slice and packed slices alike. Helpers shard one full,
unsharded set of weights (:class:`LoRALinear`) for any rank, so a test can build
every rank's shards from the same weights and compare with the unsharded layer.

:func:`run_on_ranks` starts one process per rank (the ``spawn`` start method, a
free localhost port, NCCL on GPUs or gloo on CPUs), runs a worker function in
each and returns every rank's result; a failure in any rank raises
:class:`RankError` with that rank's traceback. :func:`run_layer_cases` uses it to
run each :class:`LayerCase` on all ranks; notebooks call it because a function
defined in a notebook cannot be pickled for ``spawn``.

Differences from vLLM, on purpose: the row-parallel LoRA bias is added on rank 0
only (vLLM adds it on every rank, so the all-reduce would count it ``tp`` times),
and the fully sharded row layer adds its bias shard at ``offset_start`` (vLLM adds
it at column 0; ../shared/SPEC.md §7.13).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ._cuda import device_of
from .mapping import LoRAMapping
from .reference import add_lora_linear as reference_add_lora_linear
from .wrapper import PunicaWrapperNumba

__all__ = [
    "LoRALinear",
    "ColumnParallelLinearWithLoRA",
    "ColumnParallelLinearWithShardedLoRA",
    "RowParallelLinearWithLoRA",
    "RowParallelLinearWithShardedLoRA",
    "LAYER_KINDS",
    "LayerCase",
    "RankError",
    "all_gather",
    "all_reduce_",
    "default_backend",
    "free_port",
    "shard",
    "shard_index",
    "qkv_output_slices",
    "wrapper_for_slots",
    "run_on_ranks",
    "run_layer_cases",
    "layer_cases_worker",
]

#: How long a collective may wait for the other ranks before it gives up (seconds).
#: Tiny simulator layers finish in seconds; a rank that waits this long is stuck.
COLLECTIVE_TIMEOUT_S = 120

#: How long :func:`run_on_ranks` waits for all ranks by default (seconds).
RUN_TIMEOUT_S = 300


# -- sharding helpers ------------------------------------------------------------------


def shard(t: torch.Tensor, dim: int, index: int, shards: int) -> torch.Tensor:
    """Chunk ``index`` of ``shards`` equal chunks of ``t`` along ``dim``, as a contiguous copy.

    Semantics:
        size = t.shape[dim] / shards            (must divide exactly)
        return t.narrow(dim, index * size, size)

    Raises:
        ValueError: ``t.shape[dim]`` is not a multiple of ``shards``, or ``index`` is
            outside ``0 .. shards-1``.
    """
    if shards < 1 or not 0 <= index < shards:
        raise ValueError(f"shard index {index} is outside 0..{shards - 1}")
    length = t.shape[dim]
    if length % shards:
        raise ValueError(
            f"dimension {dim} of a {tuple(t.shape)} tensor ({length}) does not split into "
            f"{shards} equal shards"
        )
    size = length // shards
    return t.narrow(dim, index * size, size).contiguous()


def shard_index(rank: int, world_size: int, shards: int) -> int:
    """Which of a slice's ``shards`` shards rank ``rank`` holds.

    A slice is split into ``shards`` parts, ``shards`` dividing ``world_size``; each
    part is held by ``world_size / shards`` neighbouring ranks. ``shards ==
    world_size`` is the usual case; fewer shards is GQA with fewer k/v heads than
    ranks, where vLLM replicates each k/v head (``num_kv_head_replicas``).

    Semantics:
        replicas = world_size / shards;  return rank // replicas
    """
    if shards < 1 or world_size % shards:
        raise ValueError(f"{shards} shards do not divide world_size={world_size}")
    return rank // (world_size // shards)


def qkv_output_slices(
    num_heads: int, num_kv_heads: int, head_size: int, world_size: int
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The unsharded q/k/v widths and each slice's number of shards, for GQA.

    Semantics:
        widths = (num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size)
        q has world_size shards; k and v have min(num_kv_heads, world_size), i.e.
        with fewer k/v heads than ranks each k/v head is replicated on several ranks.

    Returns:
        ``(output_slices, shards)``: e.g. 4 heads, 1 k/v head, size 2, tp 2 gives
        ``((8, 2, 2), (2, 1, 1))``.
    """
    if num_heads % world_size:
        raise ValueError(f"num_heads={num_heads} does not split over {world_size} ranks")
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"num_kv_heads={num_kv_heads} does not split over {world_size}")
        kv_shards = world_size
    else:
        if world_size % num_kv_heads:
            raise ValueError(f"{world_size} ranks do not replicate {num_kv_heads} k/v heads evenly")
        kv_shards = num_kv_heads
    q, kv = num_heads * head_size, num_kv_heads * head_size
    return (q, kv, kv), (world_size, kv_shards, kv_shards)


# -- the unsharded layer ---------------------------------------------------------------


@dataclass
class LoRALinear:
    """One unsharded linear layer with stacked LoRA weights: the full set every rank shards.

    Attributes:
        weight: ``[sum N_s, H]`` the base weight, its slices stacked by rows.
        lora_a: per slice ``[L, 1, r, H]``.
        lora_b: per slice ``[L, 1, N_s, r]``.
        lora_bias: per slice ``[L, 1, N_s]`` (an entry may be None), or None.
        output_slices: ``(N_0, N_1, ...)``, one width per packed slice.
        scale: the shrink's scale (vLLM folds the LoRA scaling into B and passes 1.0).
    """

    weight: torch.Tensor
    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]
    lora_bias: tuple[torch.Tensor | None, ...] | None
    output_slices: tuple[int, ...]
    scale: float = 1.0

    @classmethod
    def random(
        cls,
        output_slices: Sequence[int],
        hidden: int,
        rank: int,
        loras: int,
        *,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        bias: bool = True,
        scale: float = 1.0,
    ) -> LoRALinear:
        """Random weights on the CPU, reproducible from ``seed``; entries of about unit size."""
        gen = torch.Generator().manual_seed(seed)

        def normal(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(dtype)

        slices = tuple(int(n) for n in output_slices)
        return cls(
            weight=normal(sum(slices), hidden, std=hidden**-0.5),  # [sum N_s, H]
            lora_a=tuple(normal(loras, 1, rank, hidden, std=hidden**-0.5) for _ in slices),
            lora_b=tuple(normal(loras, 1, n, rank, std=rank**-0.5) for n in slices),
            lora_bias=tuple(normal(loras, 1, n, std=0.1) for n in slices) if bias else None,
            output_slices=slices,
            scale=scale,
        )

    @property
    def hidden(self) -> int:
        return self.weight.shape[1]

    @property
    def rank(self) -> int:
        return self.lora_a[0].shape[-2]

    @property
    def loras(self) -> int:
        return self.lora_a[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def to(self, device: torch.device | str) -> LoRALinear:
        """A copy with every tensor on ``device``."""
        bias = None if self.lora_bias is None else tuple(_to(b, device) for b in self.lora_bias)
        return replace(
            self,
            weight=self.weight.to(device),
            lora_a=tuple(a.to(device) for a in self.lora_a),
            lora_b=tuple(b.to(device) for b in self.lora_b),
            lora_bias=bias,
        )

    def __call__(self, wrapper: PunicaWrapperNumba, x: torch.Tensor) -> torch.Tensor:
        """The layer on one device: base GEMM, then the wrapper's LoRA.

        Semantics:
            x: [T, H]; returns y: [T, sum N_s] in the model dtype
            y = x @ W^T;  wrapper.add_lora_linear(y, x, A, B, bias, scale, output_slices)
        """
        y = x @ self.weight.T  # [T, sum N_s]
        wrapper.add_lora_linear(
            y, x, self.lora_a, self.lora_b, self.lora_bias, self.scale, self.output_slices
        )
        return y

    def reference(
        self, x: torch.Tensor, slots: Sequence[int], *, absolute: bool = False
    ) -> torch.Tensor:
        """The unsharded layer in float64, on the CPU: what every sharded layer must give.

        Semantics:
            y = x @ W^T, then per token t with l = slots[t] != -1 and slice s:
            y[t, c_s:c_s+N_s] += bias_s[l] + scale * (x[t] @ A_s[l]^T) @ B_s[l]^T
            absolute=True computes the same with |x|, |W|, |A|, |B|, |bias|, |scale|:
            the magnitude that error bounds are relative to.
        """
        f = (lambda t: t.detach().cpu().double().abs()) if absolute else _cpu64
        y = f(x) @ f(self.weight).T  # [T, sum N_s] fp64
        bias = None if self.lora_bias is None else [_maybe(f, b) for b in self.lora_bias]
        return reference_add_lora_linear(
            y,
            f(x),
            [f(a) for a in self.lora_a],
            [f(b) for b in self.lora_b],
            bias,
            abs(self.scale) if absolute else self.scale,
            self.output_slices,
            torch.tensor(list(slots), dtype=torch.int64),
        )


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().double()


def _maybe(f, t):
    return None if t is None else f(t)


# -- collectives -------------------------------------------------------------------------


def _on_backend(t: torch.Tensor, group) -> torch.Tensor:
    """gloo reduces CPU tensors: with gloo, a GPU tensor travels through the host."""
    if t.is_cuda and dist.get_backend(group) == "gloo":
        return t.cpu()
    return t


def all_reduce_(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t = sum over ranks of t``, in place, in ``t``'s dtype; returns ``t``."""
    if dist.get_world_size(group) == 1:
        return t
    moved = _on_backend(t, group)
    dist.all_reduce(moved, group=group)
    if moved is not t:
        t.copy_(moved)
    return t


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on all ranks), in rank order, on ``t``'s device."""
    if dist.get_world_size(group) == 1:
        return [t]
    moved = _on_backend(t.contiguous(), group)
    parts = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, moved, group=group)
    return [p.to(t.device) for p in parts]


# -- the layers -------------------------------------------------------------------------


def _split_slices(t: torch.Tensor, widths: Sequence[int], dim: int) -> list[torch.Tensor]:
    return list(torch.split(t, list(widths), dim=dim))


@dataclass
class ColumnParallelLinearWithLoRA:
    """Column-parallel LoRA (also merged gate_up and q/k/v): B sharded by output rows.

    Rank k holds, for every slice s, its shard of the output features: rows of W
    and of B_s (and of the bias), while A_s is replicated, since shrink needs all
    of the input features, which every rank has.

    Semantics:
        x: [T, H] (the same on every rank); A_s: [L, 1, r, H] (whole)
        B_s^k: [L, 1, N_s/tp, r]; bias_s^k: [L, 1, N_s/tp]; W^k: [sum_s N_s/tp, H]
        y^k = x @ (W^k)^T                                  # [T, sum_s N_s/tp]
        wrapper.add_lora_linear(y^k, x, A, B^k, bias^k, scale, (N_s/tp for s))
        gather_output: y = concat over s of concat over shards of y^k's slice s
                       -> [T, sum_s N_s], the unsharded layout
        No collective unless gathering: the next (row-parallel) layer takes y^k as is.

    Under GQA a k/v slice may have fewer shards than ranks (``shards[s]``); each
    shard is then held by ``tp / shards[s]`` neighbouring ranks (:func:`shard_index`).
    """

    wrapper: PunicaWrapperNumba
    rank: int
    world_size: int
    weight: torch.Tensor  # [sum_s N_s/shards_s, H]
    lora_a: tuple[torch.Tensor, ...]  # per slice [L, 1, r, H]
    lora_b: tuple[torch.Tensor, ...]  # per slice [L, 1, N_s/shards_s, r]
    lora_bias: tuple[torch.Tensor | None, ...] | None  # per slice [L, 1, N_s/shards_s]
    output_slices: tuple[int, ...]  # this rank's widths N_s/shards_s
    shards: tuple[int, ...]  # per slice: how many distinct shards (tp unless GQA replicas)
    scale: float = 1.0
    group: object = None

    @classmethod
    def from_full(
        cls,
        full: LoRALinear,
        wrapper: PunicaWrapperNumba,
        rank: int,
        world_size: int,
        *,
        shards: Sequence[int] | None = None,
        group=None,
    ):
        """Rank ``rank``'s layer, cut from the unsharded weights ``full``."""
        shards = tuple(shards) if shards is not None else (world_size,) * len(full.output_slices)
        if len(shards) != len(full.output_slices):
            raise ValueError(f"shards {shards} must have one entry per slice")
        index = [shard_index(rank, world_size, n) for n in shards]
        weights = _split_slices(full.weight, full.output_slices, dim=0)  # per slice [N_s, H]
        bias = None
        if full.lora_bias is not None:
            bias = tuple(
                None if b is None else shard(b, -1, i, n)
                for b, i, n in zip(full.lora_bias, index, shards)
            )
        return cls(
            wrapper=wrapper,
            rank=rank,
            world_size=world_size,
            weight=torch.cat([shard(w, 0, i, n) for w, i, n in zip(weights, index, shards)]),
            lora_a=cls._shard_lora_a(full.lora_a, rank, world_size),
            lora_b=tuple(shard(b, -2, i, n) for b, i, n in zip(full.lora_b, index, shards)),
            lora_bias=bias,
            output_slices=tuple(n_s // n for n_s, n in zip(full.output_slices, shards)),
            shards=shards,
            scale=full.scale,
            group=group,
        )

    @staticmethod
    def _shard_lora_a(lora_a, rank, world_size):
        return tuple(a.contiguous() for a in lora_a)  # replicated: every rank has all of A

    def __call__(self, x: torch.Tensor, *, gather_output: bool = False) -> torch.Tensor:
        """``y^k`` (``[T, sum_s N_s/tp]``), or the whole ``[T, sum_s N_s]`` when gathering."""
        y = x @ self.weight.T  # [T, sum_s N_s/tp], the base layer's shard
        self.wrapper.add_lora_linear(
            y, x, self.lora_a, self.lora_b, self.lora_bias, self.scale, self.output_slices
        )
        return self.gather(y) if gather_output else y

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's ``y^k`` and lay the columns out as the unsharded layer's.

        Semantics:
            parts = all_gather(y^k)                   # tp x [T, sum_s N_s/tp]
            y[:, slice s] = concat(parts[j * tp/shards_s][:, slice s] for j < shards_s)
        """
        parts = [_split_slices(p, self.output_slices, 1) for p in all_gather(y, self.group)]
        columns = []
        for s, n in enumerate(self.shards):
            replicas = self.world_size // n
            columns += [parts[j * replicas][s] for j in range(n)]  # one holder per shard
        return torch.cat(columns, dim=1)  # [T, sum_s N_s]


@dataclass
class ColumnParallelLinearWithShardedLoRA(ColumnParallelLinearWithLoRA):
    """Fully sharded column-parallel LoRA: A sharded by its rank, B by output rows.

    Rank k holds ``r/tp`` rows of every A_s, so each rank computes only its part
    of the shrink; an all-gather of the small fp32 buffer then gives every rank
    the whole ``[S, T, r]`` buffer for its shard of the expand (S-LoRA's scheme).

    Semantics:
        x: [T, H]; A_s^k: [L, 1, r/tp, H] (rows k*r/tp ..); B_s^k: [L, 1, N_s/tp, r]
        y^k = x @ (W^k)^T                                    # [T, sum_s N_s/tp]
        buf^k = zeros([S, T, r/tp], fp32)
        wrapper.add_shrink(buf^k, x, A^k, scale)             # buf^k[s, t] = scale x[t] A_s^k[l]^T
        buf = concat(all_gather(buf^k), dim=-1)              # [S, T, r] fp32
        wrapper.add_expand(y^k, buf, B^k, bias^k, (N_s/tp for s), offset_start=0)
        Traffic: the all-gather moves S*T*r fp32 values instead of sharding nothing.
    """

    @staticmethod
    def _shard_lora_a(lora_a, rank, world_size):
        return tuple(shard(a, -2, rank, world_size) for a in lora_a)  # [L, 1, r/tp, H]

    def __call__(self, x: torch.Tensor, *, gather_output: bool = False) -> torch.Tensor:
        y = x @ self.weight.T  # [T, sum_s N_s/tp]
        rank_part = self.lora_a[0].shape[-2]  # r/tp
        buffer = torch.zeros(
            len(self.lora_a), x.shape[0], rank_part, dtype=torch.float32, device=x.device
        )  # [S, T, r/tp] fp32
        self.wrapper.add_shrink(buffer, x, self.lora_a, self.scale)
        buffer = torch.cat(all_gather(buffer, self.group), dim=-1)  # [S, T, r] fp32
        self.wrapper.add_expand(
            y, buffer, self.lora_b, self.lora_bias, self.output_slices, offset_start=0
        )
        return self.gather(y) if gather_output else y


def _single_slice(full: LoRALinear, what: str) -> None:
    if len(full.output_slices) != 1:
        raise ValueError(f"{what} takes one slice, got output_slices={full.output_slices}")


@dataclass
class RowParallelLinearWithLoRA:
    """Row-parallel LoRA: A sharded by input columns, B whole; LoRA rides the all-reduce.

    Rank k holds a slice of the input features (the previous column-parallel
    layer's output shard), the matching columns of W and A, and all of B. Its
    LoRA partial ``B (scale A^k x^k)`` is added to its base partial before the one
    all-reduce, which sums both: ``sum_k B A^k x^k = B A x`` because B is linear.

    Semantics:
        x^k: [T, H/tp]; W^k: [N, H/tp]; A^k: [L, 1, r, H/tp]; B: [L, 1, N, r]
        y^k = x^k @ (W^k)^T                                  # [T, N], a partial sum
        wrapper.add_lora_linear(y^k, x^k, A^k, B, bias if k == 0 else None, scale, (N,))
        y = all_reduce(y^k)                                  # [T, N], in the model dtype
        The bias is added on rank 0 only, so the all-reduce counts it once.
    """

    wrapper: PunicaWrapperNumba
    rank: int
    world_size: int
    weight: torch.Tensor  # [N, H/tp]
    lora_a: tuple[torch.Tensor, ...]  # ([L, 1, r, H/tp],)
    lora_b: tuple[torch.Tensor, ...]  # ([L, 1, N, r],)  (sharded by rows in the sharded variant)
    lora_bias: tuple[torch.Tensor | None, ...] | None
    output_slices: tuple[int, ...]  # (N,), or (N/tp,) in the sharded variant
    scale: float = 1.0
    group: object = None

    @classmethod
    def from_full(
        cls,
        full: LoRALinear,
        wrapper: PunicaWrapperNumba,
        rank: int,
        world_size: int,
        *,
        group=None,
    ):
        """Rank ``rank``'s layer, cut from the unsharded weights ``full`` (one slice)."""
        _single_slice(full, cls.__name__)
        lora_b, bias, slices = cls._shard_lora_b(full, rank, world_size)
        return cls(
            wrapper=wrapper,
            rank=rank,
            world_size=world_size,
            weight=shard(full.weight, 1, rank, world_size),  # [N, H/tp]
            lora_a=tuple(shard(a, -1, rank, world_size) for a in full.lora_a),
            lora_b=lora_b,
            lora_bias=bias,
            output_slices=slices,
            scale=full.scale,
            group=group,
        )

    @staticmethod
    def _shard_lora_b(full: LoRALinear, rank: int, world_size: int):
        bias = full.lora_bias if rank == 0 else None  # added once, by rank 0
        return tuple(b.contiguous() for b in full.lora_b), bias, full.output_slices

    def input_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's input features ``x^k = x[:, k*H/tp : (k+1)*H/tp]``."""
        return shard(x, -1, self.rank, self.world_size)

    def __call__(self, x: torch.Tensor, *, input_is_parallel: bool = True) -> torch.Tensor:
        """The whole output ``[T, N]`` on every rank; ``x`` is ``x^k`` unless told otherwise."""
        x = x if input_is_parallel else self.input_shard(x)  # [T, H/tp]
        y = x @ self.weight.T  # [T, N] partial sum
        self.wrapper.add_lora_linear(
            y, x, self.lora_a, self.lora_b, self.lora_bias, self.scale, self.output_slices
        )
        return all_reduce_(y, self.group)


@dataclass
class RowParallelLinearWithShardedLoRA(RowParallelLinearWithLoRA):
    """Fully sharded row-parallel LoRA: A by input columns, B by output rows.

    The shrink gives each rank a partial ``[1, T, r]`` fp32 buffer (its input
    columns only); an all-reduce of that small buffer completes it. Each rank then
    expands its B shard into *its own* output columns of the base partial, at
    ``offset_start = k * N/tp``; the layer's one all-reduce of y then sums base
    partials and assembles the LoRA columns in the same step.

    Semantics:
        x^k: [T, H/tp]; A^k: [L, 1, r, H/tp]; B^k: [L, 1, N/tp, r]; bias^k: [L, 1, N/tp]
        y^k = x^k @ (W^k)^T                                  # [T, N] partial sum
        buf = zeros([1, T, r], fp32); wrapper.add_shrink(buf, x^k, A^k, scale)
        buf = all_reduce(buf)                                # [1, T, r] fp32: scale x A^T
        wrapper.add_expand(y^k, buf, B^k, bias^k, (N/tp,), offset_start=k * N/tp)
        y = all_reduce(y^k)                                  # [T, N]
    """

    @staticmethod
    def _shard_lora_b(full: LoRALinear, rank: int, world_size: int):
        lora_b = tuple(shard(b, -2, rank, world_size) for b in full.lora_b)  # [L, 1, N/tp, r]
        bias = None
        if full.lora_bias is not None:
            bias = tuple(
                _maybe(lambda b: shard(b, -1, rank, world_size), b) for b in full.lora_bias
            )
        return lora_b, bias, tuple(n // world_size for n in full.output_slices)

    def __call__(self, x: torch.Tensor, *, input_is_parallel: bool = True) -> torch.Tensor:
        x = x if input_is_parallel else self.input_shard(x)  # [T, H/tp]
        y = x @ self.weight.T  # [T, N] partial sum
        rank_dim = self.lora_a[0].shape[-2]
        buffer = torch.zeros(1, x.shape[0], rank_dim, dtype=torch.float32, device=x.device)
        self.wrapper.add_shrink(buffer, x, self.lora_a, self.scale)  # [1, T, r] partial
        all_reduce_(buffer, self.group)  # [1, T, r] fp32, whole
        shard_width = self.output_slices[0]  # N/tp
        self.wrapper.add_expand(
            y,
            buffer,
            self.lora_b,
            self.lora_bias,
            self.output_slices,
            offset_start=self.rank * shard_width,
        )
        return all_reduce_(y, self.group)


#: The layer kinds by name, as :class:`LayerCase` names them.
LAYER_KINDS = {
    "column": ColumnParallelLinearWithLoRA,
    "column_sharded": ColumnParallelLinearWithShardedLoRA,
    "row": RowParallelLinearWithLoRA,
    "row_sharded": RowParallelLinearWithShardedLoRA,
}


def wrapper_for_slots(
    slots: Sequence[int], loras: int, device: torch.device | str | None = None
) -> PunicaWrapperNumba:
    """A wrapper whose mapping puts token t on slot ``slots[t]`` (-1: no LoRA).

    Adapter id ``l + 1`` sits in slot ``l``, so the slots are the ids minus one.
    """
    device = device_of() if device is None else device
    wrapper = PunicaWrapperNumba(max(len(slots), 1), 1, device, max_loras=loras)
    ids = [s + 1 for s in slots]  # id 0 = no LoRA
    mapping = LoRAMapping(index_mapping=ids, prompt_mapping=ids)
    wrapper.update_metadata(mapping, list(range(1, loras + 1)), loras + 1, 32000, 0)
    return wrapper


# -- running on several ranks ------------------------------------------------------------


@dataclass
class LayerCase:
    """One sharded layer to run on every rank, and the unsharded weights it is cut from.

    Attributes:
        kind: a key of :data:`LAYER_KINDS`.
        layer: the unsharded layer.
        x: ``[T, H]`` the whole input (row layers take their shard of it).
        slots: each token's slot, -1 for none.
        shards: per slice, the number of distinct shards (column kinds; None = tp each).
    """

    kind: str
    layer: LoRALinear
    x: torch.Tensor
    slots: tuple[int, ...]
    shards: tuple[int, ...] | None = None

    def build(self, wrapper: PunicaWrapperNumba, rank: int, world_size: int, device=None):
        """This rank's sharded layer, with its weights on ``device``."""
        full = self.layer.to(device) if device is not None else self.layer
        cls = LAYER_KINDS[self.kind]
        if self.kind.startswith("column"):
            return cls.from_full(full, wrapper, rank, world_size, shards=self.shards)
        return cls.from_full(full, wrapper, rank, world_size)

    def run(self, rank: int, world_size: int, device=None) -> torch.Tensor:
        """The layer's whole output ``[T, sum N_s]`` on this rank (column outputs gathered)."""
        device = device_of() if device is None else device
        wrapper = wrapper_for_slots(self.slots, self.layer.loras, device)
        layer = self.build(wrapper, rank, world_size, device)
        x = self.x.to(device)
        if self.kind.startswith("column"):
            return layer(x, gather_output=True)
        return layer(x, input_is_parallel=False)


def layer_cases_worker(rank: int, world_size: int, cases: Sequence[LayerCase]) -> list:
    """Run every case on this rank; the whole outputs, on the CPU, in case order."""
    return [case.run(rank, world_size).cpu() for case in cases]


def run_layer_cases(
    cases: Sequence[LayerCase],
    world_size: int = 2,
    *,
    backend: str | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> list[list[torch.Tensor]]:
    """Run the cases on ``world_size`` spawned ranks; ``result[rank][case]`` is an output."""
    return run_on_ranks(
        layer_cases_worker, world_size, args=(list(cases),), backend=backend, timeout=timeout
    )


class RankError(RuntimeError):
    """A rank of :func:`run_on_ranks` failed; the message holds its traceback."""


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, gloo otherwise."""
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    return "nccl" if gpus >= world_size else "gloo"


def free_port() -> int:
    """A TCP port on localhost that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(
    worker: Callable,
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> list:
    """Run ``worker(rank, world_size, *args)`` in one fresh process per rank; return the results.

    Semantics:
        for each rank, in a new process (start method ``spawn``, so nothing of this
        process's state is inherited):
            init_process_group(backend, tcp://127.0.0.1:<free port>, rank, world_size)
            results[rank] = worker(rank, world_size, *args)   # tensors moved to the CPU
        return results                                        # list, in rank order

    ``worker`` and ``args`` must be picklable: a module-level function of an
    importable module (not one defined in a notebook or ``__main__``). With NCCL,
    rank k uses GPU k, and ``NCCL_NVLS_ENABLE=0`` is set in each rank.

    Raises:
        RankError: a rank raised or died; every failed rank's traceback (or exit
            code) is in the message, and the other ranks are terminated rather
            than left waiting in a collective.
        TimeoutError: the ranks ran past ``timeout`` seconds; they are terminated.
    """
    backend = default_backend(world_size) if backend is None else backend
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="punica_numba_ranks_") as tmp:
        folder = Path(tmp)
        with open(folder / "task.pkl", "wb") as f:
            pickle.dump((worker, tuple(args)), f)
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, world_size, backend, init_method, str(folder)),
                name=f"punica_numba rank {rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        try:
            _wait(processes, folder, timeout)
        finally:
            _stop(processes)
        results = []
        for rank in range(world_size):
            with open(folder / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _wait(processes, folder: Path, timeout: float) -> None:
    """Wait for every process; on the first failure or the deadline, raise."""
    deadline = time.monotonic() + timeout
    running = list(processes)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{len(running)} of {len(processes)} ranks still ran after {timeout:.0f} s"
                + _failures(processes, folder)
            )
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=min(left, 1.0))
        for p in list(running):
            if p.exitcode is None:
                continue
            running.remove(p)
            if p.exitcode != 0:
                _stop(running, grace=2.0)  # a peer may be failing too: let it write its error
                raise RankError(_failures(processes, folder).lstrip())


def _failures(processes, folder: Path) -> str:
    """Every failed rank's traceback, or its exit code when it left none."""
    lines = []
    for rank, p in enumerate(processes):
        error = folder / f"rank{rank}.err"
        if error.exists():
            lines.append(f"\nrank {rank} of {len(processes)} failed:\n{error.read_text()}")
        elif p.exitcode == -signal.SIGTERM:
            lines.append(f"\nrank {rank} of {len(processes)} was stopped (another rank failed)")
        elif p.exitcode not in (None, 0):
            lines.append(f"\nrank {rank} of {len(processes)} died with exit code {p.exitcode}")
    return "".join(lines)


def _stop(processes, grace: float = 0.0) -> None:
    """End the given processes (ours), first politely, then for sure."""
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _rank_main(rank: int, world_size: int, backend: str, init_method: str, folder: str) -> None:
    """The body of one rank's process (see :func:`run_on_ranks`)."""
    out = Path(folder)
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif not torch.cuda.is_available():
            torch.set_num_threads(1)  # the ranks share the CPU cores
        with open(out / "task.pkl", "rb") as f:
            worker, args = pickle.load(f)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        result = _to_cpu(worker(rank, world_size, *args))
        with open(out / f"rank{rank}.pkl.part", "wb") as f:
            pickle.dump(result, f)
        os.replace(out / f"rank{rank}.pkl.part", out / f"rank{rank}.pkl")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no atexit handlers: they could wait on peers that never come


def _to_cpu(value):
    """Tensors anywhere in lists, tuples and dicts, moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value
