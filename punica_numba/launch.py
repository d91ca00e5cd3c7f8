"""Launch configurations and the heuristic that picks one per call.

A configuration names a kernel (the row kernels for few tokens per slot, the
shared-memory tiled kernels for many, the split-K shrink for few tokens on a long K),
fixes what is compiled into it (threads
per block, tiles) and how its grid is shaped. Every configuration computes every
problem correctly; they differ only in speed, and configurations with equal
:meth:`LaunchConfig.arithmetic` keys add the same products in the same order, so
they give bit-identical results.

The heuristic reads only host-side facts (the activation's row count and what
``LoRAKernelMeta`` learned while it prepared the mapping), never the device, so
choosing costs no sync and a launch can be captured in a CUDA graph. Where this GPU has a
tuned table (:mod:`punica_numba.tuning`, ``python -m punica_numba tune``), its measured
choice comes before the heuristic's.

The split-K shrinks (``kernel="split"``, :mod:`.kernels.shrink_split`, and the tensor-core
shrink with ``splits`` > 1, :mod:`.kernels.shrink_mma_split`) cut K into ``splits`` chunks, each
a block of its own, and the last block of a (tile, slice, rank group) adds the chunks' sums
in order: for a long K (down projections, K = 9728-28672), where the blocks are too few for
the GPU's SMs. The tuner times both on the H200; the row one never won there and is left to
the tuner, the tensor-core one is the heuristic's pick where its measured rules say.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ._cuda import SIMULATOR
from .kernels.cluster import PORTABLE_CLUSTER
from .kernels.expand_lanes import lanes_columns
from .tuning.table import tuned_config

__all__ = [
    "LaunchConfig",
    "choose_launch_config",
    "config_name",
    "force_launch_config",
    "forced_launch_configs",
    "launch_configs",
    "tile_sizes",
    "tile_token_sizes",
]

OPS = ("shrink", "expand")

#: The blocks (tiles x slices) from which the heuristic's tensor-core shrink takes 4 warps of
#: every rank; 8 warps of every rank keep T=4096 only below them (:data:`_GPU_CONFIGS`).
_FOUR_WARPS_FROM_BLOCKS = 1024

#: A call of fewer tokens a slot than its rank's chunks of this many ranks takes the
#: lane-split expand the heuristic reaches before a tensor-core one: the tensor-core expand
#: walks the rank in chunks of 64 (kernels.expand_mma, "Ranks past 64"), each 16-row tile
#: holding a token or two; so past r=64 a token a LoRA, past r=128 up to 3. In the H200's
#: tuned table (r=16-128) the lanes took 0.67-0.96x the tensor cores' time on all 9 problems
#: of a token a LoRA at r=128 from T=8 (1, 2 and 3 slices; T=8-128); with 2 or more tokens a
#: LoRA they won on 3 of 45 (all at T=8) and lost the rest; at r=32 and 64, a token a LoRA,
#: they lost on all 15 (1.15-1.32x the fastest tensor cores' time). On an H100 at 470088f
#: (probes/expand_lanes_rule.py, h100_expand_lanes_rule_470088f.json: Llama-3-8B's QKV,
#: gate_up and o, T=8-128) a token a LoRA 0.51-0.81x at r=128 and 0.30-0.69x at r=256 (all 18);
#: 2 tokens a LoRA, the best lanes 0.45-0.83x at r=256 (all 9), 0.78-1.14x at r=128 (5 of 9
#: faster). Lab notes, "The lanes before the tensor cores past r=64".
_LANES_FIRST_RANKS_A_TOKEN = 64


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched: which kernel, what is compiled into it, the grid's shape.

    ``kernel="rows"`` is the row kernel (:mod:`.kernels.shrink`, :mod:`.kernels.expand`):
    ``tile_m`` tokens of one slot per block; shrink takes ``tile_n`` ranks per group,
    expand ``vec`` output columns per thread (a warp's 32 neighbouring columns, ``vec``
    times over). ``kernel="tiled"`` is the shared-memory tile of
    expand (:mod:`.kernels.expand_tiled`): ``tile_m`` tokens x ``tile_n`` columns per
    block, ``micro`` outputs per thread, ``chunk`` ranks staged at a time.
    The heuristic picks it from ``from_tokens_per_slot`` tokens per active slot,
    ``from_tokens`` rows (a big tile needs enough tiles to fill the GPU), up to
    ``to_tokens`` rows (where a configuration for more rows takes over), and
    ``from_rank`` on, up to ``to_rank`` (past it the kernel needs more registers than
    a block of its size can have, and would not launch), and from ``from_slices`` slices
    (the tensor-core shrink's slices share x, so with more of them other tiles pay
    off) up to ``to_slices`` (a block of many columns leaves the narrow slices of a
    QKV layer idle). ``kernel="lanes"`` is the lane-split expand (:mod:`.kernels.expand_lanes`):
    ``tile_m`` tokens per block, each row of B read by several lanes, ``vec`` rows per
    lane group (its block's columns follow from the rank); only calls whose rows of B
    split well can use it. ``kernel="mma"`` is a tensor-core kernel
    (:mod:`.kernels.shrink_mma`, :mod:`.kernels.expand_mma`): ``tile_m`` tokens (16 per
    product tile) of one slot per block, ``threads // 32`` warps; the expand covers
    ``tile_n`` output columns per block (``tile_n / warps``, a multiple of 16, per warp),
    the shrink ``tile_n`` ranks (0: every rank; else a block per group of ``tile_n``).
    An expand's blocks walk ``passes`` column groups each, striding by the grid: its
    tile's tokens and buffer rows are looked up and loaded once for them all, and a slice
    narrower than the widest leaves fewer blocks idle. A tensor-core expand's ``chunk`` (0:
    64) is the ranks whose buffer fragments a lane holds at once, a multiple of 16
    (:mod:`.kernels.expand_mma`, "Ranks past 64"). A tensor-core shrink with
    ``splits`` > 1 also cuts K into that many chunks, a block each along grid.z, the last
    block of each tile and rank group adding the chunks' sums
    (:mod:`.kernels.shrink_mma_split`); with ``cluster`` (2-8 chunks, compute capability
    9.0) the chunks of a tile are one thread block cluster, and its first block adds their
    sums from the others' shared memory. A ``joint`` tensor-core shrink takes the slices'
    ranks side by side, ``tile_n`` of them a block (:mod:`.kernels.shrink_mma_joint`: a
    tile's rows of x read once for every slice). A ``staged`` one copies a tile's rows of x
    and the block's ``tile_n`` rows of A into shared memory a chunk of K at a time, each
    warp multiplying ``tile_n / warps`` of the ranks (:mod:`.kernels.shrink_mma_staged`;
    ``joint`` too: the slices' ranks side by side).
    Only calls whose dtypes and layout the tensor cores take can use them
    (:func:`choose_launch_config`). ``kernel="split"`` is the split-K shrink
    (:mod:`.kernels.shrink_split`): ``tile_m`` tokens of one slot, ``tile_n`` ranks and one
    of ``splits`` chunks of K per block, the last block of each tile and rank group adding
    the chunks' sums; the heuristic picks it only from ``from_hidden`` (K) on, up to
    ``to_tokens_per_slot`` tokens per active slot and ``to_tiles`` tiles (the blocks along
    x: beyond them the row shrink has blocks enough). ``to_blocks`` caps the blocks a
    configuration makes before any split of K (tiles x slices x groups of ``tile_n``
    ranks): a split pays only where they are few. ``from_blocks`` is the least count of its
    own blocks: wider blocks pay once narrower ones would be more than the SMs hold (a
    shrink's blocks as above; an expand's are its tiles x slices x groups of ``passes``
    times its columns across the widest slice, known only where the caller gives ``N``).
    """

    kernel: str  # "rows", "tiled", "lanes", "mma" or "split"
    threads: int  # threads per block
    tile_m: int  # tokens of one slot per block
    tile_n: int  # ranks (shrink) or columns (tiled expand) per block or group
    spread: bool = True  # spread rank / column groups over grid.z, or loop inside the block
    passes: int = 1  # expand, spread: column groups each block walks (grid.z = groups / passes)
    micro: tuple[int, int] = (1, 1)  # tiled: the register tile of one thread
    chunk: int = 0  # tiled: ranks staged in shared memory at a time; mma expand: held (0: 64)
    vec: int = 1  # row expand: output columns per thread
    splits: int = 1  # split or tensor-core shrink: the chunks K is cut into, a block each
    joint: bool = False  # tensor-core shrink: the slices' ranks side by side in a block
    staged: bool = False  # tensor-core shrink: x and A staged in shared memory, warps of ranks
    ahead: int = 1  # tensor-core shrink walking K in its warps: passes of loads on their way
    cluster: bool = False  # tensor-core shrink with K split: the runs add up in one cluster
    stages: int = 0  # staged tensor-core kernel: stages in dynamic shared memory (0: 48 KB's)
    from_tokens_per_slot: float = 0.0
    from_tokens: int = 0  # and where the activation has at least this many rows
    to_tokens: int | None = None  # and at most this many (None: any)
    from_rank: int = 0  # and where the LoRA rank is at least this
    to_rank: int | None = None  # and at most this (None: any): a bigger one does not fit
    from_slices: int = 1  # and where the call has at least this many slices
    to_slices: int | None = None  # and at most this many (None: any)
    from_hidden: int = 0  # and where the shrink's K is at least this (unknown K: never)
    to_tokens_per_slot: float | None = None  # and at most this many tokens per slot
    to_tiles: int | None = None  # and at most this many tiles of tile_m (None: any)
    to_blocks: int | None = None  # and at most this many tiles x slices x groups of tile_n
    from_blocks: int = 0  # and at least this many blocks (an expand's: known N only)
    from_work: int = 0  # and where tokens x rank x slices (the products' rows) is at least this
    tuned_only: bool = False  # never the heuristic's pick: the tuner times it, a table may name it

    def __post_init__(self):
        if self.joint and (self.kernel != "mma" or self.splits != 1 or not self.tile_n):
            raise ValueError(
                "joint takes the unsplit tensor-core shrink with a group of tile_n > 0 "
                f"joint ranks, got {self}"
            )
        if self.ahead not in (1, 2) or (
            self.ahead == 2 and (self.kernel != "mma" or self.staged or self.joint)
        ):
            raise ValueError(
                "ahead takes 1, or 2 passes for a tensor-core shrink that is neither staged "
                f"nor joint, got {self}"
            )
        if self.cluster and (
            self.kernel != "mma"
            or self.staged
            or self.joint
            or not 2 <= self.splits <= PORTABLE_CLUSTER
        ):
            raise ValueError(
                f"cluster takes a tensor-core shrink of 2-{PORTABLE_CLUSTER} runs of K, neither "
                f"staged nor joint, got {self}"
            )
        if self.stages and (not self.staged or self.stages < 2):
            raise ValueError(f"stages takes a staged configuration and 2 or more, got {self}")
        warps = self.threads // 32
        if self.staged and (
            self.kernel != "mma" or self.tile_m % 16 or not self.tile_n or self.tile_n % (8 * warps)
        ):
            raise ValueError(
                "staged takes a tensor-core shrink of tile_m a multiple of 16 tokens and "
                f"tile_n > 0 a multiple of 8 ranks a warp, got {self}"
            )

    def columns_per_block(self, op: str, words: int = 0) -> int:
        """Ranks (shrink) or output columns (expand) one block covers per group. A
        lane-split expand's depend on the ``words`` in one row of B (how many lanes share
        a row: :func:`.kernels.expand_lanes.lanes_columns`)."""
        if op == "expand" and self.kernel == "rows":
            return self.threads * self.vec
        if op == "expand" and self.kernel == "lanes":
            return lanes_columns(self.threads, self.vec, words)
        return self.tile_n

    def arithmetic(self, op: str) -> tuple:
        """Launches whose configurations have equal keys give bit-identical results.

        Every row or tiled expand adds ``x[k] * B[n, k]`` for k = 0, 1, ... into one
        accumulator; the lane-split expand adds each lane's stretch of k in order, then
        the lanes' sums in a butterfly whose shape depends only on the rank; the shrink
        adds ``threads`` strided partial sums (warp shuffles, then the warps' sums, on
        the GPU; a tree on the simulator); the split shrink does so for each of its
        ``splits`` chunks of K, then adds the chunks' sums in order. The tensor-core
        kernels sum in an order of their own (the shrink's depends on its warps, the
        expand's on nothing but the rank; a tensor-core shrink split into chunks of K adds
        each chunk's sums, then the chunks in order; a staged one's outputs are each one
        warp's, as in a block of 32 threads).
        """
        if self.kernel == "mma":  # the tensor cores' sums: an order of their own
            if op == "expand":
                return ("mma",)
            threads = 32 if self.staged else self.threads  # (staged: a warp's sums over K)
            return ("mma", threads) if self.splits == 1 else ("mma", threads, self.splits)
        if op == "expand":
            return ("lanes",) if self.kernel == "lanes" else ("sequential",)
        if self.kernel == "split":  # the chunks' trees, then the chunks in order
            return ("split", self.threads, self.splits)
        return ("tree", self.threads)

    def reads_tile_tokens(self, op: str) -> bool:
        """Whether the kernel reads each tile's tokens from a row of their own
        (:func:`.kernels.segments.tile_tokens`): only the tensor-core expand does; the
        others (the staged expand among them) read the sorted tokens, or (a tile of one
        token) the table's."""
        return op == "expand" and self.kernel == "mma" and not self.staged


