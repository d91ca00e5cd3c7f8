"""The shrink with K split over blocks: ``out[s, t, :] (+)= scaling * x[t] @ A_s[slot(t)]^T``.

The row shrink (:mod:`.shrink`) gives each block a tile of tokens and a group of ranks
and walks the whole hidden size K inside it. At a down projection (K = 11008-14336)
with few tokens per LoRA (T = 32 over 8 LoRAs, rank 16-32) that makes too few blocks to
fill a GPU of 132 SMs, and each of them walks a long K. Here a block takes one more
coordinate, a *chunk* of K, so that ``tiles x rank groups x SPLITS`` blocks share the
work, each a ``1 / SPLITS`` stretch of it.

Work split (one block = one tile of one slot's tokens, one slice, some ranks, one chunk):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: ``group * SPLITS + split``: the group of ``TILE_N`` ranks starting at
  ``group * TILE_N``, and the chunk of words ``[split * C, min(W, (split + 1) * C))``
  with ``W`` the words of a row and ``C = ceil(W / SPLITS)``.

Inside a block, x and A are read as in the row shrink: thread ``tid`` walks its chunk
one *word* at a time, ``w = start + tid, start + tid + THREADS, ...`` (a packed int64 of
``PACK`` elements where x and every A allow it, else one element), and the block adds
its threads' partials in the row shrink's fixed order (:func:`.shrink.block_sum`).

**One launch, the last block adds.** A block stores its chunk's sums into an fp32
workspace, ``partials[split, slice, token, rank]``, makes them visible to the whole
GPU (``threadfence``) and counts itself in with an integer ``atomic.add`` on the
counter of its (tile, slice, rank group). The block that finds ``SPLITS - 1`` arrivals
before it is the last of its group: it reads the ``SPLITS`` partial sums of each
output, adds them in the order of the chunks, ``((p_0 + p_1) + p_2) + ...``, whichever
block came last, and stores ``old + scaling * sum`` (or, compiled without
``accumulate``, the product alone); then sets its counter back to 0, so the next launch,
or the next replay of a CUDA graph, finds every counter at 0. The one atomic operation
is on an integer, so its order changes no bit of the output: the result depends only on
``THREADS``, ``SPLITS`` and K (:meth:`~punica_numba.launch.LaunchConfig.arithmetic`),
not on the tiles, the rank groups or the order the blocks run in. A second, small reduce
launch would also have done; one launch was chosen because nothing in the launch path
needs two (the grid, the workspace and the counters are all known on the host), and a
second launch would pay a kernel's launch and placing again, a large part of a call of
a few µs.

**The workspace** (:func:`split_workspace`): one fp32 buffer and one int32 counter
buffer per device and stream, made zero once and grown when a call needs more; a launch
passes them whole and finds its place in them from the grid and the shapes. So a call
allocates nothing once an earlier call of its size ran on its stream (vLLM's warm-up), and
a CUDA graph captured after it allocates nothing. The split shrinks of one stream run one
after another and share the pair; another stream has its own, so shrinks running side by
side on two streams never share counters. A pair, once made, is never freed: a CUDA graph
captured with it keeps its address and may be replayed after the cache has grown past it
(two graphs replayed side by side on two streams, from captures on one stream, would
share it: capture them on streams of their own).

A capture often runs on a stream of its own after a warm-up on another (``bench``'s, the
tuner's and vLLM's warm-up run eagerly, ``torch.cuda.graph`` captures on a side stream), so
its stream finds no workspace. Counters made zero in the capture put a fill into the
graph ahead of each such launch, which runs at every replay, and every split time the
tuner and the benchmark measured before 8e0a61b carried it. On an H100 at 8e0a61b
(``h100_split_fill_ab_8e0a61b.json``: the tuner's timing, with and without spare counters,
interleaved) it cost each split configuration 1.2-1.5 µs a call: the tensor-core shrink in
4 runs of K at the down projection (K=14336, r=32, 32 tokens over 8 LoRAs) 9.65 -> 8.36
µs, now faster than the rows' 9.01; the row split on one token at K=4096 5.57 -> 4.39,
still past the rows' 1.68.

So each call outside a capture also makes sure of a *spare* set of counters, made zero, on
its device; a capture that finds its stream without a workspace takes the spare as its
stream's counters (and partial sums allocated in the capture, which need no filling), and
caches the pair for the rest of the capture and after it. Only where no spare is large
enough (no call outside a capture before it) are counters made zero in the capture, for
that launch alone.

Memory traffic per block: ``TILE_M`` rows of x and ``TILE_N`` rows of A over one chunk,
each read once; ``TILE_M * TILE_N`` partial sums written; the last block of a group
also reads ``SPLITS`` of them per output and reads and writes the output. On the H200 the
tuner never found it the fastest of the shrinks (the tuned table at cc380e6, K=14336: 9.31
µs against the row shrink's 9.01 at T=32 over 6 LoRAs, r=32; with the fill below, and
without it on an H100 9.43 against 9.04 at T=32 over 8), so the heuristic leaves it to the
tuner; the tensor-core shrink split the same way (:mod:`.shrink_mma_split`) won where this
one did not.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int32, int64

from .._cuda import SIMULATOR, cuda, jit_kernel, pack_tensors
from .dependent_launch import prologue
from .dtypes import loader, memory_type, storer
from .segments import read_tile, tile_token
from .shrink import MAX_SLICES, block_sum, word_products

__all__ = [
    "MIN_COUNTERS",
    "MIN_PARTIALS",
    "build_split_shrink_kernel",
    "cached_split_workspace",
    "clear_split_workspaces",
    "last_block_adds",
    "split_workspace",
    "split_workspace_sizes",
]

#: The smallest workspace made (fp32 partial sums, 256 KiB) and the fewest counters: a
#: first call of a small size then leaves room for the larger calls after it, so that
#: a cache grown by powers of two seldom grows at all.
MIN_PARTIALS = 1 << 16
MIN_COUNTERS = 1 << 12


def _read_shared(array, i):
    """Element ``i`` of a 1-D array that other blocks of this launch wrote: from L2 on
    the GPU (``ld.global.cg``: a line this SM kept in L1 could be stale); a plain load on
    the simulator, which has no cache hints."""
    return array[i]


_read_l2 = _read_shared if SIMULATOR else cuda.ldcg


@functools.cache
def last_block_adds(splits: int, out_dtype: torch.dtype, accumulate: bool):
    """``(arrived_last, add_chunks)``, the device functions of "One launch, the last block
    adds" for ``splits`` chunks into an output of ``out_dtype``, added to (``accumulate``)
    or stored, shared by the split shrinks (this one and the tensor-core one,
    :mod:`.shrink_mma_split`):

    * ``arrived_last(arrivals, counter, last)``: after the block's threads have stored
      their chunk's sums, make them visible to the whole GPU and count the block in on
      ``arrivals[counter]``; True in the block that finds ``splits - 1`` arrivals before
      it (every thread of the block gets the same answer through ``last``, an int32 shared
      array of one element). Every thread of the block must call it.
    * ``add_chunks(out, s, token, n, partials, plane, row, scaling)``: the ``splits``
      partial sums of output ``out[s, token, n]``, ``partials[c * plane + row]`` for chunks
      c = 0, 1, ..., added in that order, read from L2 (other blocks wrote them), then
      ``out[s, token, n] = (out[s, token, n] if accumulate else 0) + scaling * sum``."""
    SPLITS = splits
    ACCUMULATE = accumulate
    load_out, store_out = loader(out_dtype), storer(out_dtype)

    @cuda.jit(device=True, inline="always")
    def arrived_last(arrivals, counter, last):
        cuda.threadfence()  # the block's stores are seen by every block before its count
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            last[0] = int32(cuda.atomic.add(arrivals, counter, 1) == SPLITS - 1)
        cuda.syncthreads()
        if last[0] == 0:
            return False  # another chunk of this group is still running: it will add
        cuda.threadfence()
        return True

    @cuda.jit(device=True, inline="always")
    def add_chunks(out, s, token, n, partials, plane, row, scaling):
        total = _read_l2(partials, row)  # chunk 0
        for c in range(1, SPLITS):  # then 1, 2, ..., SPLITS - 1, in order
            total += _read_l2(partials, c * plane + row)
        old = float32(0.0)
        if ACCUMULATE:
            old = load_out(out[s, token, n])
        out[s, token, n] = store_out(old + scaling * total)

    return arrived_last, add_chunks


@functools.cache
def build_split_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    tile_n: int,
    splits: int,
    packed: bool,
    accumulate: bool = True,
):
    """Compile-time specialisation: the dtypes of x and A and of the output, threads per
    block, tile sizes, the chunks K is split into (``splits``), whether x and A arrive
    as packed int64 words, and whether the products are added to the output
    (``accumulate``) or stored.

    They must be constants because they size local (register) and shared arrays and
    the loops over them, which Numba unrolls only when the trip count is known.

    Semantics:
        x: [T, W] words; w0..w2: [L, r, W] words; out: [>= S, T, r]; modified in place
        partials: fp32 [>= SPLITS * S * T * r]; arrivals: int32 [>= B * S * G], all 0
        for each tile b of slot l, slice s, rank group g, chunk c (a block each):
            p[c, s, t, n] = sum over words k of chunk c of x[t, k] * w_s[l, n, k]
        the last block of (b, s, g) to arrive, for its tokens t and ranks n:
            out[s, t, n] = (out[s, t, n] if accumulate else 0)
                           + scaling * (((p[0] + p[1]) + p[2]) + ... + p[SPLITS - 1])
            arrivals[b, s, g] = 0
    """
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the tree reduction, got {threads}")
    if tile_m * tile_n > threads:
        raise ValueError(f"{tile_m} x {tile_n} sums need as many threads, got {threads}")
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    THREADS, TILE_M, TILE_N = threads, tile_m, tile_n
    SPLITS = splits
    PARTIALS = TILE_M * TILE_N  # dot products one block computes over its chunk
    # The row shrink's K loop over a chunk, and the words a thread holds in it.
    add_products, X_WORDS, W_WORDS = word_products(dtype, packed, threads, tile_m, tile_n)
    add_up, TREE_WIDTH = block_sum(threads, PARTIALS)  # the row shrink's order
    WORD = memory_type(dtype, packed)  # one word of x or A as it sits in memory
    arrived_last, add_chunks = last_block_adds(splits, out_dtype, accumulate)

    begin = prologue()

    @jit_kernel(THREADS)
    def shrink_split(
        x, w0, w1, w2, out, slice_base, partials, arrivals, tiles, sorted_tokens, scaling
    ):
        # x: [M, W] words; w*: [L, R, W] words; out: [S, M, R]; partials: fp32, at least
        # [SPLITS, gridDim.y, M, R] flat; arrivals: int32, at least [gridDim.x, gridDim.y,
        # gridDim.z / SPLITS] flat, all 0; tiles: [B, 4] int32
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_tile(tiles, cuda.blockIdx.x)
        if slot == -1:
            return  # every chunk of this tile leaves, before any barrier or count
        s_local = cuda.blockIdx.y
        # By hand, not segments.slice_of, as in the row shrink (.shrink says why)
        if s_local == 0:
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        tokens, rank, words = x.shape[0], w.shape[1], x.shape[1]
        tid = cuda.threadIdx.x
        split = cuda.blockIdx.z % SPLITS
        group = cuda.blockIdx.z // SPLITS
        n0 = group * TILE_N
        chunk = (words + SPLITS - 1) // SPLITS  # words of one chunk (the last: fewer)
        k_begin = split * chunk
        k_end = min(words, k_begin + chunk)

        token = cuda.local.array(TILE_M, int64)  # the tile's token rows
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)

        partial = cuda.local.array(PARTIALS, float32)
        xw = cuda.local.array(X_WORDS, WORD)
        ww = cuda.local.array(W_WORDS, WORD)
        tree = cuda.shared.array((PARTIALS, TREE_WIDTH), float32)
        last = cuda.shared.array(1, int32)  # 1 in the last block of the group to arrive

        for p in range(PARTIALS):
            partial[p] = float32(0.0)
        # k in [k_begin, k_end), strided by THREADS; UNROLL strides' loads are issued
        # together (past the end: a harmless repeat, never added).
        add_products(partial, xw, ww, x, w, token, slot, n0, rank, k_begin + tid, k_end)

        add_up(partial, tree, tid)  # the THREADS partials of each dot product, in order

        # This chunk's sums into the workspace: partials[split, s_local, token, n].
        j = tid // TILE_N
        n = n0 + tid % TILE_N
        mine = tid < PARTIALS and j < rows and n < rank
        if mine:
            row = (s_local * tokens + token[j]) * rank + n  # of one split's [S, M, R]
            plane = cuda.gridDim.y * tokens * rank  # elements of one split's [S, M, R]
            partials[split * plane + row] = tree[tid, 0]
        counter = (cuda.blockIdx.x * cuda.gridDim.y + s_local) * (cuda.gridDim.z // SPLITS)
        counter += group
        if not arrived_last(arrivals, counter, last):
            return
        if mine:
            add_chunks(out, out_slice, token[j], n, partials, plane, row, scaling)
        if tid == 0:
            arrivals[counter] = 0  # ready for the next launch (and graph replay)

    return shrink_split


def split_workspace_sizes(
    splits: int, slices: int, tokens: int, rank: int, blocks: int, groups: int
) -> tuple[int, int]:
    """``(partials, counters)``: the fp32 elements and int32 counters a launch of
    ``splits`` chunks, ``slices`` slices (at most ``MAX_SLICES``), ``tokens`` rows of
    rank ``rank``, ``blocks`` tiles and ``groups`` rank groups reads and writes."""
    if slices > MAX_SLICES:
        raise ValueError(f"a launch covers at most {MAX_SLICES} slices, got {slices}")
    return splits * slices * tokens * rank, blocks * slices * groups


#: (device, stream) -> (partials fp32, counters int32, the pair as kernel arguments)
_WORKSPACES: dict[tuple, tuple] = {}
#: device -> int32 counters made zero outside any capture, for the next capture that finds
#: its stream without a workspace (module notes, "The workspace").
_SPARE_COUNTERS: dict[torch.device, torch.Tensor] = {}
#: Every pair ever made, kept alive: CUDA graphs captured with one hold its address.
_KEPT: list[tuple] = []


def _stream_key(device: torch.device) -> tuple:
    """The cache's key of the current stream of ``device`` (one stream on the simulator);
    ``cuda`` and ``cuda:N`` of the current device are one key."""
    if SIMULATOR:
        return (device, None)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return (device, torch.cuda.current_stream(device).cuda_stream)


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (never on the simulator)."""
    return not SIMULATOR and torch.cuda.is_current_stream_capturing()


