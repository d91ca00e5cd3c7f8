"""``lora_shrink`` and ``lora_expand`` with vLLM v0.9's signatures: check, choose, launch.

The six metadata arguments are what ``LoRAKernelMeta.meta_args(T)`` returns, so
vLLM-style code reads the same::

    lora_shrink(x, [A], buffer, *meta.meta_args(T), scale)
    lora_expand(buffer, [B], y, *meta.meta_args(T), offset_start=0, add_inputs=True)

Every argument is checked before anything is launched; a rejected call changes
nothing. Kernels run on torch's current stream, on the GPU or, without one, on
Numba's CUDA simulator (the same kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ._checks import (
    Stack,
    check_bool,
    check_int,
    check_real,
    check_same_device,
    check_sequence,
    check_stack,
    check_tensor,
)
from ._cuda import KERNEL_DTYPES, SIMULATOR, KernelLauncher, pack_tensors
from .kernels import (
    COMPILED_WORDS,
    MAX_SLICES,
    MAX_WORDS_PER_THREAD,
    build_expand_kernel,
    build_lanes_expand_kernel,
    build_mma_expand_kernel,
    build_mma_shrink_kernel,
    build_shrink_kernel,
    build_tiled_expand_kernel,
    build_token_shrink_kernel,
    splits,
)
from .kernels.dtypes import packing
from .kernels.mma import MMA_DTYPES
from .kernels.segments import tile_grid_bound, tile_table, tile_tokens
from .launch import LaunchConfig, choose_launch_config
from .meta import host_facts_of

__all__ = [
    "lora_shrink",
    "lora_expand",
    "prepare_shrink",
    "prepare_expand",
]

_INDEX_DTYPES = (torch.int32,)

#: CUDA's limit on gridDim.y and gridDim.z. The kernels stride over rank and column
#: groups by gridDim.z, so a capped grid still covers every group.
MAX_GRID_YZ = 65535


def _weights(name: str, weights) -> list[Stack]:
    """Check a list of stacked LoRA weights of one dtype; return them as :class:`Stack`\\ s
    (their ``[L, N, K]`` views, and a place to keep what a launch works out about them)."""
    check_sequence(name, weights)
    stacks = []
    for s, w in enumerate(weights):
        stacks.append(check_stack(name, w, s))
        if w.dtype != weights[0].dtype:
            raise TypeError(f"{name}[{s}] is {w.dtype} but {name}[0] is {weights[0].dtype}")
    return stacks


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
) -> bool:
    """Check the six metadata arguments for ``num_rows`` activation rows and weights of
    ``num_loras`` slots. Return True when no token has a LoRA (nothing to launch)."""
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
        # so read its largest slot and its token count back (one sync) rather than
        # let a kernel read weights or rows that do not exist.
        largest, counted = (
            torch.stack([lora_ids.max().to(torch.int64), num_tokens_per_lora.sum()]).tolist()
            if lora_ids.numel()
            else (-1, 0)
        )
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
    return bool(no_lora_flag_cpu.item())


@functools.cache
def _launcher(kernel) -> KernelLauncher:
    """One launcher per compiled kernel: it remembers the kernel's raw parameter layout."""
    return KernelLauncher(kernel)


#: The largest rank the tensor-core kernels take (their fragments of a whole rank sit in
#: registers: the shrink's outputs, the expand's buffer rows).
MMA_MAX_RANK = 64


def _expand_kernel(
    config: LaunchConfig,
    x_dtype,
    w_dtype,
    out_dtype,
    packed: bool,
    words: int,
    wide: bool,
    one_slot: bool = False,
):
    """The FFMA expand kernel ``config`` names, compiled (once) for these dtypes, B packed
    or not, ``words`` per row of B, (packed) whether B's rows start at multiples of 16
    bytes, and (lane-split) whether it loads B before the slot (:func:`_one_slot`). The row
    kernel compiles a row's length in only up to :data:`~.kernels.COMPILED_WORDS` words
    (past it, reads it at run time)."""
    if config.kernel == "lanes":
        return build_lanes_expand_kernel(
            x_dtype,
            w_dtype,
            out_dtype,
            config.threads,
            config.tile_m,
            config.vec,
            packed,
            words,
            wide,
            one_slot,
        )
    if config.kernel == "tiled":
        return build_tiled_expand_kernel(
            x_dtype,
            w_dtype,
            out_dtype,
            config.threads,
            config.tile_m,
            config.tile_n,
            *config.micro,
            config.chunk,
            packed,
        )
    words = words if words <= COMPILED_WORDS else 0
    return build_expand_kernel(
        x_dtype, w_dtype, out_dtype, config.threads, config.tile_m, packed, config.vec, words
    )