#: The simulator runs every thread as a Python thread: small blocks, and loops inside
#: the block instead of more blocks.
_SIMULATOR_CONFIGS = {
    "shrink": (
        LaunchConfig("rows", threads=16, tile_m=1, tile_n=4, spread=False),
        # K in three chunks, a block each, from 24 elements on (the simulator's tiny
        # hidden sizes), and tiles of two tokens whose second row is often past the tile.
        LaunchConfig(
            "split",
            threads=16,
            tile_m=2,
            tile_n=4,
            splits=3,
            from_hidden=24,
            to_tokens_per_slot=2,
            to_tiles=8,
        ),
        # A block per group of 4 ranks, as on the GPU (the other keeps the loop over groups).
        LaunchConfig("rows", threads=16, tile_m=4, tile_n=4, from_tokens_per_slot=2),
        # Two warps, so that their partial tiles are added as on the GPU; every rank in one
        # block up to r=64 (ops.operands.MMA_ONE_BLOCK_RANK) ...
        LaunchConfig(
            "mma", threads=64, tile_m=16, tile_n=0, spread=False, from_tokens_per_slot=4, to_rank=64
        ),
        # ... a block per 8 ranks, at any rank ...
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=8, from_tokens_per_slot=4, from_rank=5),
        # ... and past r=64 a block per 64 ranks, as on the GPU (fewer blocks, and so fewer
        # Python threads, than 8 ranks a block).
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=64, from_tokens_per_slot=4, from_rank=65),
        # The slices' ranks side by side, 16 of them a block (so that a group straddles the
        # slices of the simulator's small ranks), as the GPU's below: timed by the tuner only.
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=16, joint=True, tuned_only=True),
        # x and A staged in shared memory, each of two warps 8 of a block's 16 ranks (as the
        # GPU's below): timed by the tuner only.
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=16, staged=True, tuned_only=True),
    ),
    "expand": (
        LaunchConfig("rows", threads=16, tile_m=1, tile_n=16, spread=False),
        LaunchConfig("rows", threads=8, tile_m=1, tile_n=32, spread=False, vec=4, from_tokens=6),
        # One warp of lane groups: 32 / lanes rows of B at a time.
        LaunchConfig("lanes", threads=32, tile_m=1, tile_n=0, spread=False, vec=2, from_rank=8),
        LaunchConfig("rows", threads=16, tile_m=4, tile_n=16, spread=False, from_tokens_per_slot=2),
        LaunchConfig(
            "rows", threads=8, tile_m=2, tile_n=32, spread=False, vec=4, from_tokens_per_slot=3
        ),
        LaunchConfig("tiled", 8, 4, 8, micro=(2, 2), chunk=4, from_tokens_per_slot=3, from_rank=4),
        # One warp, four 8-column tiles: a 16-byte word of output per lane and row where
        # the output allows; each block walks two column groups.
        LaunchConfig("mma", threads=32, tile_m=16, tile_n=32, passes=2, from_tokens_per_slot=4),
        # The rank in chunks of 32 (as two of the GPU's, below): timed by the tuner only.
        LaunchConfig("mma", threads=32, tile_m=16, tile_n=32, chunk=32, tuned_only=True),
        # The buffer and B staged in shared memory, two warps of 16 columns (as the GPU's
        # below; 16 tokens, a tile size the simulator has): timed by the tuner only.
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=32, staged=True, tuned_only=True),
    ),
}


