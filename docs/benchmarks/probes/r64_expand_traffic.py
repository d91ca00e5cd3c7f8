"""The memory traffic of the r=64 expand at 256 tokens over 16 LoRAs, without its products.

A probe for the H200 (``h200_v28_candidates.json`` in git history, ``call1_memory_probe``): how
long the loads and stores of the tensor-core expand's pick for that case take alone, timed as
the benchmark times the op (``bench.time_calls``: CUDA-graph replay over a pool of argument
sets together larger than twice the L2), launched through the package's launcher, so with
the dependent launch where the package uses it, each kernel's first statement ``begin()``.

The grid is the kernel's: 1,024 one-warp blocks, 16 tiles of 16 tokens (one slot each) x 64
groups of 64 output columns. A lane loads all its 16-byte words into registers, the warp
meets at a barrier, and only then are the words folded together, inside a branch the
compiler cannot resolve (``flag``, always 0): without it ptxas folds each word as it
arrives and keeps at most a few loads of a lane in flight (the flaw of the probes of
v24-v25, ``docs/benchmarks/lab_notes.md``, "where the last microsecond goes"); with it the
variants below hold 70-96 registers, every load in flight at once (the same on the H200 and
compiled here). Variants (``VARIANTS``):

* B, the warp's 8 KB of a slot's weights: ``1`` as 16 pieces of 512 contiguous bytes (each
  instruction one whole piece), ``2`` in the kernel's pattern (lane ``g, t`` reads rows
  ``output_column`` of the group, its words ``4t + kk``, ``kk`` = 0, 2);
* the outputs: ``1`` the warp's 2 KB as one contiguous piece, ``2`` in the kernel's pattern
  (16 token rows of the tile, in random order, 128 bytes of each at the group's columns);
* whether the outputs are stored back (each the old word XOR the fold), and whether B's slot
  is read from a table first (one more trip, as the kernel's tile table).

Run on a GPU from the repository root:
``ROUND=k python docs/benchmarks/probes/r64_expand_traffic.py`` (``ROUND`` rotates the order
of the variants). Prints one JSON line: µs per call of each variant, and of the op itself
(``bench.run_case``, run halfway through and again at the end, the second kept) in the same
process. It was run at ab28dfa's package (the kernels of v26).
"""

import json
import os

import torch
from _shared import timed_against_the_op
from numba import int64

from punica_numba._cuda import KernelLauncher, cuda, dependent_launch, jit_kernel
from punica_numba.bench import Case, pool_size
from punica_numba.kernels.dependent_launch import prologue
from punica_numba.kernels.dtypes import words_loader, words_storer

TILES, GROUPS = 16, 64

VARIANTS = {  # name: (B, outputs, stored, B's slot from a table)
    "ideal_b_only": (1, 0, 0, 0),
    "ideal_b_ideal_out": (1, 1, 1, 0),
    "ideal_b_ideal_out_loads_only": (1, 1, 0, 0),
    "ideal_b_kernel_out": (1, 2, 1, 0),
    "kernel_b_kernel_out": (2, 2, 1, 0),
    "kernel_b_kernel_out_table": (2, 2, 1, 1),
    "kernel_out_only": (0, 2, 1, 0),
}


