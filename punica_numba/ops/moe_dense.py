"""MoE LoRA's expand as the dense op's: each (slot, expert) of the MoE blocks one slot.

Past the shrink, an MoE expand is the dense expand on other rows: every pair ``p`` adds its
buffer row ``buffer[s, p]`` times its (slot, expert)'s ``B_s[l, e]`` into its own row of y
(``y.view(P, W)[p]``), where the dense op adds ``buffer[s, t]`` times its slot's B into row
``t``. So the MoE blocks can be handed to the tensor-core expand of the dense op
(:mod:`..kernels.expand_mma`), tuned on the H200 for every shape of a layer, instead of a
kernel of their own; and so can the shrink (:mod:`..kernels.shrink_mma`), where pair ``p``
reads row ``p // top_k`` of x (w13, a row per token; ``x_rows``) or row ``p`` (w2, a row per
pair) and stores its sums in row ``p`` of the buffer:

* a (slot l, expert e) is dense slot ``l * E + e`` of each B viewed ``[L * E, N, r]``;
* each MoE block of ``block_size`` pairs becomes ``ceil(block_size / 16)`` tiles of up to 16
  pairs, a row of the dense tile table each (:func:`moe_tiles`): its slot (-1 for a block
  not in use, an adapter turned off, or a tile with no pair), its pairs in a row of their
  own (the expand's tile tokens, and, as one list, the shrink's sorted tokens), padding
  past them; A is viewed ``[L * E, r, K]`` as B is;
* the router's weight, where the call multiplies by it (``mul_routed_weight``), goes into
  the buffer first: ``w (x A^T) B^T = (w x A^T) B^T``, one more rounding of the fp32
  buffer.

The tiles are one kernel a call (:mod:`..kernels.moe_tiles`; no read-back: the op stays
capturable in a CUDA graph), with rows for the blocks in use only, up to a bound the host
knows. At 61de306 they were some twenty torch operations with a row for every block the
metadata can hold, most of them idle where the pairs are few; those are the likely reason
that on an H100 (``docs/benchmarks/h100_moe_v7_61de306.json``) this took more time than
version 6's kernels on every case of ``bench --moe``: 54-67 µs more at one token, 1.00-1.23x
at 2048 on one and four adapters, 1.58-1.91x over 16 (not measured apart). With the one
kernel, at cb9702d, it took 0.56-0.90x version 6's time where the pairs average a tile (16)
or more a (slot, expert), and 0.85-1.62x below (``h100_moe_v7_cb9702d.json``): version 8
takes these kernels only there (:data:`.moe.DENSE_FROM_PAIRS`).

Where each (slot, expert) has a pair or two, version 9 takes the dense op's row kernels of
one-token tiles instead (:func:`row_shrink`, :func:`row_expand`; the row shrink reads row
``p // x_rows`` of x as the tensor-core one does): each pair a tile, the pairs packed into a
table of P rows by one kernel (:func:`moe_pairs`, :mod:`..kernels.moe_pairs`), since a tile
for every entry of the blocks would be mostly the align step's padding. In version 9 the
router's weights go in as either shrink stores a pair's row (``row_scaled``), not by a
launch of their own into the buffer as versions 7 and 8 multiply them. Version 14 packs the
same rows by runs of the metadata's entries that each claim theirs with one atomic add
(:func:`claimed_pairs`), with no running sum over the whole call.

Each launch takes the dense op's choice of configuration (:func:`_config`) for P rows over
``P / average`` slots: first the tuned table's MoE entries, which ``python -m punica_numba tune
--moe`` (:mod:`..tuning.moe_sweep`) measures on this op's own calls, then its dense entries
(tuned on linear layers of other sizes), then the heuristic. On an H100 at a949933, with no
table, the op with the heuristic's shrink of 16-pair tiles took 1.06-1.66x its time under the
fastest shrink (w13 at 2048 tokens over four adapters: 177.9 µs, ``mma_t128_m16_n0`` 107.1); on
the pairs its picks were within 2 % (``docs/benchmarks/h100_moe_dense_configs_a949933.json``).
On the H200 at 9fd11ec the MoE entries took that w13 call from 170.98 to 89.86 µs. Since
e07b1ff the heuristic itself takes those 4-warp blocks wherever there are 1024 of them or more
(:mod:`..launch`), as this op's tiles do from about a thousand tokens on: on an H100 the four
2048-token tile cases of ``bench --moe`` took 0.825-0.960x their time before (lab notes, "4
warps a block from 1024 blocks").
:func:`recorded_launches` tells which configuration each launch took.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from .._checks import check_device, check_same_device, check_stack
from .._cuda import SIMULATOR
from ..kernels import MAX_SLICES, build_mma_shrink_kernel, splits
from ..kernels.dtypes import packing
from ..kernels.moe_blocks import slots_at_once
from ..kernels.moe_claims import CLAIM_THREADS, build_claim_rows_kernel
from ..kernels.moe_idle_rows import build_idle_rows_kernel
from ..kernels.moe_pairs import build_moe_pairs_kernel, pairs_threads
from ..kernels.moe_tiles import (
    MOE_TILE_M,
    MOE_TILES_THREADS,
    build_moe_tiles_kernel,
    moe_tile_rows,
)
from ..launch import LaunchConfig, choose_launch_config, launch_configs
from . import operands
from .choice import ExpandChoice, choose_expand, choose_shrink, column_blocks
from .launching import launcher_of

__all__ = [
    "TILE_M",
    "dense_expand",
    "dense_shrink",
    "moe_pairs",
    "moe_tiles",
    "row_expand",
    "row_shrink",
]

#: Pairs a tile of the dense tensor-core expand holds.
TILE_M = MOE_TILE_M


def moe_tiles(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    adapter_enabled: torch.Tensor,
    block_size: int,
    num_pairs: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE blocks in use as the dense op's tile table ``[R, 4]`` and tile tokens ``[R,
    16]`` (int32; :mod:`..kernels.segments`), R a bound the host knows
    (:func:`..kernels.moe_tiles.moe_tile_rows`), made by one kernel, a thread a tile
    (:mod:`..kernels.moe_tiles`).

    Semantics:
        the blocks in use: for each slot l in order with adapter_enabled[l] != 0, its blocks
            b < min(NB, ceil(num_tokens_post_padded[l] / bs)) in order; each ceil(bs / 16)
            tiles, j = 0, 1, ..
        for the i-th tile of those, tile j of block b of slot l (pairs j*16 .. of it):
            pairs = the entries of sorted_token_ids[l, b*bs + 16 j : b*bs + min(16 (j+1), bs)]
                    that are below num_pairs, in their order
            live = 0 <= e = expert_ids[l, b] < E, pairs not empty
            table row i = (l*E + e, 16 i, len(pairs), pairs[0]) if live else (-1, 0, 0, 0)
            tokens row i = pairs, then pairs[-1] repeated (zeros for a tile not live)
        rows past the blocks in use: (-1, 0, 0, 0) and zeros; a tile past R (only where
        num_tokens_post_padded counts more blocks than any alignment of the pairs makes) has
        no row. So a tile's position is where its row starts in the tokens taken as one
        sorted list (``tokens.view(-1)``: the shrink's ``sorted_tokens``).
    """
    blocks = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    count = moe_tile_rows(num_pairs, sorted_token_ids.shape[0], block_size, expert_ids.shape[1])
    table, tokens = _empty_table(blocks, (count, TILE_M))
    if count:
        grid = (-(-count // MOE_TILES_THREADS), 1, 1)
        sizes = (block_size, num_pairs, num_experts)
        kernel = build_moe_tiles_kernel(slots_at_once(sorted_token_ids.shape[0]))
        _make_table(kernel, grid, MOE_TILES_THREADS, blocks, adapter_enabled,
                    sizes, table, tokens)  # fmt: skip
    return table, tokens


def moe_pairs(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    adapter_enabled: torch.Tensor,
    block_size: int,
    num_pairs: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of the MoE blocks in use as the dense op's table of one-token tiles ``[P,
    4]`` with their tokens ``[P]`` (int32; the row kernels' ``sorted_tokens``), made by one
    kernel of one CUDA block (:mod:`..kernels.moe_pairs`; its threads
    :func:`..kernels.moe_pairs.pairs_threads`).

    Semantics:
        the blocks in use: for each slot l in order with adapter_enabled[l] != 0, its blocks
            b < min(NB, ceil(num_tokens_post_padded[l] / bs)) in order
        their pairs: for each such block with 0 <= e = expert_ids[l, b] < E, the entries of
            sorted_token_ids[l, b*bs : (b+1)*bs] below num_pairs, in their order
        row i of the i-th pair p, of (slot l, expert e): table (l*E + e, i, 1, p), tokens p
        rows past the last pair: (-1, 0, 0, 0) and 0; pairs past P rows (a pair named
        twice): none
    """
    blocks = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    table, tokens = _empty_table(blocks, (num_pairs,))
    if num_pairs:
        slots = sorted_token_ids.shape[0]
        threads = pairs_threads(num_pairs, slots, expert_ids.shape[1])
        kernel = build_moe_pairs_kernel(slots_at_once(slots), threads)
        sizes = (block_size, num_pairs, num_experts)
        _make_table(kernel, (1, 1, 1), threads, blocks, adapter_enabled, sizes, table, tokens)
    return table, tokens


def claimed_pairs(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    adapter_enabled: torch.Tensor,
    block_size: int,
    num_pairs: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_pairs`' rows, packed by runs of the entries that claim their rows with an
    atomic add (version 14): two launches of many CUDA blocks, no running sum over the call
    (:mod:`..kernels.moe_idle_rows`, :mod:`..kernels.moe_claims`). The same rows but for their
    order and numbers.

    Semantics:
        the named pairs: the entries sorted_token_ids[l, q] = p with 0 <= p < P, for each
            slot l with adapter_enabled[l] != 0 and q < min(EM, ceil(num_tokens_post_padded[l]
            / bs) * bs), whose block's expert e = expert_ids[l, q // bs] is in [0, E)
        a run: entries q of one slot with the same q // CLAIM_THREADS
        the n named pairs take rows 0 .. min(n, P) - 1 (n > P only where a pair is named
            twice; the pairs past P rows take none), row i of pair p of (slot l, expert e):
            table (l*E + e, i, 1, p), tokens p; a run's pairs in consecutive rows in their
            order; the runs in an order not defined
        rows n .. P - 1: (-1, 0, 0, 0) and 0
    """
    blocks = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    table, tokens = _empty_table(blocks, (num_pairs,))
    if num_pairs:
        claimed = torch.empty(1, dtype=torch.int32, device=table.device)
        threads = CLAIM_THREADS
        idle = launcher_of(build_idle_rows_kernel(threads))
        idle((-(-num_pairs // threads), 1, 1), threads, (table, tokens, claimed))
        slots, entries = sorted_token_ids.shape
        grid = (max(1, -(-entries // threads)), slots, 1)
        sizes = (block_size, num_pairs, num_experts)
        _make_table(build_claim_rows_kernel(threads), grid, threads, blocks, adapter_enabled,
                    sizes, table, tokens, claimed)  # fmt: skip
    return table, tokens


def _empty_table(blocks: tuple, token_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """An int32 table ``[token_shape[0], 4]`` and its tokens ``token_shape``, uninitialised,
    on the device of the blocks (``sorted_token_ids``, ``expert_ids``,
    ``num_tokens_post_padded``), which must be the kernels' and one (else a ValueError
    naming them, before any launch)."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = blocks
    device = check_device("sorted_token_ids.device", sorted_token_ids.device)
    check_same_device(dict(sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
                           num_tokens_post_padded=num_tokens_post_padded))  # fmt: skip
    table = torch.empty((token_shape[0], 4), dtype=torch.int32, device=device)
    return table, torch.empty(token_shape, dtype=torch.int32, device=device)


def _make_table(kernel, grid, threads, blocks, adapter_enabled, sizes, *outputs) -> None:
    """Launch a kernel that makes a table from the blocks: its arguments the blocks, the
    first L flags of ``adapter_enabled`` on their device (bytes, where they are bool), the
    ``sizes`` (block size, P, E), then ``outputs``: the table, its tokens (and any more the
    kernel takes)."""
    enabled = adapter_enabled[: blocks[0].shape[0]].to(outputs[0].device)
    if enabled.dtype == torch.bool:  # (the kernels read bytes)
        enabled = enabled.view(torch.uint8)
    launcher_of(kernel)(grid, threads, (*blocks, enabled, *sizes, *outputs))


def _flat(stacked: torch.Tensor, name: str, s: int):
    """``[L, E, a, b]`` as the dense op's checked stack ``[L * E, a, b]``: slot ``l * E + e``."""
    slots, experts, rows, cols = stacked.shape
    return check_stack(name, stacked.view(slots * experts, rows, cols), s)


#: The dicts of the :func:`recorded_launches` blocks open now.
_records: list[dict] = []


@contextlib.contextmanager
def recorded_launches():
    """Within the block, each launch of the dense op's kernels by this module is recorded in
    the dict it yields, ``op -> LaunchConfig`` ("shrink", "expand"; the last of each), so
    that a caller forcing a configuration (the tuner) can tell whether it ran."""
    record: dict = {}
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


def _record(op: str, config: LaunchConfig) -> None:
    for record in _records:
        record[op] = config


def active_slots(rows: int, average_pairs: float) -> int:
    """The slots a call of ``rows`` pairs at ``average_pairs`` a (slot, expert) is taken to
    use, for the choice of configuration: ``rows / average_pairs``, rounded, at least 1."""
    return max(1, round(rows / max(average_pairs, 1.0)))


#: The kernels of each path's configurations: the tiles' (:func:`dense_shrink`,
#: :func:`dense_expand`) and the pairs' (:func:`row_shrink`, :func:`row_expand`).
TILE_KERNELS = ("mma",)
ROW_KERNELS = ("rows", "lanes")


def _config(op: str, rows: int, average_pairs: float, rank: int, slices: int, key: dict, runs):
    """The dense op's configuration of ``op`` for ``rows`` rows at ``average_pairs`` a slot
    (:func:`active_slots`) where this module ``runs`` it, with the tensor cores or else
    without them, else the first of the table that ``runs`` takes at any rank
    (``runs(c, any_rank=True)``) and that the heuristic may pick. The tuned table's MoE
    entries (``tune --moe``) of the path's kernels (:data:`ROW_KERNELS` where ``runs`` is
    the pairs' test, else :data:`TILE_KERNELS`) come before its dense ones."""
    active = active_slots(rows, average_pairs)
    key = dict(key, moe_kernels=ROW_KERNELS if runs is _one_token_rows else TILE_KERNELS)
    for tensor_cores in (True, False):
        config = choose_launch_config(op, rows, active, rank, tensor_cores, slices, **key)
        if runs(config):
            return config
    return next(c for c in launch_configs(op) if runs(c, any_rank=True) and not c.tuned_only)


def _shrink_runs(c: LaunchConfig, any_rank: bool = False, rank: int = 0) -> bool:
    """A tensor-core shrink :func:`dense_shrink` can launch: unsplit blocks of one slice and
    16-token tiles, at ``rank`` (``any_rank``: a block per group of ranks)."""
    plain = c.splits == 1 and not c.joint and not c.staged
    fits = (c.to_rank or rank) >= rank and (bool(c.tile_n) or not any_rank)
    return c.kernel == "mma" and c.tile_m == TILE_M and plain and fits


def _expand_runs(c: LaunchConfig, any_rank: bool = False) -> bool:
    """A tensor-core expand of 16-token tiles (:func:`dense_expand`), at any rank."""
    return c.kernel == "mma" and c.tile_m == TILE_M


def _one_token_rows(c: LaunchConfig, any_rank: bool = False) -> bool:
    """A row kernel of one-token tiles (:func:`row_shrink`, :func:`row_expand`): the row
    shrink, the row or lane-split expand, at any rank."""
    return c.kernel in ROW_KERNELS and c.tile_m == 1


def _factors(router_weights: torch.Tensor | None) -> tuple[bool, object]:
    """``(row_scaled, scaling)`` of a shrink's build and launch: the router's weights as a
    factor an output row where given, else the scaling of 1."""
    if router_weights is None:
        return False, np.float32(1.0)
    return True, router_weights


def _live(table: torch.Tensor, tokens: torch.Tensor):
    """The table's rows and their tokens, on the simulator only the live ones (every CUDA
    thread is a Python thread there: no idle tile)."""
    if not SIMULATOR:
        return table, tokens
    keep = table[:, 0] >= 0
    return table[keep].contiguous(), tokens[keep].contiguous()


def dense_shrink(
    buffer: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    tiles: tuple[torch.Tensor, torch.Tensor],
    x_rows: int,
    average_pairs: float,
    router_weights: torch.Tensor | None = None,
) -> bool:
    """The shrink of a checked MoE call by the dense op's tensor-core kernel: ``buffer`` [S, P,
    r] fp32 (each pair in a tile's row stored, the others untouched), ``x`` [P / x_rows, K],
    ``lora_a[s]`` [L, E, r, K], ``tiles`` from :func:`moe_tiles`, ``x_rows`` the pairs that
    share a row of x (``top_k`` for w13, 1 for w2), ``average_pairs`` as for
    :func:`dense_expand`; ``router_weights`` as :func:`row_shrink` takes them. False, with
    nothing launched, where the tensor cores cannot take the call."""
    stacks = [_flat(a, "lora_a_stacked", s) for s, a in enumerate(lora_a)]
    rank, hidden = stacks[0].rows, stacks[0].cols
    num_pairs = buffer.shape[1]
    key = dict(dtype=stacks[0].dtype, K=hidden, N=rank)
    runs = functools.partial(_shrink_runs, rank=rank)
    config = _config("shrink", num_pairs, average_pairs, rank, len(stacks), key, runs)
    mma = operands.mma_shrink_operands(x, stacks, config.tile_n)
    if mma is None:
        return False
    x_words, a_words, wide = mma
    n_tiles = -(-min(rank, config.tile_n or rank) // 8)
    scaled, scaling = _factors(router_weights)
    kernel = build_mma_shrink_kernel(
        x.dtype, torch.float32, config.threads, 1, n_tiles, False, wide, x_rows=x_rows,
        ahead=config.ahead, row_scaled=scaled,
    )  # fmt: skip
    sorted_pairs = tiles[1].view(-1)  # (a tile's position: where its row starts)
    table = _live(tiles[0], tiles[1])[0]
    if table.shape[0] == 0:
        return True
    groups = -(-rank // config.tile_n) if config.tile_n else 1
    weights = list(a_words) + [a_words[0]] * (MAX_SLICES - len(a_words))  # unused: never read
    grid = (table.shape[0] * len(a_words), groups, 1)
    arguments = (x_words, *weights, buffer, 0, len(a_words), table, sorted_pairs, scaling)
    _record("shrink", config)
    launcher_of(kernel)(grid, config.threads, arguments)
    return True


def dense_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: list[torch.Tensor],
    tiles: tuple[torch.Tensor, torch.Tensor],
    offset: int,
    add_inputs: bool,
    average_pairs: float,
) -> bool:
    """The expand of a checked MoE call by the dense op's tensor-core kernel: ``out`` [P, W]
    (y's rows of pairs), ``buffer`` [S, P, r] fp32 (the router's weights already in it where
    the call multiplies by them), ``lora_b[s]`` [L, E, N, r], ``tiles`` from
    :func:`moe_tiles`; ``average_pairs`` the pairs a (slot, expert) on average, for the
    choice of configuration (the tuned table's tokens a slot). False, with nothing
    launched, where the tensor cores cannot take the call (then the caller's own expand
    runs).

    The configuration is the dense op's for P rows of ``P / average_pairs`` slots where
    that is a tensor-core one of 16-token tiles, else the first such of the table."""
    chosen, width = _chosen_expand(out, buffer, lora_b, offset, average_pairs, _expand_runs)
    if chosen.config.kernel != "mma":
        return False
    _launch_expand(chosen, width, *_live(*tiles), add_inputs)
    return True


def row_shrink(
    buffer: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    pairs: tuple[torch.Tensor, torch.Tensor],
    x_rows: int,
    average_pairs: float,
    router_weights: torch.Tensor | None = None,
) -> None:
    """The shrink of a checked MoE call by the dense op's row kernel of one-token tiles, a
    pair a tile: as :func:`dense_shrink`, ``pairs`` from :func:`moe_pairs`. The
    configuration is the dense op's for P rows of ``P / average_pairs`` slots where that is
    such a kernel, else the first such of the table. Every dtype. ``router_weights`` (fp32
    [P]), where given, multiply each pair's row as the kernel stores it: the products and
    then the weight, as a multiply of the stored buffer would, without its launch."""
    stacks = [_flat(a, "lora_a_stacked", s) for s, a in enumerate(lora_a)]
    rank, hidden = stacks[0].rows, stacks[0].cols
    key = dict(dtype=stacks[0].dtype, K=hidden, N=rank)
    config = _config("shrink", buffer.shape[1], average_pairs, rank, len(stacks), key,
                     _one_token_rows)  # fmt: skip
    scaled, scaling = _factors(router_weights)
    chosen = choose_shrink(
        x, stacks, buffer, None, False, config=config, x_rows=x_rows, row_scaled=scaled
    )
    table, tokens = _live(*pairs)
    if table.shape[0] == 0:
        return
    weights = list(chosen.weights)
    grid = (table.shape[0], len(weights), chosen.rank_groups)
    weights += [weights[0]] * (MAX_SLICES - len(weights))  # unused: never read
    arguments = (chosen.x, *weights, buffer, 0, table, tokens, scaling)
    _record("shrink", config)
    launcher_of(chosen.kernel)(grid, config.threads, arguments)


def row_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: list[torch.Tensor],
    pairs: tuple[torch.Tensor, torch.Tensor],
    offset: int,
    add_inputs: bool,
    average_pairs: float,
) -> None:
    """The expand of a checked MoE call by the dense op's row or lane-split kernel of
    one-token tiles, a pair a tile: as :func:`dense_expand`, ``pairs`` from
    :func:`moe_pairs`, the configuration chosen as :func:`row_shrink`'s. Every dtype."""
    chosen, width = _chosen_expand(out, buffer, lora_b, offset, average_pairs, _one_token_rows)
    _launch_expand(chosen, width, *_live(*pairs), add_inputs)


def _chosen_expand(out, buffer, lora_b, offset, average_pairs, runs) -> tuple[ExpandChoice, int]:
    """The dense op's expand of a checked MoE call (as :func:`dense_expand` describes it),
    its configuration one that ``runs`` takes (:func:`_config`), and the slices' width. The
    row kernels' configurations are chosen knowing whether the rows of B split over lanes
    (the lane-split expand's condition); the tensor-core ones do not ask."""
    stacks = [_flat(b, "lora_b_stacked", s) for s, b in enumerate(lora_b)]
    width, rank = stacks[0].rows, stacks[0].cols
    key = dict(dtype=stacks[0].dtype, K=rank, N=width)
    if runs is _one_token_rows:
        packed = operands.weight_words(stacks) is not None
        key["lane_split"] = splits(rank // packing(stacks[0].dtype, packed))
    config = _config("expand", buffer.shape[1], average_pairs, rank, len(stacks), key, runs)
    return choose_expand(buffer, stacks, out, None, offset, config=config), width


def _launch_expand(
    chosen: ExpandChoice, width: int, table: torch.Tensor, tokens: torch.Tensor, add_inputs
) -> None:
    """Launch a chosen dense expand over the rows of ``table`` (slices of ``width``
    columns), its tiles' tokens ``tokens`` (rows of them, or the sorted list)."""
    if table.shape[0] == 0:
        return
    weights = list(chosen.weights)
    starts = list(chosen.columns)
    grid = (table.shape[0], len(weights), column_blocks(chosen.config, width, chosen.per_block))
    weights += [weights[0]] * (MAX_SLICES - len(weights))  # unused slots: never read
    starts += [0] * (MAX_SLICES - len(starts))
    arguments = (chosen.x, *weights, chosen.out, 0, *starts, table, tokens, add_inputs)
    _record("expand", chosen.config)
    launcher_of(chosen.kernel)(grid, chosen.config.threads, arguments)