def _every_rank_to_32(threads: int, tile_m: int, ahead: int = 1) -> LaunchConfig:
    """A tensor-core shrink block that walks every rank itself, up to r=32 (past it, more
    registers than these blocks keep without spills), taken by the tuner only."""
    return LaunchConfig(
        "mma", threads, tile_m, 0, spread=False, to_rank=32, ahead=ahead, tuned_only=True
    )


#: Thresholds from the H200 (`bench --all-configs`, docs/benchmarks/README.md, v4 to v8):
#: the fastest configuration of each case, bf16 with r=16 and 64, one slice and QKV. Since
#: v32 moved where the tuner's table says (punica_numba/configs/NVIDIA_H200.json, tuned at
#: cc380e6: the quick grid and Llama-3-8B's four layers at r=32 and 128, 394 problems, bf16,
#: every configuration timed on each; "the tuned table" below): the heuristic's time over
#: the fastest configuration's, geometric mean over those problems, went from 1.23x to
#: 1.15x (shrink) and 1.21x to 1.05x (expand). On the H200 the table itself answers for the
#: problems near it; these rules are what other GPUs, and shapes far from it, get.
_GPU_CONFIGS = {
    "shrink": (
        # Below 16 tokens, a token per slot: 2 ranks per block, so twice the blocks (each
        # loads half the rows of A) of 4 (T=1 3.01 -> 2.87 µs, v5's run against v6's).
        LaunchConfig("rows", threads=256, tile_m=1, tile_n=2),
        # From 16 on, 4 ranks per block (16 distinct 3.97 -> 3.87 µs, 256 distinct 15.29
        # -> 14.46, QKV 33.8 -> 29.1, the same runs) ...
        LaunchConfig("rows", threads=256, tile_m=1, tile_n=4, from_tokens=16),
        # ... and from T=128 on, more (smaller) blocks hide latency better (T=256
        # distinct 18.0 -> 14.9 µs in v5's run); below, they lose (T=1: 3.1 -> 3.8).
        # Since v13 8 ranks a block (h200_v13_candidates.json, two runs each: 256
        # distinct 13.8/13.9 -> 13.0/13.0 µs; QKV 29.5/29.2 -> 29.9/29.8, r=64 38.4/38.2
        # -> 38.0/39.3; the same sums, so the same bits: the arithmetic depends only on
        # the threads).
        LaunchConfig("rows", threads=128, tile_m=1, tile_n=8, from_tokens=128),
        # Split K: where K is long and the tiles few, the blocks above are few for 132
        # SMs, each walking all of K (T=32 over 8 LoRAs at r=16: 128 blocks of 14336
        # elements); eight chunks of K make 2-4 blocks an SM there. Measured by the tuner
        # on the H200 (punica_numba/configs/NVIDIA_H200.json, at cc380e6: Llama-3-8B's
        # down projection, K=14336, r=32 and 128, T=1-32), it was never the fastest: the
        # row shrink of 2 ranks a block took 4.80 µs against 5.25 at T=1, 6.04 against
        # 6.94 at T=8 over 8 LoRAs, 9.01 against 9.31 at T=32 over 6 (r=32). So the
        # heuristic leaves them to the tuner (``tuned_only``); both add the same sums.
        # (Every split time measured before 8e0a61b carries a fill of the counters in the
        # captured graph, 1.2-1.5 µs a call on an H100: kernels/shrink_split.py, "The
        # workspace". Without it, on an H100, this block still took 9.43 µs against the
        # rows' 9.04 at T=32 over 8 LoRAs, r=32.)
        LaunchConfig(
            "split",
            threads=128,
            tile_m=4,
            tile_n=4,
            splits=8,
            from_hidden=8192,
            to_tokens_per_slot=8,
            to_tiles=32,
            tuned_only=True,
        ),
        LaunchConfig(
            "split",
            threads=128,
            tile_m=1,
            tile_n=4,
            splits=8,
            from_hidden=8192,
            to_tokens_per_slot=2,
            to_tiles=32,
            tuned_only=True,
        ),
        # Tiles of 4 tokens from T=128 on (the tuned table: at T=16-64 on one LoRA a token a
        # block is faster, 1.87 against 4.88 µs at T=16, r=16; at T=128 on one LoRA, r=32,
        # tiles of 4 win among the row shrinks, 6.79 against 6.94) ...
        LaunchConfig(
            "rows", threads=256, tile_m=4, tile_n=4, from_tokens_per_slot=12, from_tokens=128
        ),
        LaunchConfig(
            "rows", threads=128, tile_m=4, tile_n=4, from_tokens_per_slot=12, from_tokens=1024
        ),
        # Tensor cores (where the call's dtypes and layout allow them). Since v9 each warp
        # reads 16 bytes of a row at a time and loads one pass ahead. From 8 tokens per
        # slot at r >= 33 (v10): 16 warps, a block per 8 ranks, so that a few tiles still
        # make many blocks (r=64, 64/8: 13.4 µs by rows -> 6.07; every rank in one block
        # of 8 warps 17.4). Blocks of a rank group hold that group's registers whatever the
        # rank, so these and the 16-rank groups below take r=128 and 256 too (a block per
        # group along grid.y: 32 at r=256). Since v32 from 3 tokens per slot at any rank,
        # where the products have 3072 rows or more (T x rank x slices): the tuned table
        # has them beat the rows there at every rank (r=64 QKV at T=64 on one LoRA 5.85
        # against 19.9 µs; r=128 at T=32 over 6 LoRAs 5.98 against 6.61) and lose below
        # (T=16 on one LoRA at r=64, 1024 rows: 5.57 against 2.73) ...
        LaunchConfig(
            "mma",
            threads=512,
            tile_m=16,
            tile_n=8,
            from_tokens_per_slot=3,
            from_work=3072,
        ),
        # ... and as its blocks (tiles x slices x rank groups) grow past what the SMs hold
        # at once, blocks of more ranks: each reads its tile's rows of x once for its
        # ranks, so wider groups read x fewer times, and fewer threads a block split K
        # less finely. 16 warps of 16 ranks from 64 such blocks (v10 took them at r >= 33
        # from 16 tokens a slot and T=256: r=64 256/16 18.4 µs with 8 warps of every rank
        # -> 8.16, 256/1 16.5 -> 6.69), 8 warps of 16 from 256 (v10 from T=1024: 1024/32
        # 20.5 -> 16.0; 16 warps 17.1), and from r=33 4 warps of 64 ranks from 128 blocks
        # of theirs (the tuned table had them fastest at r=128 from T=512 on, at every
        # spread: T=8192 on one LoRA 92.6 µs, 8 warps of 16 ranks 162; T=2048 over 256 LoRAs
        # 92.6, 16 warps of 8 ranks 195; past r=64 x is read again by each group of 64
        # ranks, mostly from L2). By blocks, not tokens a slot: in both tuned tables the
        # 8-rank blocks lost up to 2.4x at 4 tokens a slot over 256 LoRAs (T=1024-2048),
        # where a rule on tokens a slot never reached these. Weighed on their recorded
        # times (lab notes, "The heuristics by their blocks"), with the 16 warps of every
        # rank below left to the tuner, the heuristic's shrinks take 1.065x the fastest on
        # the H200's 302 problems (1.159x by tokens a slot) and 1.027x on the H100's 64
        # (1.083x); halving or doubling the first two thresholds does about as well, the
        # third does best from 96 to 128 ...
        LaunchConfig(
            "mma", threads=512, tile_m=16, tile_n=16, from_tokens_per_slot=3, from_blocks=64
        ),
        LaunchConfig(
            "mma", threads=256, tile_m=16, tile_n=16, from_tokens_per_slot=3, from_blocks=256
        ),
        LaunchConfig(
            "mma",
            threads=128,
            tile_m=16,
            tile_n=64,
            from_tokens_per_slot=3,
            from_rank=33,
            from_blocks=128,
        ),
        # ... and, up to r=64, 4 warps of every rank wherever they make 1024 blocks or more
        # (tiles x slices; past r=64 the outputs of every rank would not fit a thread's
        # registers: ops.operands.MMA_ONE_BLOCK_RANK). With that many blocks every SM has
        # work without a block's warps splitting K among them, and a split then only costs
        # the adding up of the warps' sums. The MoE op's tiles (about a tile per 16 pairs, 8
        # pairs a token) reach that count from about 1024 tokens at w13 and 2048 at w2,
        # and the tuned MoE entries had 4 warps fastest on 29 of their 32 tensor-core
        # shrinks, within 4 % on two more and 1.07x on the last, at 128 blocks (K=768 and
        # 2048: w13 at r=64, 8192 pairs on one adapter, 1024 blocks, 273.7 µs with 16 warps
        # of 8 ranks, 122.3 with these). Weighed on the recorded times (lab notes, "4 warps
        # a block from 1024 blocks"), the heuristic's MoE tile shrinks went from 1.086x the
        # fastest to 1.020x (the largest 1.38x to 1.13x) and its dense shrinks stayed at
        # 1.064x (H200) and 1.027x (H100); from 512 blocks the MoE ones did better (1.013x)
        # and the H100's dense ones worse (1.030x) ...
        LaunchConfig(
            "mma",
            threads=128,
            tile_m=16,
            tile_n=0,
            spread=False,
            from_tokens_per_slot=3,
            to_rank=64,
            from_blocks=_FOUR_WARPS_FROM_BLOCKS,
        ),
        # 16 warps of every rank up to r=32 (from r=33 on ptxas wanted 129-140 registers a
        # thread, more than a 512-thread block can have) beat the row kernels from 16 tokens
        # a slot and T=256 (v9's run of every configuration: 256/16 8.5 -> 7.5 µs, QKV
        # 256/16 14.3 -> 8.0, 256/1 6.9 -> 6.7), and the heuristic took them there until
        # f864c5a; with the rank groups by blocks above, both tuned tables have those
        # faster wherever these were reached, and never taking them did better than taking
        # them up to any count of blocks. Timed by the tuner only ...
        LaunchConfig(
            "mma",
            threads=512,
            tile_m=16,
            tile_n=0,
            spread=False,
            from_tokens_per_slot=16,
            from_tokens=256,
            to_rank=32,
            tuned_only=True,
        ),
        # From 16 tokens per slot too, the tensor-core shrink with K split (v33,
        # :mod:`.kernels.shrink_mma_split`): at K=14336 its blocks of the whole K took
        # 12 µs at every token count from 1 to 128 (the tuned table at cc380e6), a chain of
        # ~14 passes of loads each, on as few as 8-32 blocks. Timed by the tuner at 27cff5c
        # on 120 shrinks (K = 4096, 9728, 14336, 28672; r = 16-128; T = 1-2048 on 1 or 8
        # LoRAs; h200_v33_split_probe.json), it won where the unsplit blocks (tiles x
        # slices x 8-rank groups) are at most 32, each slot has 16 tokens or more and the
        # products have 2048 rows or more, from K=9728 on. Up to 32 blocks, in 4 chunks
        # (T=128 on one LoRA, r=32: K=14336 12.15 -> 9.04 µs, K=28672 21.98 -> 12.07, K=9728
        # 9.59 -> 8.35; T=32 on one LoRA, r=128: K=28672 21.55 -> 12.66) ...
        LaunchConfig(
            "mma",
            threads=512,
            tile_m=16,
            tile_n=8,
            splits=4,
            from_tokens_per_slot=16,
            from_hidden=9728,
            from_work=2048,
            to_blocks=32,
        ),
        # ... up to 16, in 8 (T=128 over 8 LoRAs, r=16: K=14336 11.87 -> 9.01, K=28672 18.49
        # -> 11.26; T=32 on one LoRA, r=64: K=14336 11.22 -> 8.34). It lost everywhere else
        # measured: at T <= 8 (up to 3.5x at K=4096, T=1) and from 64 blocks on (up to 2.5x at
        # T=2048). Those figures are in-sample: no other shape was timed.
        LaunchConfig(
            "mma",
            threads=512,
            tile_m=16,
            tile_n=8,
            splits=8,
            from_tokens_per_slot=16,
            from_hidden=9728,
            from_work=2048,
            to_blocks=16,
        ),
        # Back to blocks of the whole K. At T=4096 and r=64 4 warps of every rank won
        # (4096/64: 42.8 -> 32.4 µs, 4096 on one LoRA 37.6 -> 26.7; 16-rank groups lost
        # there, 40.3 with 4 warps of 32); the rules on blocks above reach them there (the
        # 64-rank groups, within 5 % of the blocks of every rank at every rank up to 64 in
        # both tuned tables). 8 warps of every rank at T=4096 and r <= 32 (v10's run:
        # 4096/64 18.7 -> 18.0 µs, 4096 on one LoRA 17.6 -> 15.9, against v9's 16 warps of 32
        # tokens, which also needed 132-140 registers a thread from r=17 on; v9 already used
        # these blocks at T=256, before the 16-warp row, and a configuration has one place),
        # up to 1023 blocks, where the 4 warps above take over (in the tuned MoE entries
        # these took up to 1.38x their time) ...
        LaunchConfig(
            "mma",
            threads=256,
            tile_m=16,
            tile_n=0,
            spread=False,
            from_tokens_per_slot=64,
            from_tokens=4096,
            to_rank=32,
            to_blocks=_FOUR_WARPS_FROM_BLOCKS - 1,
        ),
        # ... and 4 warps of 32 tokens with three slices (QKV 4096/64: 40.3 -> 28.2 µs; one
        # slice 22.9), whose blocks share x through L2 (a tile's slices are neighbours).
        LaunchConfig(
            "mma",
            threads=128,
            tile_m=32,
            tile_n=0,
            spread=False,
            from_tokens_per_slot=64,
            from_tokens=4096,
            to_rank=32,
            from_slices=3,
        ),
        LaunchConfig("mma", threads=128, tile_m=16, tile_n=8, splits=8, tuned_only=True),
        # Splits with their runs added up in one thread block cluster
        # (kernels.shrink_mma_cluster; compute capability 9.0): the same blocks and the same
        # bits as their twins of counters, with no workspace, counter or fence. On an H100 at
        # 38688e3 (h100_split_clusters_38688e3.json: K=14336, 32 tokens over 8 LoRAs) the
        # clusters of 4 and 8 warps took 0.45-0.64 µs less than their twins at r=32 and r=16
        # (8 warps of 8 ranks in 8 runs: 8.34 -> 7.89 and 7.07 -> 6.57 µs), those of 16 warps
        # 0.56-0.61 less at r=16 (16 ranks in 8 runs: 6.98 -> 6.37, the fastest there) and
        # 3.7-4.4 more at r=32; 16 warps of 8 ranks in 8 runs lost at both and is left out.
        # Timed by the tuner only, until a GPU's table says where they win.
        LaunchConfig(
            "mma", threads=512, tile_m=16, tile_n=8, splits=4, cluster=True, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=512, tile_m=16, tile_n=16, splits=8, cluster=True, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=128, tile_m=16, tile_n=8, splits=8, cluster=True, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=256, tile_m=16, tile_n=8, splits=8, cluster=True, tuned_only=True
        ),
        # Timed by the tuner only (the one above too): 16-rank groups in 16 chunks were the
        # fastest on 5 of the 120 shrinks above (K=28672 r=64 T=32 over 8 LoRAs 17.57 ->
        # 16.10 µs), with no rule of thresholds that holds them apart.
        LaunchConfig("mma", threads=128, tile_m=16, tile_n=16, splits=16, tuned_only=True),
        # Two passes of loads on their way (kernels.shrink_mma, "Passes ahead"), twins of the
        # table's picks where an H100's profile had the warps waiting on memory (79f3af9, the
        # one-LoRA prefill at r=16): 72 -> 128 registers for 8 warps of 16 tokens, 124 -> 136
        # for 4 of 32, no spills (probes/shrink_ahead_static.py). On an H100 at 7ffe03b
        # (h100_retime_ahead_7ffe03b.json, 92 of the H200 table's shrinks at r=16 and 32) these
        # were the fastest on 6, 1.02-1.13x its pick (the down projection at r=32, 8192 tokens
        # on one LoRA 134.0 -> 118.4 µs); where their one-pass twin is the pick, 1.01x and 1.00x
        # its time in geometric mean; at the prefill 17.5 µs against 14.8. Timed by the tuner
        # only. (8 warps of 16-rank groups and 16 warps in 4 runs of K, 1.08x and 1.07x their
        # twins' time there, were removed.)
        _every_rank_to_32(256, 16, ahead=2),
        _every_rank_to_32(128, 32, ahead=2),
        # The MoE op's tiles (ops.moe_dense: 16-pair tiles of one (slot, expert)) took the
        # fewest warps offered at every call of 1024 or more tokens of the H200 table's MoE
        # entries (9fd11ec: 4 warps, 0.61-0.93x the best of 8), so fewer warps again, and 4
        # warps with two passes ahead: for sm_90 at r=16 (r=32) 126 (130) registers against
        # one pass's 86 (100), 2 warps 128 (136), no spills (probes/shrink_ahead_static.py). On
        # an H100 at 2c4bce5 (tune --moe --quick) the op was fastest with 2 warps on 15 of the
        # 24 tile shrinks at r=16 and with 4 warps two passes ahead on 2, 0.92-1.00x its time
        # under the best of the others (lab notes, "Version 16 on an H100, ..."). Timed by the
        # tuner only. (2 warps two passes ahead, 162 registers, won none there: removed.)
        _every_rank_to_32(128, 16, ahead=2),
        _every_rank_to_32(64, 16),
        # A layer's slices in one block, their ranks side by side (kernels.shrink_mma_joint):
        # a tile's rows of x read once, not once a slice. In the H200's grid (h200_grid.json,
        # 23fb2ea) the shrinks of 8192 tokens whose floor is mostly x reach 77-87 % of the
        # copy bandwidth on one slice and 30-53 % on three. 16 warps of 24 joint ranks
        # (QKV at r=8 in one group, at r=16 in two) and 8 warps of 48 (QKV at r=16 and
        # gate_up at r=16 and 24 in one): 122 and 174 registers for sm_90, no spills (ptxas
        # 13.0, not timed). Timed by the tuner only, until the H200 says where they win.
        LaunchConfig("mma", threads=512, tile_m=16, tile_n=24, joint=True, tuned_only=True),
        LaunchConfig("mma", threads=256, tile_m=16, tile_n=48, joint=True, tuned_only=True),
        # x and A staged in shared memory, the warps splitting the block's ranks, not K
        # (kernels.shrink_mma_staged): a block of 32 tokens x 128 ranks reads A once a 32-token
        # tile and x once 128 ranks. In the grid the shrinks at r=128 with hundreds of tokens
        # a slot reach 11-24 % of the copy bandwidth in blocks of 16 x 64, whose re-reads
        # through L2 account for their time (the kernel's notes). Four warps of 32 ranks or of
        # 16, eight of 16, 16-token tiles of 32-rank warps, and K in 4 runs for calls of few
        # tiles. Timed by the tuner only: the H200's table takes them for 18 of its 143
        # shrinks at r=64 and 128, all of 2048+ tokens (1.05-1.92x; lab notes, a685072).
        LaunchConfig("mma", threads=128, tile_m=32, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=32, tile_n=64, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=256, tile_m=32, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=16, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig(
            "mma", threads=128, tile_m=32, tile_n=128, splits=4, staged=True, tuned_only=True
        ),
        # ... tiles of 64 tokens for thousands of tokens a slot, reading A half as often
        # again: four warps of 32 ranks (136 registers for sm_90) or of 16 (96), eight of 16
        # (79), no spills (ptxas 13.0, probes/shrink_staged_static.py). (Each tile size is a
        # table the metadata fills at every step, so none larger.) ...
        LaunchConfig("mma", threads=128, tile_m=64, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=64, tile_n=64, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=256, tile_m=64, tile_n=128, staged=True, tuned_only=True),
        # ... tiles of 64 tokens at r <= 32 in two warps of 16 ranks: on an H100 at bdffb97
        # (h100_retime_small_rank_staged_bdffb97.json, beside the H200 table's picks on its
        # 159 shrinks at r=16 and 32) the fastest on 6, all r=32 with 8192 tokens, 1.05-1.44x
        # (QKV on one LoRA 86.9 -> 60.2 µs, gate_up on one 64.7 -> 50.8); 122 registers, no
        # spills. One warp of 16 ranks, two of 8, and both sizes with K in 4 runs won none and
        # were removed: at r=16 a block's chunk took ~330 ns whatever its warps (40-47 µs for
        # 128 chunks with 16 or 64 blocks, 1024 or 4096 tokens on one LoRA: 7.1 and 14.8 for
        # the table's picks); K in 4 runs took 22.0 and 28.6 there ...
        LaunchConfig("mma", threads=64, tile_m=64, tile_n=32, staged=True, tuned_only=True),
        # ... and a small block with K in 8 runs, 7 chunks copied ahead of the one multiplied
        # (a small block's 8 stages): on an H100 the fastest at r=128, K=14336, 512 tokens on
        # one LoRA (37.1 -> 35.8 µs), and on none of the other 127 it was timed on. Blocks of
        # 16 x 16 and 16 x 32 in 16 and 32 runs, for the down projections' few tokens a slot,
        # and two warps of 8 ranks for r <= 16 won nowhere there (h100_retime_staged_255c04c
        # .json: the split blocks took 6.6 µs or more, with the counters' fill, where the
        # table's rows took 1.7) and were removed.
        LaunchConfig(
            "mma", threads=128, tile_m=16, tile_n=64, splits=8, staged=True, tuned_only=True
        ),
        # ... and the slices' ranks side by side in them (a tile's rows of x read once for
        # every slice, each copy's row of A chosen once): QKV at r=16 in three warps of 16,
        # gate_up at r=32 in four, QKV at r=32 and gate_up at r=64 in four warps of 32.
        LaunchConfig(
            "mma", threads=96, tile_m=32, tile_n=48, joint=True, staged=True, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=128, tile_m=32, tile_n=64, joint=True, staged=True, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=128, tile_m=32, tile_n=128, joint=True, staged=True, tuned_only=True
        ),
        # ... and deeper rings in dynamic shared memory (kernels/shrink_mma_staged.py, "Deeper
        # rings"): 48 KB held 3-7 chunks of K ahead. Timed on an H100 (1ff097d,
        # h100_deep_rings_1ff097d.json, the H200 table's 76 shrinks at r=128) they were the
        # fastest on 3, all of 8192 tokens: 64 x 128 in 12 stages at K=14336 on one LoRA
        # (222.5 -> 191.2 µs against its 4-stage twin), 32 x 128 in 16 and in 8 on QKV over
        # 256 and 91 LoRAs (1.08x, 1.02x). Elsewhere the declared rings were as fast or
        # faster: a block's chunk is a chain inside the SM (copies, wait, barrier, loads from
        # the stage, products), not a wait on memory, and a block of 32 x 128 took 42 µs at
        # K=4096 whatever its stages. 64 x 128 in 8 stages of eight warps won nowhere and was
        # removed. Timed by the tuner only.
        LaunchConfig(
            "mma", threads=128, tile_m=32, tile_n=128, staged=True, stages=8, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=128, tile_m=32, tile_n=128, staged=True, stages=16, tuned_only=True
        ),
        LaunchConfig(
            "mma", threads=128, tile_m=64, tile_n=128, staged=True, stages=12, tuned_only=True
        ),
    ),
    "expand": (
        # For a call whose rows of B do not split among lanes (below).
        LaunchConfig("rows", threads=128, tile_m=1, tile_n=128),  # T=1: 3.0 µs, v4's 3.6
        # Rows of B split among lanes (v10), where the rank allows: below 16 rows two
        # warps, a lane group a column (T=1: 3.06 -> 2.69 µs; r=64 5.03 -> 3.25, the same
        # run; 2.95 in another) ...
        LaunchConfig("lanes", threads=64, tile_m=1, tile_n=0, vec=1),
        # From 16 rows on, 4 columns per thread: one load of the buffer feeds 4 products
        # (T=256 distinct 27.0 -> 16.7 µs, QKV 49.1 -> 26.9, r=64 86.4 -> 82.7); up to 12
        # tokens per slot one token per block too (64/8: 5.2 µs, 4 tokens x 1 column 6.8);
        # at r=16 it beats the lanes (T=256 distinct 15.0 µs against 17.4) ...
        LaunchConfig("rows", threads=128, tile_m=1, tile_n=512, vec=4, from_tokens=16),
        # ... not at r >= 33: four warps of lanes, 4 columns a group (r=64: T=16 distinct
        # 13.3 -> 6.67 µs, T=64 distinct 28.2 -> 16.8, T=256 distinct 82.9 -> 53.5), from
        # T=8 since the lanes come before the tensor cores past r=64 (above; at T=8 a token a LoRA
        # the H200's table had it at 0.25-0.47x the two-warp lanes' time on r=128's three
        # layers, 0.40-0.93x on r=32's) ...
        LaunchConfig("lanes", threads=128, tile_m=1, tile_n=0, vec=4, from_tokens=8, from_rank=33),
        # ... 16 columns a group from T=64. v13 took 8 (h200_v13_candidates.json, two runs
        # each: r=64 T=64 distinct 15.70/15.85 -> 15.28/15.22 µs, T=256 distinct 52.0/52.5
        # -> 47.1/47.4; at T=16 8 columns lost, 6.20 -> 7.40/7.53); the three
        # rounds at f738c46 (`h200_v24_candidates.json`) had 8 at 15.17/15.24/15.72 and 16 at
        # 15.18/15.20/15.18 on 64 distinct, 47.66/46.62/47.62 and 47.46/47.33/47.18 on 256.
        # The lanes' sums do not depend on the columns a group takes: the same bits.
        LaunchConfig(
            "lanes", threads=128, tile_m=1, tile_n=0, vec=16, from_tokens=64, from_rank=33
        ),
        # Many tokens per slot at rank <= 32: 4 tokens x 4 columns per thread beat the
        # shared-memory tiles (T=4096 on one LoRA 102 -> 76 µs, 1024/32 29.8 -> 23.0) ...
        LaunchConfig("rows", threads=128, tile_m=4, tile_n=512, vec=4, from_tokens_per_slot=12),
        # ... but not at r=64, where the tiles reuse each B row across 16 tokens from
        # shared memory (256/16 at r=64: 18.5 µs tiled, 32 by rows).
        LaunchConfig(
            "tiled",
            128,
            tile_m=16,
            tile_n=128,
            micro=(4, 4),
            chunk=16,
            from_tokens_per_slot=12,
            from_rank=33,
        ),
        LaunchConfig(
            "tiled",
            256,
            tile_m=32,
            tile_n=128,
            micro=(4, 4),
            chunk=16,
            from_tokens_per_slot=128,
            from_rank=33,
        ),
        # Tensor cores (bf16 or fp16, where the call's layout allows), from 8 tokens per slot: the
        # FFMA kernels above are bound by issuing instructions (v8's run of every
        # configuration: 64/8 4.9 -> 4.6 µs, 256/16 8.8 -> 5.9, 256/1 7.5 -> 5.3, 1024/32
        # 23.2 -> 12.8, 4096 on one LoRA 77 -> 32). One warp of two 8-column tiles per
        # block (v9: 256/16 5.56 µs, 256/1 4.66, QKV 256/16 7.43, r=64 256/16 8.81). Since
        # v12 a lane reads and writes 16-byte words of output where the output allows
        # (h200_v12_candidates.json, 8-byte words -> 16 within one run: 64/8 4.08 -> 3.69
        # µs, 256/16 5.41 -> 4.92, 4096 on one LoRA with two passes 25.9 -> 24.0; r=64
        # 4096/64 with eight passes 48.8 -> 43.7 with the 128-register ceiling, 59.1
        # without). With the dependent launch (v26's kernels, h200_v27_candidates.json, three
        # rounds at r=64 256/16) blocks of 2 or 4 such warps tie (6.37-6.61, 6.42-6.65
        # against 6.24-6.46 µs) and every other shape loses. Past r=64 it and the next walk
        # the rank in chunks of 64 (kernels.expand_mma, "Ranks past 64": a chunk's
        # registers are r=64's), so they take r=128 and 256 too; the tensor cores' lead
        # over the FFMA kernels, bound by issuing instructions, can only grow with the
        # rank, but past r=64 they are not yet measured (the tuner, ``python -m
        # punica_numba tune``, times every configuration of this table). Since v32 from T=8
        # whatever the tokens per slot (the tuned table: with 8 or more rows the tensor
        # cores beat the FFMA expands at every spread of the 394 problems but T=8-32 at
        # r=128 on many LoRAs; T=32 over 6 LoRAs at r=32, gate_up: 6.44 µs against 21.8;
        # T=16 distinct at r=16: 2.41 against 3.34) ...
        LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens=8),
        # ... and two warps of four a block, each block walking two column groups (v9 and
        # v11 from 1024 rows: 4096 on one LoRA 28.9 -> 27.4 µs, QKV 4096/64 53.7 -> 43.4;
        # with one pass half the blocks of the 1024-wide slices had nothing to do), from
        # 1024 such blocks on (the tiles x the slices x the widest slice's 256-column
        # groups), however the tokens spread: the one-warp blocks above are then four
        # times as many, past the SMs' room for resident blocks, and each does less. In
        # the H200's and the H100's tuned tables (lab notes, "The heuristics by their
        # blocks") the one-warp tile took up to 1.8x this one's time at a token a LoRA over
        # 64-256 LoRAs; with this threshold (any from 512 to 2048 does as well) the
        # heuristic's expands take 1.039x the fastest on the H200's problems (1.062x from 8
        # tokens a slot and 1024 rows) and 1.017x on the H100's (1.040x), at worst 1.13x
        # there (1.53x) ...
        LaunchConfig(
            "mma",
            threads=64,
            tile_m=16,
            tile_n=128,
            passes=2,
            from_tokens=8,
            from_blocks=1024,
        ),
        # ... eight at r >= 33 from T=4096, where a tile's buffer rows (r=64: 32 registers
        # of fragments a lane) are loaded once for more columns (4096/64 57.6 -> 50.6 µs;
        # four passes 52.7, sixteen 65.0). Up to r=64: past it a block loads each chunk
        # of the rows again for each column group, so that gain is gone (two passes
        # above; neither measured past r=64).
        LaunchConfig(
            "mma",
            threads=64,
            tile_m=16,
            tile_n=128,
            passes=8,
            from_tokens_per_slot=8,
            from_tokens=4096,
            from_rank=33,
            to_rank=64,
        ),
        # Below T=1024, from 128 tokens per slot up to r=16, one warp of 128 columns: half
        # the blocks, each with twice the columns (at 81d009e, `h200_v23_candidates.json`,
        # three rounds: 256 on one LoRA 3.85/3.84/3.76 -> 3.67/3.59/3.58 µs, the QKV
        # layer's 4.62/4.73/4.72 -> 4.52/4.54/4.60; at 64/8 it would lose, 3.30/3.35/3.35
        # -> 3.33/3.37/3.38; at r=64 a lane would hold 64 words of B).
        LaunchConfig(
            "mma",
            threads=32,
            tile_m=16,
            tile_n=128,
            from_tokens_per_slot=128,
            to_tokens=1023,
            to_rank=16,
        ),
        # With one slice, four such warps a block (at f738c46, `h200_v24_candidates.json`,
        # three rounds: 256 on one LoRA 3.71/3.64/3.62 -> 3.61/3.61/3.58 µs). Not with the
        # QKV layer's slices, whose 1024 columns would leave most of its blocks idle
        # (4.48/4.44/4.43 -> 4.92/4.82/4.79).
        LaunchConfig(
            "mma",
            threads=128,
            tile_m=16,
            tile_n=512,
            from_tokens_per_slot=128,
            to_tokens=1023,
            to_rank=16,
            to_slices=1,
        ),
        # The tensor-core expands above hold the rank in chunks of 64 (kernels.expand_mma,
        # "Ranks past 64"), and ptxas gives the one-warp build at r=128 180 registers (fp16
        # B) or 184 (bf16), held to the 128 of kernels.expand_mma.MAX_REGISTERS with 80 or
        # 44 bytes of spills; in chunks of 32, 132 and 12 or 20 bytes (sm_90, ptxas 13.0,
        # the build of probes/expand_f16_static.py; not timed). The one-warp and the two-warp
        # tiles with chunks of 32: timed by the tuner only, at every rank (a table may name
        # them; forced, they run).
        LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, chunk=32, tuned_only=True),
        LaunchConfig("mma", threads=64, tile_m=16, tile_n=128, passes=2, chunk=32, tuned_only=True),
        # The buffer and B staged in shared memory, copied chunks ahead of the products, in
        # tiles of 32 or 64 tokens (kernels.expand_mma_staged): for ranks past 64 with many
        # tokens a slot, where the blocks above wait on their loads of B a rank step at a
        # time (14-24 % of the copy bandwidth at r=128 and 256 in the grid). Warps of 16
        # tokens x 64 columns (or 128), 2-5 stages. Timed by the tuner only: the H200's table
        # takes 64 x 128 in eight warps for 6 of its 89 expands at r=64 and 128 (r=128, 512
        # and 2048 tokens on one LoRA, 1.06-1.16x) and the others lose (lab notes, de8fe2e).
        LaunchConfig("mma", threads=64, tile_m=32, tile_n=64, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=64, tile_n=64, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=32, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=256, tile_m=64, tile_n=128, staged=True, tuned_only=True),
        LaunchConfig("mma", threads=128, tile_m=64, tile_n=128, staged=True, tuned_only=True),
    ),
}