def build(B, OUT, STORE, TABLE):
    """The probe kernel of one variant (its flags compiled in)."""
    load2, store2 = words_loader(True), words_storer(True)
    begin = prologue()

    @jit_kernel(32)
    def probe(bw, out, tile_rows, slots, sink, flag):
        # bw: [16, 4096, 16] int64 words of B; out: [256, 1024] int64 words of outputs
        begin()
        tile = cuda.blockIdx.x
        grp = cuda.blockIdx.z
        lane = cuda.threadIdx.x
        g, t = lane >> 2, lane & 3
        bwords = cuda.local.array(32, int64)
        owords = cuda.local.array(8, int64)
        slot = slots[tile] if TABLE else tile
        row0 = out[tile_rows[tile, g]]  # the lane's two token rows (OUT == 2)
        row1 = out[tile_rows[tile, g + 8]]
        if B == 1:
            for i in range(16):
                row = bw[slot, grp * 64 + 4 * i + (lane >> 3)]
                bwords[2 * i], bwords[2 * i + 1] = load2(row, 2 * (lane & 7))
        elif B == 2:
            for nj in range(8):
                for kk in range(0, 4, 2):
                    j = 2 * (2 * nj + kk // 2)
                    n = grp * 64 + 32 * (nj >> 2) + 2 * (nj & 3) + 8 * (g >> 1) + (g & 1)
                    bwords[j], bwords[j + 1] = load2(bw[slot, n], 4 * t + kk)
        if OUT == 1:
            fw = tile * GROUPS + grp  # the warp's piece: a quarter of an output row
            chunk = out[fw >> 2]
            for i in range(4):
                owords[2 * i], owords[2 * i + 1] = load2(chunk, (fw & 3) * 256 + 64 * i + 2 * lane)
        elif OUT == 2:
            for i in range(2):
                row = row0 if i == 0 else row1
                for v in range(2):
                    q = grp * 16 + 2 * t + 8 * v
                    owords[4 * i + 2 * v], owords[4 * i + 2 * v + 1] = load2(row, q)
        cuda.syncwarp()
        x = int64(0)
        if flag == 0:  # always (flag is 0): in a branch, so that no fold is issued among the loads
            for i in range(32):
                x ^= bwords[i]
            for i in range(8):
                x ^= owords[i]
        if STORE and OUT == 1:
            fw = tile * GROUPS + grp
            chunk = out[fw >> 2]
            for i in range(4):
                q = (fw & 3) * 256 + 64 * i + 2 * lane
                store2(chunk, q, owords[2 * i] ^ x, owords[2 * i + 1])
        elif STORE and OUT == 2:
            for i in range(2):
                row = row0 if i == 0 else row1
                for v in range(2):
                    q = grp * 16 + 2 * t + 8 * v
                    store2(row, q, owords[4 * i + 2 * v] ^ x, owords[4 * i + 2 * v + 1])
        else:
            if x == 0x123456789:  # never: keeps every load alive, stores nothing
                sink[0] = x

    return probe


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    per_set = TILES * 4096 * 64 * 2 + 2 * 256 * 4096 * 2
    pool = pool_size(per_set)  # the benchmark's rule: together twice the L2
    sets = [
        (
            torch.randint(-(2**62), 2**62, (TILES, 4096, 16), generator=gen).cuda(),
            torch.randint(-(2**62), 2**62, (256, 1024), generator=gen).cuda(),
        )
        for _ in range(pool)
    ]
    tile_rows = torch.randperm(256, generator=gen).reshape(TILES, 16).to(torch.int32).cuda()
    slots = torch.randperm(TILES, generator=gen).to(torch.int32).cuda()
    sink = torch.zeros(1, dtype=torch.int64).cuda()
    rnd = int(os.environ.get("ROUND", "0"))
    res = {"round": rnd, "pool": pool, "dependent_launch": dependent_launch(), "us": {}}
    op_case = Case("expand", 256, "uniform", 4096, 64, "bf16", [4096])
    launchers = {name: KernelLauncher(build(*VARIANTS[name])) for name in VARIANTS}

    def calls_of(name):
        return [
            lambda b=b, o=o, launch=launchers[name]: launch(
                (TILES, 1, GROUPS), 32, (b, o, tile_rows, slots, sink, 0)
            )
            for b, o in sets
        ]

    res["us"] = timed_against_the_op(op_case, list(VARIANTS), calls_of, rnd)
    res["us"]["op"] = res["us"].pop("op_end")  # the op again at the end: the one kept
    res["regs"] = {
        name: [k.regs_per_thread for k in launchers[name].kernels.values()]
        for name in res["us"]
        if name != "op"
    }
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
