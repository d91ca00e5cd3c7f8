"""``python -m punica_numba tune --moe``: the MoE op's calls of the dense op's kernels, tuned.

``fused_moe_lora`` (:mod:`punica_numba.ops.moe`, from version 9) hands two kinds of call to the
dense op's kernels (:mod:`punica_numba.ops.moe_dense`): from ``tiles_from_pairs()`` pairs a
(slot, expert) on (16 for versions 9 and 11, ``TILES_FROM_PAIRS`` = 4 from 12), the *tiles* path
(the tensor-core shrink and expand on tiles of 16 pairs); below ``MMA_SHRINK_FROM_PAIRS``, the
*pairs* path (the row kernels on one-token tiles, a pair each). Between the two (before version
12) the op runs kernels of its own, which have no configurations to choose. Each
launch takes the configuration the table names for the nearest problem; without MoE entries
that is a problem of a linear layer, of other sizes (no problem of the dense grids has MoE's
K of 2048, 768 or 1408), and on an H100 at a949933 the op with the
heuristic's shrink on the tiles took up to 1.66x its time under the fastest shrink.

So this grid is the MoE layers of real models (:data:`MOE_MODELS`), each projection (w13: two
slices, a row of x a token; w2: one slice, a row a pair, weighted by the router), ranks,
tokens and adapter counts, and a *problem* is one op (shrink or expand) of one such call,
where the op's default version takes one of the two paths. For each, the tuner makes the
benchmark's pool (:func:`punica_numba.bench_moe.checked_pool`: argument sets filling twice
the L2, random routing, equal adapter shares), then, for every configuration of that op
the path can run, forces it, checks the call against the float64 reference, makes sure the
launch took it (:func:`~punica_numba.ops.moe_dense.recorded_launches`; one turned down is
*skipped*) and times the whole call (both kernels and the table's, the other op at its own
pick): device µs per call, CUDA-graph replays, as ``bench --moe``. Its entry (``"layer":
"moe"``) is keyed as the op looks it up: T is the call's pairs (tokens x top-k) and the
tokens a LoRA are the pairs a (slot, expert) (:func:`problem_key`); it records the
call's ``tokens``, ``experts`` and ``top_k``, and as ``heuristic`` the configuration the
op took by itself in the tuning process (the dense entries' pick, or the heuristic's,
where the table loaded has no MoE entry near).

Grids: :func:`quick_grid` (``--moe --quick``) is Qwen3-30B-A3B's layer at ranks 16 and 64,
bf16, 1 to 4096 tokens on 1, 4 and 16 adapters; :func:`full_grid` (``--moe``) adds
DeepSeek-V2-Lite's and Qwen3-235B-A22B's layers, ranks 8 to 64, fp16, up to 8192 tokens. The
quick grid's 96 problems took 78 s on an H200 at 9fd11ec; the full grid is 1,248 problems,
so run it in parts (``--part I/N``) within a time limit.
``--moe-layer HIDDEN,EXPERTS,TOP_K,INTERMEDIATE`` (once a layer) tunes the layers given in place of
those models, e.g. ``--moe-layer 2880,32,4,2880`` for gpt-oss-20b's. On the CUDA simulator,
:func:`smoke_grid`: one tiny call on each path.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

from .. import bench, bench_moe
from ..launch import config_name, force_launch_config, launch_configs
from ..ops import moe as moe_ops
from ..ops import moe_dense
from .sweep import REASON_CHARS, REPEATS, ranked_entry, stop_if_the_context_is_lost
from .table import KEY_FIELDS, entry_key, layer_of, tokens_per_lora

__all__ = [
    "MOE_MODELS",
    "MoEProblem",
    "full_grid",
    "measure_problem",
    "path_of",
    "problem_of",
    "problem_key",
    "quick_grid",
    "smoke_grid",
    "tune_problem",
]

#: The MoE layers tuned: hidden size, experts, top-k, expert intermediate size.
MOE_MODELS = {
    "Qwen3-30B-A3B": dict(hidden=2048, experts=128, top_k=8, intermediate=768),
    "DeepSeek-V2-Lite": dict(hidden=2048, experts=64, top_k=6, intermediate=1408),
    "Qwen3-235B-A22B": dict(hidden=4096, experts=128, top_k=8, intermediate=1536),
}
QUICK_MODELS = ("Qwen3-30B-A3B",)
QUICK_RANKS = (16, 64)
QUICK_TOKENS = (1, 16, 64, 256, 1024, 2048, 4096)
FULL_RANKS = (8, 16, 32, 64)
FULL_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
LORAS = (1, 4, 16)
PROJECTIONS = ("w13", "w2")


@dataclass(frozen=True)
class MoEProblem:
    """One op (``"shrink"`` or ``"expand"``) of one MoE call (``case``)."""

    case: bench_moe.MoECase
    op: str

    @property
    def name(self) -> str:
        return f"{self.case.name} r={self.case.rank} {self.case.dtype} {self.op}"


def path_of(case: bench_moe.MoECase) -> str | None:
    """``"tiles"``, ``"pairs"`` or None (the op's own kernels): where the op's default
    version sends ``case`` (by its pairs a (slot, expert), :func:`.moe.pairs_per_block`, and
    from version 11 by its pairs and adapters: :func:`.moe.one_launch`, its one launch)."""
    if moe_ops.DEFAULT_VERSION < 9:
        return None
    if moe_ops.one_launch(case.T * case.top_k, slots=case.loras, experts=case.experts):
        return None  # (the one launch of 11 on: no configuration of the dense op's)
    average = _average(case)
    if average < moe_ops.MMA_SHRINK_FROM_PAIRS:
        return "pairs"
    return "tiles" if average >= moe_ops.tiles_from_pairs() else None


def _average(case: bench_moe.MoECase) -> float:
    return moe_ops.pairs_per_block(case.T * case.top_k, case.loras, case.experts)


def problem_key(problem: MoEProblem) -> tuple:
    """The table key under which the op looks the problem up (:data:`.table.KEY_FIELDS`,
    then the layer): K and N are the shrink's input width and rank, the expand's rank and
    slice width; T the pairs; the tokens a LoRA the bucket of the pairs a (slot, expert)."""
    case, op = problem.case, problem.op
    pairs = case.T * case.top_k
    active = moe_dense.active_slots(pairs, _average(case))
    K, N = (case.K, case.rank) if op == "shrink" else (case.rank, case.N)
    per_lora = tokens_per_lora(pairs, active)
    return (op, case.dtype, case.slices, K, N, case.rank, pairs, per_lora, "moe")


def _runs(path: str, op: str, rank: int):
    """The test of a configuration the path runs for ``op`` (``moe_dense``'s own)."""
    if path == "pairs":
        return moe_dense._one_token_rows
    if op == "shrink":
        return functools.partial(moe_dense._shrink_runs, rank=rank)
    return moe_dense._expand_runs


def grid(layers, ranks, tokens, dtypes, loras=LORAS) -> list[MoEProblem]:
    """Every problem of the product that takes one of the two paths, ordered dtype, rank,
    layer (a dict of :data:`MOE_MODELS`' fields), projection, T, adapters, op; a key met
    twice once."""
    problems, seen = [], set()
    for dtype in dtypes:
        for rank in ranks:
            for layer in layers:
                for projection in PROJECTIONS:
                    for T in tokens:
                        for count in loras:
                            case = bench_moe.MoECase(
                                projection, T, count, rank=rank, dtype=dtype, **layer
                            )
                            if path_of(case) is None:
                                continue
                            for op in ("shrink", "expand"):
                                problem = MoEProblem(case, op)
                                if problem_key(problem) not in seen:
                                    seen.add(problem_key(problem))
                                    problems.append(problem)
    return problems


def quick_grid(ranks=QUICK_RANKS, dtypes=("bf16",), layers=None) -> list[MoEProblem]:
    """The ``--moe --quick`` grid: Qwen3-30B-A3B's layer (or ``layers``), T 1-4096."""
    layers = layers or [MOE_MODELS[name] for name in QUICK_MODELS]
    return grid(layers, ranks, QUICK_TOKENS, dtypes)


def full_grid(ranks=FULL_RANKS, dtypes=("bf16", "fp16"), layers=None) -> list[MoEProblem]:
    """The ``--moe`` grid: the layers of :data:`MOE_MODELS` (or ``layers``), T 1-8192."""
    return grid(layers or list(MOE_MODELS.values()), ranks, FULL_TOKENS, dtypes)


def layer_spec(text: str) -> dict:
    """``"2880,32,4,2880"`` -> ``dict(hidden=2880, experts=32, top_k=4, intermediate=2880)``
    (``--moe-layer``); ValueError naming what was expected otherwise."""
    fields = ("hidden", "experts", "top_k", "intermediate")
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 4 or min(values) < 1 or values[2] > values[1]:
        raise ValueError(
            f"expected HIDDEN,EXPERTS,TOP_K,INTERMEDIATE, four integers >= 1 with TOP_K <= "
            f"EXPERTS, got {text!r}"
        )
    return dict(zip(fields, values))


def smoke_grid() -> list[MoEProblem]:
    """For the simulator: a tiny w13 call on the pairs path (a token more than the default
    version's one launch takes, of top-1 over two adapters of 32 experts: about one pair a
    (slot, expert)) and a w2 call on the tiles path (as many tokens of top-1 on one adapter of
    one expert), each op."""
    tokens = moe_ops.one_launch_to_pairs() + 1
    tiny = bench_moe.MoECase("w13", tokens, 2, hidden=8, experts=32, top_k=1, intermediate=8,
                             rank=4, block_size=16)  # fmt: skip
    tiles = replace(tiny, projection="w2", loras=1, experts=1)
    cases = (tiny, tiles)
    return [MoEProblem(case, op) for case in cases for op in ("shrink", "expand")]


def tune_problem(problem: MoEProblem, repeats: int = REPEATS) -> dict:
    """Check and time every configuration of the problem's path and op; return its table
    entry (with no ``config`` where none passed: an *unresolved* key)."""
    start = time.perf_counter()
    case, op = problem.case, problem.op
    configs = launch_configs(op)
    times, failed, skipped, own = measure_problem(problem, configs, repeats)
    entry = dict(zip(KEY_FIELDS, problem_key(problem)), layer="moe")
    entry.update(loras=case.loras, widths=[case.N] * case.slices)
    entry.update(tokens=case.T, experts=case.experts, top_k=case.top_k)
    picked = config_name(own) if own is not None else None
    return ranked_entry(entry, configs, times, failed, skipped, lambda: picked, start)


def measure_problem(problem: MoEProblem, configs, repeats: int = REPEATS) -> tuple:
    """``(times, failed, skipped, own)`` of ``configs`` on one pool of the problem's call:
    µs by name of each forced, checked and timed (the whole call); why by name of each that
    failed its check or did not run; the names its path does not run, or that the op turned
    down (another configuration ran); and the configuration the op took by itself."""
    case, op = problem.case, problem.op
    runs = _runs(path_of(case), op, case.rank)
    _, pool, check = bench_moe.checked_pool(case)
    calls = [bench_moe._call(case, args) for args in pool]
    with moe_dense.recorded_launches() as launched:
        check(lambda args: bench_moe._call(case, args))
        own = launched.get(op)
    times, failed, skipped = {}, {}, []
    for config in configs:
        name = config_name(config)
        if not runs(config):
            skipped.append(name)
            continue
        with force_launch_config(op, config), moe_dense.recorded_launches() as launched:
            try:
                check(lambda args: bench_moe._call(case, args))
                if launched.get(op) != config:  # turned down: another configuration ran
                    skipped.append(name)
                    continue
                times[name] = max(round(bench.time_calls(calls, repeats), 3), 0.001)
            except Exception as error:  # a wrong result, or a kernel that does not run
                if not isinstance(error, AssertionError):
                    stop_if_the_context_is_lost(problem, config)
                failed[name] = f"{type(error).__name__}: {error}"[:REASON_CHARS]
    return times, failed, skipped, own


def problem_of(entry: dict) -> MoEProblem | None:
    """The problem a MoE shrink entry of :func:`tune_problem` was tuned on, made again from
    its fields (w13 where it has two slices: K its hidden size, its widths the intermediate
    size; w2 where one: the other way round; the benchmark's block size), or None where that
    does not give the entry's own key back. An expand entry records its rank and slice
    widths but not the width of its call's input rows, so it gives None too."""
    fields = ("tokens", "loras", "experts", "top_k", "widths")
    if layer_of(entry) != "moe" or entry["op"] != "shrink" or any(f not in entry for f in fields):
        return None
    projection = "w13" if entry["slices"] == 2 else "w2"
    K, width = entry["K"], entry["widths"][0]
    hidden, intermediate = (K, width) if projection == "w13" else (width, K)
    case = bench_moe.MoECase(
        projection, entry["tokens"], entry["loras"], hidden=hidden, experts=entry["experts"],
        top_k=entry["top_k"], intermediate=intermediate, rank=entry["rank"], dtype=entry["dtype"],
    )  # fmt: skip
    problem = MoEProblem(case, "shrink")
    return problem if problem_key(problem) == entry_key(entry) else None