_forced: dict[str, LaunchConfig] = {}


def forced_launch_configs() -> tuple:
    """The configurations forced now (:func:`force_launch_config`), as ``(op, config)``
    pairs: a key for whatever was chosen under them."""
    return tuple(_forced.items())


#: The machines whose configuration tables :func:`launch_configs` can give.
MACHINES = ("gpu", "simulator")


def launch_configs(op: str, machine: str | None = None) -> tuple[LaunchConfig, ...]:
    """Every configuration the heuristic can pick for ``op`` on this machine (or on
    ``machine``, "gpu" or "simulator", e.g. to weigh the GPU's heuristic against a tuned
    table on a CPU): the FFMA ones, then the tensor-core ones, each in the order of
    ``from_tokens_per_slot``."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if machine is None:
        machine = "simulator" if SIMULATOR else "gpu"
    if machine not in MACHINES:
        raise ValueError(f"machine must be one of {MACHINES}, got {machine!r}")
    return (_SIMULATOR_CONFIGS if machine == "simulator" else _GPU_CONFIGS)[op]


def tile_sizes() -> tuple[int, ...]:
    """The token tiles of every configuration on this machine (``LoRAKernelMeta`` keeps
    a tile table for each)."""
    return tuple(sorted({c.tile_m for op in OPS for c in launch_configs(op)}))


def tile_token_sizes() -> tuple[int, ...]:
    """The token tiles whose tokens some configuration on this machine reads from a row
    of their own (:meth:`LaunchConfig.reads_tile_tokens`; ``LoRAKernelMeta`` keeps those
    rows for these sizes only)."""
    return tuple(
        sorted({c.tile_m for op in OPS for c in launch_configs(op) if c.reads_tile_tokens(op)})
    )


def choose_launch_config(
    op: str,
    num_tokens: int,
    active_slots: int | None,
    rank: int = 0,
    tensor_cores: bool = False,
    slices: int = 1,
    lane_split: bool = False,
    *,
    dtype=None,
    K: int | None = None,
    N: int | None = None,
    machine: str | None = None,
    staged_expand: bool = True,
    moe_kernels: tuple[str, ...] | None = None,
) -> LaunchConfig:
    """Pick a configuration from the tokens per active slot, the row count, the rank and
    the number of slices (host-side facts only): the last tensor-core one whose
    ``from_tokens_per_slot``, ``from_tokens``, ``to_tokens``, ``from_rank``, ``to_rank``,
    ``from_slices``, ``to_slices``, ``from_hidden`` (``K``), ``to_tokens_per_slot``,
    ``to_tiles``, ``to_blocks``, ``from_blocks`` and ``from_work`` (T x rank x slices) the call all
    reaches, when ``tensor_cores`` (the call's dtypes and layout allow them) and there is
    one; otherwise
    the last such FFMA one, lane-split expands included only when ``lane_split`` (the
    call's rows of B split into a few words a lane: :func:`.kernels.expand_lanes.splits`).
    But a lane-split expand so reached comes first where the tokens a slot are fewer than
    the rank's chunks of ``_LANES_FIRST_RANKS_A_TOKEN`` (64) ranks.
    Configurations marked ``tuned_only`` are never picked here.

    ``active_slots`` is None when the metadata was not built by ``LoRAKernelMeta``;
    every token is then taken to have its own slot. ``rank`` 0 (not given) reaches
    no ``from_rank``. A configuration forced with :func:`force_launch_config` wins,
    except one of a kernel the call cannot use and one past its ``to_rank``.

    Next, where the caller gives the weights' ``dtype`` and the product's sizes ``K`` and
    ``N`` (shrink: hidden and rank; expand: rank and the widest slice), this GPU's tuned
    table (:func:`punica_numba.tuning.tuned_config`, read once per process): its answer
    from the nearest tuned problems (their pick on a tuned problem's own key, else the
    configuration nearest the fastest on all of them), under the same rule (a kernel the
    call can use, within its ``to_rank``). Without them, or where the table has nothing near
    or nothing the call can use, the heuristic above.

    ``machine`` ("gpu" or "simulator"; default: this one) picks whose configurations the
    heuristic chooses among (:func:`launch_configs`); with it, no tuned table is read.
    ``staged_expand``: whether the call's operands allow a staged tensor-core expand (an
    fp32 buffer and B in aligned 16-byte pieces: :mod:`.kernels.expand_mma_staged`); a
    forced or tuned one is not taken where they do not.

    ``moe_kernels``: the call is the MoE op's (:mod:`punica_numba.ops.moe_dense`), whose
    path runs configurations of these kernels alone; the table's MoE entries (``tune
    --moe``) of those kernels are consulted before its dense ones.
    """
    configs = launch_configs(op, machine)
    forced = _forced.get(op)
    staged = staged_expand or op != "expand"
    if forced is not None and _can_take(forced, tensor_cores, lane_split, rank, staged):
        return forced
    if machine is None and dtype is not None and K is not None and N is not None:
        key = (op, dtype, slices, K, N, rank, num_tokens, active_slots)
        layers = ([("moe", moe_kernels)] if moe_kernels else []) + [("dense", None)]
        for layer, kernels in layers:
            tuned = tuned_config(*key, layer=layer, kernels=kernels)
            if tuned is not None and _can_take(tuned, tensor_cores, lane_split, rank, staged):
                return tuned
    usable = {"mma": tensor_cores, "lanes": lane_split}
    per_slot = num_tokens / active_slots if active_slots else 1.0
    slots = active_slots or num_tokens  # (foreign metadata: a slot a token)
    hidden = 0 if K is None else K  # (unknown: no from_hidden above 0 is reached)
    chosen = {False: configs[0], True: None}  # the last reached of each kind
    for config in configs[1:]:
        if (
            not config.tuned_only
            and usable.get(config.kernel, True)
            and per_slot >= config.from_tokens_per_slot
            and num_tokens >= config.from_tokens
            and _fits(config.to_tokens, num_tokens)
            and rank >= config.from_rank
            and _fits(config.to_rank, rank)
            and slices >= config.from_slices
            and _fits(config.to_slices, slices)
            and hidden >= config.from_hidden
            and _fits(config.to_tokens_per_slot, per_slot)
            and (config.to_tiles is None or _tiles(config, num_tokens, slots) <= config.to_tiles)
            and _fits(config.to_blocks, _blocks(config, num_tokens, slots, rank, slices))
            and (
                not config.from_blocks
                or _blocks(config, num_tokens, slots, rank, slices, op, N) >= config.from_blocks
            )
            and num_tokens * rank * slices >= config.from_work
        ):
            chosen[config.kernel == "mma"] = config
    if chosen[False].kernel == "lanes" and per_slot * _LANES_FIRST_RANKS_A_TOKEN < rank:
        return chosen[False]
    return chosen[True] or chosen[False]


def _blocks(
    config: LaunchConfig,
    num_tokens: int,
    slots: int,
    rank: int,
    slices: int,
    op: str = "shrink",
    N: int | None = None,
) -> int:
    """The blocks of ``config``'s kernel: its tiles (:func:`_tiles`) x the slices x the
    groups of a tile's outputs a block takes. A shrink's groups are of ``tile_n`` ranks
    (one group where ``tile_n`` is 0; before any split of K); an expand's of ``passes``
    times its columns a block, across the widest slice's ``N`` columns (0 blocks where N
    is not known)."""
    if op == "expand":
        per_block = config.columns_per_block(op) * config.passes
        groups = -(-N // per_block) if N else 0
    else:
        groups = -(-rank // config.tile_n) if config.tile_n else 1
    return _tiles(config, num_tokens, slots) * slices * groups


def _tiles(config: LaunchConfig, num_tokens: int, slots: int) -> int:
    """The tiles of ``config.tile_m`` tokens a call makes, its tokens taken as spread
    evenly over its slots (host facts do not say how they are spread)."""
    return slots * -(-num_tokens // (max(slots, 1) * config.tile_m))


def _can_take(
    config: LaunchConfig, tensor_cores: bool, lane_split: bool, rank: int, staged: bool = True
) -> bool:
    """Whether a call can run ``config`` at all (a forced or tuned one; the heuristic's
    thresholds aside): the tensor cores only when ``tensor_cores``, the lane-split expand
    only when ``lane_split``, a staged configuration only when ``staged``, and no
    configuration past its ``to_rank``."""
    if config.kernel == "mma" and not tensor_cores:
        return False
    if config.staged and not staged:
        return False
    if config.kernel == "lanes" and not lane_split:
        return False
    return _fits(config.to_rank, rank)


def _fits(limit: int | None, value: int) -> bool:
    """Whether ``value`` is within an upper ``limit`` (``to_rank``, ``to_tokens``,
    ``to_slices``, ``to_tokens_per_slot``, ``to_tiles``; None: none)."""
    return limit is None or value <= limit


def config_name(config: LaunchConfig) -> str:
    """A short label, e.g. ``rows_t256_m1_n4``, ``rows_t128_m4_n512_v4`` (4 columns per
    thread), ``tiled_t256_m64_n128_u8x4_c16``, ``mma_t128_m16_n128`` or
    ``mma_t64_m16_n128_p2`` (two column groups per block), ``mma_t32_m16_n64_c32`` (the
    rank's fragments 32 ranks at a time), ``split_t128_m4_n4_k8`` (K in eight chunks) or
    ``mma_t256_m16_n48_j`` (48 of the slices' ranks side by side a block) or
    ``mma_t128_m32_n128_s`` (staged in shared memory; ``_s5``: five stages in dynamic shared
    memory) or ``mma_t256_m16_n0_a2`` (two passes
    of loads ahead) or ``mma_t512_m16_n8_k4_cl`` (K's runs added up in one cluster)."""
    name = f"{config.kernel}_t{config.threads}_m{config.tile_m}_n{config.tile_n}"
    if config.vec > 1:
        name += f"_v{config.vec}"
    if config.passes > 1:
        name += f"_p{config.passes}"
    if config.kernel == "tiled":
        name += f"_u{config.micro[0]}x{config.micro[1]}_c{config.chunk}"
    elif config.chunk:
        name += f"_c{config.chunk}"
    if config.kernel == "split" or config.splits > 1:
        name += f"_k{config.splits}"
    if config.joint:
        name += "_j"
    if config.staged:
        name += f"_s{config.stages}" if config.stages else "_s"
    if config.ahead > 1:
        name += f"_a{config.ahead}"
    if config.cluster:
        name += "_cl"
    return name


@contextlib.contextmanager
def force_launch_config(op: str, config: LaunchConfig):
    """Within the block, every ``op`` launch uses ``config`` (for tests and benchmarks)."""
    if config not in launch_configs(op):
        raise ValueError(f"{config} is not one of the configurations of {op!r}")
    previous = _forced.get(op)
    _forced[op] = config
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(op, None)
        else:
            _forced[op] = previous
