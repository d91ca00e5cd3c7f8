"""Whether MoE LoRA's tiles path gains from tiles of 32 or 64 pairs in its shrink.

From :func:`punica_numba.ops.moe.tiles_from_pairs` pairs a (slot, expert) on average the op
cuts the align step's blocks into tiles of 16 pairs (:func:`punica_numba.ops.moe_dense.
moe_tiles`) and runs the dense op's tensor-core shrink on them, a CUDA block a tile and a
slice. Every such CUDA block reads its (slot, expert)'s rows of A whole, and each of its 16
pairs' rows of x; w13's two slices read x once each. At 2048 tokens on one adapter (16,384
pairs, about 1,100 tiles of w13's K = 2048) that is some 146 MB of A and 146 MB of x through
the L2 for a call whose shrink floor is about 27 MB: an H100 at 5d9b04e took the shrink in
about 39 µs (``h100_moe_tiles_steps_5d9b04e.json``: tiles_shrink - tiles), near what its L2
moves in that time. Tiles of 64 pairs read A a quarter as often; w13's slices side by side
in one CUDA block (:mod:`punica_numba.kernels.shrink_mma_joint`) read x once.

For every ``bench --moe`` case of the tiles path, on the benchmark's pool (CUDA-graph
replays, µs per call), each shrink alone on tables made before it is timed:

* ``m16``: the op's own (the 16-pair table, :func:`punica_numba.ops.moe_dense.dense_shrink`);
* ``m<16 g>_t<threads>``: the table's consecutive tiles of one (slot, expert) joined ``g`` at
  a time (:func:`punica_numba.ops.moe_dense.moe_wide_tiles`), the dense shrink of ``g``
  16-pair tiles a CUDA block;
* ``..._j`` (w13): the same with gate and up in one CUDA block.

A wide tile begins at a 16-pair tile ``i`` where ``i % g == 0``, or where the tile before is
of another (slot, expert) or not full; so the table keeps its rows (one a 16-pair tile, those
inside a wide tile idle), as :func:`punica_numba.ops.moe_dense.moe_wide_tiles` makes it.
Each variant's buffer is compared with ``m16``'s (``<variant>_differs``: the largest
difference over the largest value; 0 where the warps are as many). Beside them the whole op
at versions 14 and 15 (``op_v14``, ``op_v15``), each checked against the reference first.

    python docs/benchmarks/probes/moe_wide_tiles.py [--json PATH] [--commit C] [--cases w2:1:1,...]

GPU only.
"""

import argparse
import json

import numpy as np
import torch

from punica_numba import bench
from punica_numba.bench_moe import _call, checked_pool, default_cases
from punica_numba.kernels import build_mma_shrink_kernel
from punica_numba.kernels.shrink_mma_joint import build_joint_mma_shrink_kernel
from punica_numba.ops import operands
from punica_numba.ops.launching import launcher_of
from punica_numba.ops.moe import pairs_per_block, tiles_from_pairs
from punica_numba.ops.moe_dense import _flat, dense_shrink, moe_tiles, moe_wide_tiles

#: The variants: (16-pair tiles a CUDA block, threads, slices side by side).
VARIANTS = {
    "m16": None,
    "m16_t128_j": (1, 128, True),
    "m32_t128": (2, 128, False),
    "m32_t128_j": (2, 128, True),
    "m64_t128": (4, 128, False),
    "m64_t256": (4, 256, False),
    "m64_t128_j": (4, 128, True),
}
#: The op's versions timed whole beside the shrinks: 14, and 15, whose shrink takes wide
#: tiles (:func:`punica_numba.ops.moe.wide_group`).
VERSIONS = (14, 15)