def _one_slot(op: str, config: LaunchConfig, num_loras: int, facts) -> bool:
    """Whether blocks of ``config`` take their tokens in their own order and load the
    weights before they know the tokens' slots: where the weight stacks hold one slot
    (``kernels.shrink``, "One slot"), for the row shrink and the lane-split expand with
    a token a block and for the tensor-core expand (``kernels.expand_mma``, "One slot"),
    and only on ``LoRAKernelMeta``'s metadata (``facts``), whose ``token_lora_mapping``
    the kernel then reads: it agrees with the segments by construction, and holds -1
    past the prepared tokens."""
    if facts is None or num_loras != 1:
        return False
    if op == "expand" and config.kernel == "mma":
        return True
    kernel = {"shrink": "rows", "expand": "lanes"}[op]
    return config.kernel == kernel and config.tile_m == 1


def _token_rows(packed: bool, words: int, threads: int, rank: int) -> bool:
    """Whether a one-slot row shrink can take the one-token kernel
    (:mod:`.kernels.shrink_token`): rows of packed words, at most
    :data:`~.kernels.shrink_token.MAX_WORDS_PER_THREAD` of them a thread, and a block
    for every rank."""
    return packed and -(-words // threads) <= MAX_WORDS_PER_THREAD and rank <= MAX_GRID_YZ


def _check_devices_and_metadata(
    inputs, output_tensor, weights, weights_name: str, num_rows: int, num_loras: int, metadata
) -> bool:
    """The checks shrink and expand share: one device for the tensors, and metadata that
    fits ``num_rows`` rows and ``num_loras`` slots. True when no token has a LoRA."""
    check_same_device(
        {
            "inputs": inputs,
            "output_tensor": output_tensor,
            **{f"{weights_name}[{s}]": w.view for s, w in enumerate(weights)},
        }
    )
    return _check_metadata(num_rows, num_loras, weights_name, inputs.device, *metadata)


def _tiles(num_tokens: int, metadata: tuple, op: str, config: LaunchConfig, facts) -> tuple:
    """The tile table for ``config.tile_m``, each tile's tokens (``[B, tile_m]``,
    :func:`.kernels.segments.tile_tokens`; None unless the kernel reads them,
    :meth:`~punica_numba.launch.LaunchConfig.reads_tile_tokens`) and the number of blocks
    along the tile axis.

    The table is the metadata's own when it is a ``LoRAKernelMeta`` (refreshed when it
    prepared the mapping); otherwise it is made now, on the device, without a sync.
    On the GPU the grid is the bound of :func:`tile_grid_bound`, which needs no look
    at the device (a launch can be captured in a CUDA graph); surplus blocks exit at
    once (on the H200 a grid of exactly the tiles was no faster: at r=64, 256 tokens over
    16 LoRAs, 0.6-0.8 µs slower; benchmarks README, session 32). On the simulator the
    table sits in host memory and an idle block would still cost a Python thread per
    CUDA thread, so the grid is exact.
    """
    _, sorted_tokens, counts, starts, lora_ids, _ = metadata
    tile_m, with_tokens = config.tile_m, config.reads_tile_tokens(op)
    blocks = tile_grid_bound(num_tokens, lora_ids.shape[0], tile_m)
    table = facts.tile_tables.get(tile_m) if facts is not None else None
    tokens = facts.tile_tokens.get(tile_m) if facts is not None and with_tokens else None
    if table is None or table.shape[0] < blocks:
        table = tile_table(lora_ids, counts, starts, sorted_tokens, tile_m, blocks)
        tokens = tile_tokens(table, sorted_tokens, tile_m) if with_tokens else None
    if SIMULATOR:
        blocks = int((table[:blocks, 0] >= 0).sum())
    return table, tokens, blocks


def _kernel_metadata(tensors: tuple, facts, key) -> tuple:
    """What the kernels read of the metadata: the tile table, and the sorted tokens or
    each tile's tokens (:func:`_tiles`); ``key`` names the pair.

    A ``LoRAKernelMeta``'s tensors are fixed buffers (a step refills them in place), and
    the wrapper hands the same tensor objects to every call of a step; then they are
    described for the launcher once (:func:`~punica_numba._cuda.pack_tensors`) and
    reused while the same objects come back.
    """
    if SIMULATOR or facts is None:
        return tensors
    known = facts.kernel_metadata.get(key)
    if known is None or any(a is not b for a, b in zip(known.tensors, tensors)):
        known = facts.kernel_metadata[key] = pack_tensors(tensors)
    return (known,)


def _block_work(
    op: str, config: LaunchConfig, num_tokens: int, metadata: tuple, facts, one_slot: bool
) -> tuple:
    """``(blocks, meta)``: the blocks along the grid's x and the metadata arguments a
    kernel of ``config`` reads to find its work. Under one slot (:func:`_one_slot`) a
    block per ``config.tile_m`` tokens in their own order, which reads their slots from
    ``token_lora_mapping``; else the tile table (:func:`_tiles`) with the sorted tokens,
    or with each tile's tokens for the kernels that read those."""
    if one_slot:
        blocks = -(-num_tokens // config.tile_m)
        return blocks, _kernel_metadata((metadata[0], metadata[1]), facts, "mapping")
    table, tokens, blocks = _tiles(num_tokens, metadata, op, config, facts)
    if config.reads_tile_tokens(op):  # each tile's tokens, from a row of their own
        return blocks, _kernel_metadata((table, tokens), facts, (config.tile_m, "rows"))
    return blocks, _kernel_metadata((table, metadata[1]), facts, config.tile_m)


def _weight_forms(weights: Sequence[Stack]) -> list[tuple]:
    """Each weight as a kernel can take it: ``(words, elements)``, its packed int64 words
    (None when its rows do not allow them) and its view, each a kernel argument.

    On the GPU both are worked out once per checked weight, described for the launcher
    once (:func:`~punica_numba._cuda.pack_tensors`) and kept in ``Stack.launch``: a
    checked view's memory and layout never change, and a serving engine hands the same
    weights to every call (``check_stack`` returns the same Stack for them).
    """
    if SIMULATOR:
        return [(_words(w.view), w.view) for w in weights]
    forms = []
    for w in weights:
        form = w.launch.get("forms")
        if form is None:
            words = _words(w.view)
            form = w.launch["forms"] = (
                None if words is None else pack_tensors((words,)),
                pack_tensors((w.view,)),
            )
        forms.append(form)
    return forms


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as int64 words (8 bytes: four fp16/bf16 or two fp32 elements); None
    when its rows are not whole, aligned words."""
    if t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 8 or not _rows_start_at(t, 8):
        return None
    return t.view(torch.int64)


def _rows_start_at(t: torch.Tensor, multiple: int) -> bool:
    """Whether every row of ``t`` starts at a multiple of ``multiple`` bytes."""
    size = t.element_size()
    return t.data_ptr() % multiple == 0 and all(s * size % multiple == 0 for s in t.stride()[:-1])


def _mma_shrink_operands(inputs: torch.Tensor, weights: Sequence[Stack]) -> tuple | None:
    """The tensor-core shrink's operands ``(x, weights, wide)``: x and A as int64 words
    of four elements, and whether all their rows start at multiples of 16 bytes (the
    kernel's 16-byte loads); or None when it cannot take the call: x and A fp16 or bf16,
    rank <= :data:`MMA_MAX_RANK`, a hidden size that is a multiple of 8, rows of whole,
    aligned words (:mod:`.kernels.shrink_mma`)."""
    if inputs.dtype not in MMA_DTYPES or weights[0].rows > MMA_MAX_RANK or inputs.shape[1] % 8:
        return None
    x = _words(inputs)
    words = _weight_words(weights) if x is not None else None
    if words is None:
        return None
    wide = all(_rows_start_at(t, 16) for t in (inputs, *(w.view for w in weights)))
    return x, words, wide


def _weight_words(weights: Sequence[Stack]) -> list | None:
    """Each weight's int64 words (as :func:`_weight_forms` keeps them), or None when one of
    them has none."""
    words = [w for w, _ in _weight_forms(weights)]
    return None if any(w is None for w in words) else words


def _mma_expand_operands(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    words: list | None,
    output: torch.Tensor,
    columns: list[int],
) -> tuple | None:
    """The tensor-core expand's operands ``(x, words, out, wide, wide_x, wide_b)``, or None
    when it cannot take the call; ``wide``: the output can be read and written in 16-byte words
    (its rows start at multiples of 16 bytes, every slice's first column and width are
    multiples of 8); ``wide_x``: the buffer in 16-byte loads (fp32, a rank that is a
    multiple of 16, contiguous rows that start at multiples of 16 bytes); ``wide_b``: B
    in 16-byte loads (a rank that is a multiple of 32, rows at multiples of 16 bytes).
    It takes bf16 B and output, a buffer of fp32 (split in two bf16 halves) or
    bf16 (as its int16 bits), 0 < rank <= :data:`MMA_MAX_RANK`, B rows of whole int64 words
    (four elements: ``words``, from :func:`_weight_words`, None where there are none), and
    an output it can read and write in words of four columns: every slice's first column
    and width a multiple of 4 (:mod:`.kernels.expand_mma`)."""
    if (
        weights[0].dtype != torch.bfloat16
        or output.dtype != torch.bfloat16
        or inputs.dtype not in (torch.float32, torch.bfloat16)
        or not 0 < weights[0].cols <= MMA_MAX_RANK
        or any(c % 4 or w.rows % 4 for c, w in zip(columns, weights))
    ):
        return None
    out = _words(output)
    if words is None or out is None:
        return None
    x = inputs if inputs.dtype == torch.float32 else inputs.view(torch.int16)
    wide = _rows_start_at(output, 16) and all(
        c % 8 == 0 and w.rows % 8 == 0 for c, w in zip(columns, weights)
    )
    wide_x = (
        inputs.dtype == torch.float32
        and weights[0].cols % 16 == 0
        and inputs.stride(-1) == 1
        and _rows_start_at(inputs, 16)
    )
    wide_b = weights[0].cols % 32 == 0 and all(_rows_start_at(w.view, 16) for w in weights)
    return x, words, out, wide, wide_x, wide_b


def _nothing() -> None:
    """The launch of a call that has nothing to do (no LoRA token, or empty sizes)."""


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
    scaling: float,
) -> Callable[[], None]:
    """Check the arguments of :func:`lora_shrink` and return the launch, not yet run.

    Splitting the check from the launch lets a caller that launches several kernels
    (the wrapper's ``add_lora_linear``) check all of them before it changes anything.
    """
    check_tensor("inputs", inputs, ndim=2, dtypes=KERNEL_DTYPES, contiguous=True)
    weights = _weights("lora_a_weights", lora_a_weights)
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
    metadata = (
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
    )
    no_lora = _check_devices_and_metadata(
        inputs, output_tensor, weights, "lora_a_weights", num_tokens, num_loras, metadata
    )
    if no_lora or num_tokens == 0 or rank == 0:
        return _nothing
    return _shrink_launch(inputs, weights, output_tensor, metadata, scaling)


def _shrink_launch(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output_tensor: torch.Tensor,
    metadata: tuple,
    scaling: float,
    accumulate: bool = True,
) -> Callable[[], None]:
    """The launch of a shrink whose arguments are already checked (by :func:`prepare_shrink`
    or the wrapper): ``inputs`` [T, H] contiguous, ``weights`` Stacks of [L, r, H] of its
    dtype, ``output_tensor`` [>= S, T, r], ``metadata`` vLLM's six tensors fitting T rows
    and L slots, at least one token with a LoRA, T > 0 and r > 0. ``scaling`` is a float.

    ``accumulate=False`` stores the products instead of adding them: for a buffer the
    wrapper made for one call (``torch.empty``), which saves filling it with zeros."""
    num_tokens, rank = inputs.shape[0], weights[0].rows
    meta_facts = host_facts_of(metadata[4])
    active = meta_facts and meta_facts.active_slots
    slices = len(weights)
    config = choose_launch_config("shrink", num_tokens, active, rank, True, slices)
    operands, one_slot = None, False
    if config.kernel == "mma":
        operands = _mma_shrink_operands(inputs, weights)
        if operands is None:  # the tensor cores cannot take this call
            config = choose_launch_config("shrink", num_tokens, active, rank, False, slices)
    if operands is not None:
        x, weights, wide = operands
        # One block per group of tile_n ranks (0: every rank), along grid.y.
        rank_groups = -(-rank // config.tile_n) if config.tile_n else 1
        kernel = build_mma_shrink_kernel(
            inputs.dtype,
            output_tensor.dtype,
            config.threads,
            config.tile_m // 16,
            -(-min(rank, config.tile_n or rank) // 8),  # 8-rank tiles of one rank group
            accumulate,
            wide,
        )
    else:
        # Rank groups over grid.z (the kernel strides by gridDim.z), or looped in a block.
        groups = -(-rank // config.tile_n)
        rank_groups = min(groups, MAX_GRID_YZ) if config.spread else 1
        # Packed 8-byte words when x and every A allow it; else one element at a time.
        x_words, w_words = _words(inputs), _weight_words(weights)
        packed = x_words is not None and w_words is not None
        x = x_words if packed else inputs
        one_slot = _one_slot("shrink", config, weights[0].num_loras, meta_facts)
        weights = w_words if packed else [elements for _, elements in _weight_forms(weights)]
        if one_slot and _token_rows(packed, x.shape[1], config.threads, rank):
            # A token and a rank a block, the row's words compiled in (kernels.shrink_token).
            config = dataclasses.replace(config, tile_n=1, spread=True)
            rank_groups = rank
            kernel = build_token_shrink_kernel(
                inputs.dtype, output_tensor.dtype, config.threads, x.shape[1], accumulate
            )
        else:
            kernel = build_shrink_kernel(
                inputs.dtype,
                output_tensor.dtype,
                config.threads,
                config.tile_m,
                config.tile_n,
                packed,
                accumulate,
                # A block a group, without a run-time loop step (shrink's "One pass"),
                # where the grid has a block for every group and a thread holds few words.
                config.spread and rank_groups == groups and config.tile_n <= 4,
                one_slot,
            )
    blocks, meta = _block_work("shrink", config, num_tokens, metadata, meta_facts, one_slot)
    launcher = _launcher(kernel)
    scaling32 = np.float32(scaling)

    def launch() -> None:
        if blocks == 0:
            return
        for base in range(0, len(weights), MAX_SLICES):
            chunk = list(weights[base : base + MAX_SLICES])
            count = len(chunk)
            chunk += [chunk[0]] * (MAX_SLICES - count)  # unused slots: never read
            if operands is not None:  # a tile's slices side by side along x
                grid = (blocks * count, rank_groups, 1)
                args = (x, *chunk, output_tensor, base, count)
            else:
                grid, args = (blocks, count, rank_groups), (x, *chunk, output_tensor, base)
            launcher(grid, config.threads, (*args, *meta, scaling32))

    launch.config = config  # what was chosen (the benchmark reports it)
    return launch


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
    scaling: float,
) -> None:
    """Shrink: ``output[s, t] += scaling * inputs[t] @ A_s[slot(t)]^T`` for every token with a LoRA.

    Semantics:
        inputs: [T, H] fp16 / bf16 / fp32, contiguous
        lora_a_weights[s]: [L, r, H] or [L, 1, r, H], the dtype of inputs, contiguous
        output_tensor: [>= S, T, r] floating (fp32 in practice), contiguous; modified in place
        for s, t with l = slot(t) != -1:
            output[s, t, :] += scaling * sum_k inputs[t, k] * A_s[l, :, k]   (fp32 accumulation)
        Rows of tokens without a LoRA, and slices past S, are untouched. Deterministic:
        no atomics, so the same inputs give the same bits on every run.

    Memory traffic: reads T*H + (active slots)*S*r*H elements; reads and writes S*T*r.

    Raises:
        TypeError: a dtype the kernels do not take, or mismatched dtypes.
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
        scaling,
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
    offset_start: int = 0,
    add_inputs: bool = False,
) -> Callable[[], None]:
    """Check the arguments of :func:`lora_expand` and return the launch, not yet run."""
    check_tensor("inputs", inputs, ndim=3, dtypes=KERNEL_DTYPES)
    weights = _weights("lora_b_weights", lora_b_weights)
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
    metadata = (
        token_lora_mapping,
        token_indices_sorted_by_lora_ids,
        num_tokens_per_lora,
        lora_token_start_loc,
        lora_ids,
        no_lora_flag_cpu,
    )
    no_lora = _check_devices_and_metadata(
        inputs, output_tensor, weights, "lora_b_weights", num_tokens, num_loras, metadata
    )
    if no_lora or num_tokens == 0 or sum(widths) == 0:
        return _nothing
    return _expand_launch(inputs, weights, output_tensor, metadata, offset_start, add_inputs)


def _expand_launch(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    output_tensor: torch.Tensor,
    metadata: tuple,
    offset_start: int,
    add_inputs: bool,
) -> Callable[[], None]:
    """The launch of an expand whose arguments are already checked (by :func:`prepare_expand`
    or the wrapper): ``inputs`` [>= S, T, r], ``weights`` Stacks of [L, N_s, r],
    ``output_tensor`` [T, >= offset_start + sum(N_s)] contiguous, ``metadata`` vLLM's six
    tensors fitting T rows and L slots, at least one token with a LoRA, T > 0 and
    sum(N_s) > 0."""
    num_tokens = inputs.shape[1]
    widths = [w.rows for w in weights]
    meta_facts = host_facts_of(metadata[4])
    dtype, rank = weights[0].dtype, weights[0].cols
    columns = [offset_start + sum(widths[:s]) for s in range(len(widths))]  # c_s
    active = meta_facts and meta_facts.active_slots
    w_words = _weight_words(weights)  # B in packed 8-byte words when every slice allows
    packed = w_words is not None
    words = rank // packing(dtype, packed)  # of one row of B
    choose = functools.partial(
        choose_launch_config, "expand", num_tokens, active, rank, lane_split=splits(words)
    )
    config = choose(tensor_cores=True)
    x, out = inputs, output_tensor
    operands = None
    if config.kernel == "mma":
        operands = _mma_expand_operands(inputs, weights, w_words, output_tensor, columns)
        if operands is None:  # the tensor cores cannot take this call
            config = choose()
    one_slot = _one_slot("expand", config, weights[0].num_loras, meta_facts)
    per_block = config.columns_per_block("expand", words)
    if operands is not None:
        x, weights, out, wide, wide_x, wide_b = operands
        columns = [c // 4 for c in columns]  # the kernel places slices by 4-column words
        n_tiles = config.tile_n // (8 * config.threads // 32)  # 8-column tiles per warp
        one_pass = _one_pass(config, max(widths), per_block)
        kernel = build_mma_expand_kernel(
            inputs.dtype,
            config.threads,
            config.tile_m // 16,
            n_tiles,
            -(-rank // 16),
            rank % 16 == 0,
            wide and n_tiles % 4 == 0,  # 16-byte words of output: 4 tiles each
            all(width % (8 * n_tiles) == 0 for width in widths),  # whole column groups
            wide_x,  # the buffer in 16-byte loads
            wide_b,  # B in 16-byte loads
            one_pass,
            one_slot,
            _asks_ahead(widths, one_pass, one_slot, num_tokens),
        )
    else:
        wide = packed and all(_rows_start_at(w.view, 16) for w in weights)
        weights = w_words if packed else [elements for _, elements in _weight_forms(weights)]
        kernel = _expand_kernel(
            config, inputs.dtype, dtype, output_tensor.dtype, packed, words, wide, one_slot
        )
    blocks, meta = _block_work("expand", config, num_tokens, metadata, meta_facts, one_slot)
    launcher = _launcher(kernel)

    def launch() -> None:
        if blocks == 0:
            return
        for base in range(0, len(weights), MAX_SLICES):
            chunk = list(weights[base : base + MAX_SLICES])
            starts = columns[base : base + MAX_SLICES]
            widest = max(widths[base : base + MAX_SLICES])
            groups = _column_blocks(config, widest, per_block)
            grid = (blocks, len(chunk), groups)
            chunk += [chunk[0]] * (MAX_SLICES - len(chunk))
            starts += [0] * (MAX_SLICES - len(starts))
            args = (x, *chunk, out, base, *starts, *meta, add_inputs)
            launcher(grid, config.threads, args)

    launch.config = config  # what was chosen (the benchmark reports it)
    return launch


def _column_blocks(config: LaunchConfig, width: int, per_block: int) -> int:
    """Blocks along a slice of ``width`` columns (the grid's z): each walks ``passes``
    groups of ``per_block`` columns, and as many more as the grid is short of."""
    groups = -(-width // (per_block * config.passes))
    return min(groups, MAX_GRID_YZ) if config.spread else 1


#: The most tokens of a launch that asks ahead: the largest measured (a launch of more has
#: more blocks, and where a kernel's blocks were many, saying launch_dependents first lost).
ASK_AHEAD_TOKENS = 256


def _asks_ahead(widths: list[int], one_pass: bool, one_slot: bool, num_tokens: int) -> bool:
    """Whether a tensor-core expand lets the next launch be placed at once and asks L2 for
    its tile before its wait (:mod:`.kernels.expand_mma`, "Asking ahead"): where it was
    measured to pay, a launch of one slice whose grid has a block for every column group
    and whose blocks find their tokens in the tile table, of at most
    :data:`ASK_AHEAD_TOKENS` tokens. With three slices (the QKV layer) and under one slot
    it was slower, and those keep the plain wait; so do launches of more tokens, not
    measured."""
    return len(widths) == 1 and one_pass and not one_slot and num_tokens <= ASK_AHEAD_TOKENS


def _one_pass(config: LaunchConfig, width: int, per_block: int) -> bool:
    """Whether no block walks a second column group of a slice of ``width`` columns: the
    grid has a block for every group."""
    return _column_blocks(config, width, per_block) * per_block >= width


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
    offset_start: int = 0,
    add_inputs: bool = False,
) -> None:
    """Expand: ``output[t, c_s:c_s+N_s] (+)= inputs[s, t] @ B_s[slot(t)]^T`` per token with a LoRA.

    Semantics:
        inputs: [>= S, T, r] fp16 / bf16, or fp32 (the shrink buffer); any strides
        lora_b_weights[s]: [L, N_s, r] or [L, 1, N_s, r], fp16 / bf16 / fp32, contiguous;
            inputs must have the weights' dtype or be fp32
        output_tensor: [T, >= offset_start + sum(N_s)] floating, contiguous; modified in place
        c_s = offset_start + N_0 + ... + N_{s-1}
        for s, t with l = slot(t) != -1, n < N_s:
            output[t, c_s + n] = (output[t, c_s + n] if add_inputs else 0)
                                 + sum_k inputs[s, t, k] * B_s[l, n, k]   (fp32, one rounding)
        Rows of tokens without a LoRA and columns outside the slices are untouched.

    Memory traffic: reads S*T*r + (active slots)*sum(N_s)*r elements; writes T*sum(N_s)
    (and reads them too when add_inputs).

    Raises:
        TypeError: a dtype the kernels do not take, or mismatched dtypes.
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
        offset_start,
        add_inputs,
    )()
