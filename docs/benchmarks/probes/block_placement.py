"""Where the blocks of the tensor-core expand's grid land on the H200's SMs.

A probe for the H200, from the trials after v28 (f4b51fd's package; its runs are
``h200_v33_candidates.json``, ``call6_where_blocks_land``, in git history: ``git show
9807a63:docs/benchmarks/h200_v33_candidates.json``). The expand at r=64, 256 tokens over 16
LoRAs, launches a grid of 33 x 1 x 64 one-warp blocks: along x the tile table's bound (16 tiles
of 16 tokens, and 17 rows more, one for each segment a step may have, 16 LoRAs and none, which
stay empty here), along z 64 groups of 64 columns. In those trials the same launch with exactly
its 16 tiles along x was slower (6.36-6.61 µs against 5.73-6.05), and so were 50 and 66 rows.
One guess was that the 33-row grid happens to put the blocks of one tile on one SM, where they
would share the tile's buffer rows in L1 (132 SMs, four times 33). This probe looks.

Each block of a ``(axis, 1, 64)`` grid of one warp records its SM (``%smid``) and its start
(``%globaltimer``, ns). Blocks in rows below :data:`TILES` ("with a tile") spin for
:data:`SPIN_NS` so that they stay placed, as the op's do; the others leave at once, as the op's
empty blocks do. Dynamic shared memory holds an SM to 12 blocks (18 KiB each), as the asking
build's 160 registers a thread do, or to about 14 (14 KiB). Each variant launches three times;
the last launch is kept. Variants (``VARIANTS``, name: the grid's x and the shared bytes a
block).

Found on the H200 (``call6_where_blocks_land``, two processes; the same in an earlier form of
this probe, ``call3``): blocks are placed on pairs of neighbouring SMs, the pairs 16 SMs apart
(blocks 0-7 on SMs 124-131, then 12, 13, 28, 29, ... or 4, 5, 20, 21, ...), not one SM after
another. With 33 rows an SM got 0-12 blocks with a tile and 0-7 tiles (mostly 3 or 4); with 16
rows 7 or 8 blocks and 3-5 tiles. So the bound's grid neither keeps a tile to one SM nor spreads
the work as evenly as the exact grid, and yet it is the faster of the two. (A launch alone on an
idle GPU; with the dependent launch, blocks are placed while the launch ahead still runs, which
this does not reproduce.) The timelines of consecutive launches in the lab notes
(``docs/benchmarks/lab_notes.md``, ``call7``) suggest that what differs is when blocks are placed.

Run on a GPU from the repository root: ``python docs/benchmarks/probes/block_placement.py``.
Prints one JSON line: for each variant, per SM the blocks with a tile and the distinct tiles,
the SMs of the first 40 blocks, and the spread of the blocks' starts.
"""

import collections
import json

import numpy as np
from numba import int32, int64

from punica_numba._cuda import cuda

#: Rows of the grid that have a tile (256 tokens in tiles of 16), and the groups of columns.
TILES, GROUPS = 16, 64
#: How long a block with a tile stays placed.
SPIN_NS = 3000

VARIANTS = {  # name: (rows along x, dynamic shared bytes a block)
    "bound_33_rows_12_an_sm": (33, 18 * 1024),
    "exact_16_rows_12_an_sm": (16, 18 * 1024),
    "bound_33_rows_14_an_sm": (33, 14 * 1024),
}


def special_register(name: str, numba_type, bits: int):
    """An intrinsic that reads the special register ``%name`` (inline PTX ``mov``; GPU
    only)."""
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    suffix, constraint = ("u32", "=r") if bits == 32 else ("u64", "=l")

    @intrinsic
    def read(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.IntType(bits), []),
                f"mov.{suffix} $0, %{name};",
                constraint,
                side_effect=True,
            )
            return builder.call(asm, [])

        return numba_type(), codegen

    return read


def build(axis: int, shared_bytes: int):
    """The probe kernel for a grid of ``axis`` rows (``shared_bytes`` is given at launch)."""
    smid = special_register("smid", int32, 32)
    clock = special_register("globaltimer", int64, 64)

    @cuda.jit
    def where(out):
        # out[block, :] = (SM, start ns, end ns), blocks numbered as placed: x fastest
        block = cuda.blockIdx.x + axis * cuda.blockIdx.z
        if cuda.threadIdx.x == 0:
            start = clock()
            out[block, 0] = smid()
            out[block, 1] = start
            if cuda.blockIdx.x < TILES:
                while clock() - start < SPIN_NS:
                    pass
            out[block, 2] = clock()

    return where


def placement(rows: np.ndarray, axis: int) -> dict:
    """What one launch's ``(SM, start, end)`` rows say: per SM, the blocks with a tile and
    the distinct tiles among them."""
    per_sm = collections.defaultdict(list)
    for block, (sm, _, _) in enumerate(rows):
        per_sm[int(sm)].append(block % axis)
    with_tile = {sm: [x for x in xs if x < TILES] for sm, xs in sorted(per_sm.items())}
    starts = rows[:, 1] - rows[:, 1].min()
    return {
        "sms": len(per_sm),
        "blocks_with_a_tile_per_sm": [len(xs) for xs in with_tile.values()],
        "tiles_per_sm": [len(set(xs)) for xs in with_tile.values()],
        "sm_of_blocks_0_to_39": [int(sm) for sm in rows[:40, 0]],
        "start_ns_quantiles": [int(q) for q in np.quantile(starts, [0, 0.25, 0.5, 0.75, 1])],
    }


def main() -> None:
    res = {}
    for name, (axis, shared_bytes) in VARIANTS.items():
        kernel = build(axis, shared_bytes)
        out = cuda.to_device(np.zeros((axis * GROUPS, 3), np.int64))
        for _ in range(3):
            kernel[(axis, 1, GROUPS), 32, 0, shared_bytes](out)
        cuda.synchronize()
        res[name] = placement(out.copy_to_host(), axis)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