def build(variant: str):
    """``make(case, args, buffer)``: the shrink of ``variant`` on one argument set into
    ``buffer``, its table made now (not timed)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")

    def make(case, args, buffer):
        P = case.T * case.top_k
        average = pairs_per_block(P, case.loras, case.experts)
        x_rows = 1 if case.by_pair else case.top_k
        weights = args["topk_weights"].reshape(-1).to(torch.float32)
        routed = weights if case.by_pair else None
        metadata = (*args["blocks"], args["enabled"], case.block_size, P, case.experts)
        if VARIANTS[variant] is None:
            tiles = moe_tiles(*metadata)
            return lambda: dense_shrink(buffer, args["x"], args["lora_a"], tiles, x_rows,
                                        average, routed)  # fmt: skip
        group, threads, joint = VARIANTS[variant]
        if group == 1:
            table, tokens = moe_tiles(*metadata)
        else:
            _, tokens, table = moe_wide_tiles(*metadata, group)
        stacks = [_flat(a, "lora_a_stacked", s) for s, a in enumerate(args["lora_a"])]
        slices, rank = len(stacks), stacks[0].rows
        x_words, a_words, wide = operands.mma_shrink_operands(args["x"], stacks, 0)
        weights = list(a_words) + [a_words[0]] * (3 - slices)
        if joint:
            kernel = build_joint_mma_shrink_kernel(
                args["x"].dtype, torch.float32, threads, group, -(-slices * rank // 8), False,
                wide, x_rows=x_rows,
            )  # fmt: skip
            grid = (table.shape[0], 1, 1)
            scaling = np.float32(1.0)
        else:
            kernel = build_mma_shrink_kernel(
                args["x"].dtype, torch.float32, threads, group, -(-rank // 8), False, wide,
                x_rows=x_rows, row_scaled=routed is not None,
            )  # fmt: skip
            grid = (table.shape[0] * slices, 1, 1)
            scaling = routed if routed is not None else np.float32(1.0)
        arguments = (x_words, *weights, buffer, 0, slices, table, tokens.view(-1), scaling)
        launch = launcher_of(kernel)
        return lambda: launch(grid, threads, arguments)

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", help="projection:T:loras,... (default: every tiles case)")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the JSON")
    opts = parser.parse_args()
    wanted = None
    if opts.cases:
        wanted = {tuple(c.split(":")) for c in opts.cases.split(",")}
    records = []
    for case in default_cases():
        P = case.T * case.top_k
        if pairs_per_block(P, case.loras, case.experts) < tiles_from_pairs():
            continue
        if wanted and (case.projection, str(case.T), str(case.loras)) not in wanted:
            continue
        first, pool, check = checked_pool(case)
        for version in VERSIONS:  # each against the reference first
            check(lambda a, case=case, version=version: _call(case, a, version))
        record = {"projection": case.projection, "T": case.T, "loras": case.loras}
        record["pool"] = len(pool)
        for version in VERSIONS:
            record[f"op_v{version}"] = bench.time_calls([_call(case, a, version) for a in pool])
        buffers = [
            torch.zeros(case.slices, P, case.rank, dtype=torch.float32, device=first["x"].device)
            for _ in range(2)
        ]
        build("m16")(case, first, buffers[0])()
        for variant, shape in VARIANTS.items():
            if shape is not None and shape[2] and case.slices == 1:
                continue
            try:
                if shape is not None:  # (another count of warps: other sums, other bits)
                    buffers[1].zero_()
                    build(variant)(case, first, buffers[1])()
                    scale = buffers[0].abs().max().item()
                    diff = (buffers[0] - buffers[1]).abs().max().item() / scale
                    record[f"{variant}_differs"] = diff
                scratch = [torch.empty_like(buffers[0]) for _ in pool]
                calls = [build(variant)(case, a, b) for a, b in zip(pool, scratch)]
                record[variant] = bench.time_calls(calls)
            except Exception as error:  # (a build past a limit: noted, the others go on)
                record[variant] = f"{type(error).__name__}: {error}"[:200]
        records.append({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()})
        print(records[-1], flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            record = {"commit": opts.commit, "gpu": torch.cuda.get_device_name(), "cases": records}
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