def _grown(size: int, least: int) -> int:
    """``size`` rounded up to a power of two, at least ``least``."""
    return max(least, 1 << max(0, size - 1).bit_length())


def _kept_pair(key: tuple | None, partials: torch.Tensor, counters: torch.Tensor) -> tuple:
    """``(partials, counters)`` as kernel arguments, kept alive, and cached for ``key``'s
    stream (None: the launch's alone)."""
    arguments = (partials, counters) if SIMULATOR else (pack_tensors((partials, counters)),)
    _KEPT.append((partials, counters))
    if key is not None:
        _WORKSPACES[key] = (partials, counters, arguments)
    return arguments


def split_workspace(
    device: torch.device, splits: int, slices: int, tokens: int, rank: int, blocks: int, groups: int
) -> tuple:
    """The workspace of a split-K launch on ``device`` (module notes, "The workspace"), as
    the kernel's ``partials, arrivals`` arguments: the cached pair of the device's current
    stream when it is large enough (else a new one, grown to the next power of two, which
    the stream caches from then on; the old one is kept, not freed), described once for
    the launcher on the GPU. No sync, and nothing allocated once the cache holds the size.

    During a CUDA graph capture a stream whose cache is too small takes the device's spare
    counters, made zero by an earlier call outside any capture, and partial sums allocated
    in the capture (which need no filling): the graph then holds no fill of its own, which
    would run before the kernel at every replay (1.2-1.5 µs a call on an H100). Only where no
    spare is large enough are the counters made zero in the capture; that pair is the
    launch's alone, not cached, so an eager call after the capture never finds counters
    that only a replay would have zeroed."""
    need_partials, need_counters = split_workspace_sizes(
        splits, slices, tokens, rank, blocks, groups
    )
    device = torch.device(device)
    key = _stream_key(device)
    cached = _WORKSPACES.get(key)
    if cached is not None and cached[0].numel() >= need_partials:
        if cached[1].numel() >= need_counters:
            _keep_a_spare(key[0], cached[1].numel())
            return cached[2]
    partials_size, counters_size = need_partials, need_counters
    if cached is not None:
        partials_size = max(partials_size, cached[0].numel())
        counters_size = max(counters_size, cached[1].numel())
    partials_size = _grown(partials_size, MIN_PARTIALS)
    counters_size = _grown(counters_size, MIN_COUNTERS)
    # [>= SPLITS * S * T * r] fp32, written before read
    partials = torch.empty(partials_size, dtype=torch.float32, device=device)
    spare_key = key[0]
    if _capturing():
        spare = _SPARE_COUNTERS.get(spare_key)
        if spare is not None and spare.numel() >= counters_size:
            del _SPARE_COUNTERS[spare_key]  # this stream's from now on
            return _kept_pair(key, partials, spare)
        counters = torch.zeros(counters_size, dtype=torch.int32, device=device)
        return _kept_pair(None, partials, counters)  # the capture's own
    # [>= B * S * G] int32, all 0
    counters = torch.zeros(counters_size, dtype=torch.int32, device=device)
    _keep_a_spare(spare_key, counters_size)
    return _kept_pair(key, partials, counters)


def _keep_a_spare(device: torch.device, size: int) -> None:
    """Outside a capture, make sure ``device`` has spare zero counters, at least ``size``:
    a dictionary lookup where it has (at every launch)."""
    spare = _SPARE_COUNTERS.get(device)
    if (spare is None or spare.numel() < size) and not _capturing():
        _SPARE_COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)


def cached_split_workspace(device: torch.device) -> tuple | None:
    """The cached ``(partials, counters)`` of the current stream of ``device``, or None
    (for tests: the counters are all 0 between launches)."""
    cached = _WORKSPACES.get(_stream_key(torch.device(device)))
    return None if cached is None else cached[:2]


def clear_split_workspaces() -> None:
    """Forget every cached workspace and spare (the next split launch makes a new one); the
    pairs made stay alive, for the CUDA graphs captured with them."""
    _WORKSPACES.clear()
    _SPARE_COUNTERS.clear()
