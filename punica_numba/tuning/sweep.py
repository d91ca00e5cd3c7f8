"""``python -m punica_numba tune``: check and time every launch configuration, write the table.

For each problem of a grid (op, dtype, slice widths, K, rank, T, LoRAs) the tuner builds
one pool of argument sets, as the benchmark does (:mod:`punica_numba.bench`: together
twice the L2, so every call reads its weights from HBM), and then, for every
configuration of :func:`~punica_numba.launch.launch_configs`:

1. forces it (:func:`~punica_numba.launch.force_launch_config`); one the problem cannot
   use (the tensor cores or the lane split where its operands do not allow them, a rank
   past the configuration's ``to_rank``) is *skipped*;
2. checks its result against the float64 reference (the benchmark's check); one that
   fails, or raises, is recorded as *failed*, is never chosen, and the sweep goes on;
3. times it: every call of the pool captured into one CUDA graph, the median device µs
   per call over ``--repeats`` replays (the benchmark's :func:`~punica_numba.bench.time_calls`).

The fastest is the problem's entry (:mod:`.table`), with the runner-up, what the
hand-written heuristic picks there and every time measured. The table is written after
each problem, so an interrupted run keeps its work, and ``--resume`` skips the problems
already in it.

Grids (:func:`quick_grid`, :func:`full_grid`): ``--quick`` is ranks 16 and 64, hidden
4096, one slice and a QKV layer's three (4096/1024/1024), 1 to 4096 tokens on 1,
ceil(sqrt(T)) or T (at most 256) LoRAs, bf16: 128 problems. The full grid is the real
layers (QKV with GQA, gate_up, o, down) of four models (hidden 2560, 4096, 5120, 8192),
ranks 8 to 256, 1 to 8192 tokens, bf16 and fp16: 5928 problems; ``--hiddens`` keeps the
models of some hidden sizes (``--hiddens 4096 --ranks 16,64,128 --dtypes bf16``: Llama-3-8B's
layers, its down projection's K of 14336 and gate_up's two slices among them, 399 problems,
about 9 minutes: on an H200 the quick grid took 163 s, r=32 and 128 of Llama-3-8B's layers
260 s for 266 problems; with the configurations added since, at 0635975, the quick grid's
first 63 problems took 200 s, so split it in two); ``--part I/N``
takes its I-th of N contiguous parts (neighbouring problems share their compiled kernels),
``--budget-s`` stops before a problem that could end past a time limit. On the CUDA
simulator it runs a smoke grid of three tiny problems whatever is asked: its times are
host wall-clock and mean nothing for speed.

``--slices 2,3`` keeps the problems of those slice counts (with ``--retime`` too).

``--retime NAMES`` runs no grid: it takes the table already in ``--out`` (a copy of the
shipped one, say) and, for each entry of the named configurations' op (and of ``--ranks``,
``--dtypes``, ``--slices``), times its problem again under the entry's own configuration and
those named, on one pool, checked as above; the fastest becomes the entry's configuration
(:func:`retime_entry`). So a configuration added to the launch table is weighed on the
problems a table holds without timing every other configuration again (on the H200 all of
them took 1.3 s a problem on the quick grid, 163 s for 128, and 2.6 s on 80 fp16 problems).
A table of another GPU, copied under this one's name to weigh its picks here, keeps in each
entry timed again only this run's times: the others were the other GPU's.

``--near N`` times each problem only under a short list (:mod:`.near`): the three fastest
configurations of its N nearest entries in the table being written (``--resume`` into a
copy of the shipped one, say) and the heuristic's picks, each checked as above; a problem
with no entry near is timed under every configuration. On the H200's table as shipped
(tuned at cc380e6, retimed up to a605e06), each problem left out in turn (``tune --report
TABLE --near 8``), the list held 6.0 configurations where 18.1 were checked in full, and its
fastest took 1.0021x the fastest's time in geometric mean, at most 1.149x, over 1.10x on 3
of 463 problems; on the H100's quick grid (3e971ac), 5.9 of 29.8, 1.0061x, at most 1.095x.

``--moe`` tunes the MoE op's calls of the dense op's kernels instead (:mod:`.moe_sweep`: the
MoE layers of real models, or those of ``--moe-layer H,E,K,I``; ``--quick``, ``--ranks``,
``--dtypes``, ``--part``, ``--budget-s`` and ``--resume`` as above), into the same table as
entries of their own (``"layer": "moe"``), which MoE calls consult before the dense ones.
``--retime`` leaves MoE entries as they are; ``--moe --retime NAMES`` (shrink configurations)
times the table's MoE shrink entries again instead, each its whole call as ``--moe`` times it,
beside the entry's own configuration, and leaves the dense ones as they are (a MoE expand entry
does not record the width of its call's input rows, so its call cannot be made again; nor is an
entry whose call the op's default version now takes in its one launch, which reads no table).

``--report TABLE`` runs nothing: it weighs this package's heuristic against a table made
before, on any machine (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__, bench, bench_grid
from .._cuda import SIMULATOR, device_of
from ..launch import OPS, config_name, force_launch_config, launch_configs
from ..meta import LoRAKernelMeta
from .near import candidate_names as near_names
from .near import heuristic_config
from .report import geometric_mean, report
from .table import (
    CONFIG_DIR_VARIABLE,
    KEY_FIELDS,
    TunedTableError,
    entry_key,
    gpu_capability,
    gpu_name,
    layer_of,
    new_table,
    read_table,
    table_file_name,
    tokens_per_lora,
    write_table,
)

__all__ = [
    "Layer",
    "SweepCase",
    "case_key",
    "entry_case",
    "full_grid",
    "main",
    "quick_grid",
    "ranked_entry",
    "retime_entry",
    "stop_if_the_context_is_lost",
    "tune_case",
]

#: The most LoRAs a problem's tokens are spread over ("T LoRAs" stops here): the largest
#: batch of distinct adapters the benchmark measures.
MAX_LORAS = 256
#: Replays timed per configuration (each replays the whole pool).
REPEATS = 10
#: The longest reason kept for a failed configuration.
REASON_CHARS = 300


@dataclass
class SweepCase(bench.Case):
    """A benchmark case whose tokens use ``loras`` LoRAs (not a count by ``lora_mode``)."""

    loras: int = 1

    @property
    def num_loras(self) -> int:
        return self.loras


@dataclass(frozen=True)
class Layer:
    """A linear layer with LoRA: the shrink's input width ``K`` and the expand's slices."""

    name: str
    K: int
    widths: tuple[int, ...]


#: The hidden sizes whose models (:data:`punica_numba.bench_grid.MODELS`: Qwen3-4B,
#: Llama-3-8B, Qwen2.5-14B, Llama-3-70B) the full grid tunes: those with a gated MLP.
MODEL_HIDDENS = (2560, 4096, 5120, 8192)
QUICK_LAYERS = (Layer("o", 4096, (4096,)), Layer("qkv", 4096, (4096, 1024, 1024)))
QUICK_RANKS = (16, 64)
QUICK_TOKENS = (1, 16, 64, 256, 1024, 4096)
FULL_RANKS = (8, 16, 32, 64, 128, 256)
FULL_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


def model_layers(hiddens=MODEL_HIDDENS) -> tuple[Layer, ...]:
    """Each model's QKV (three slices, GQA widths), gate_up (two), o and down (one), from the
    benchmark grid's layer shapes (:data:`punica_numba.bench_grid.MODELS`; o maps the q
    width back to the hidden size)."""
    layers = []
    for hidden in hiddens:
        qkv, mlp_in, mlp_out = bench_grid.MODELS[hidden]
        layers += [
            Layer(f"{hidden}.qkv", qkv.in_features, qkv.slices),
            Layer(f"{hidden}.o", qkv.slices[0], (hidden,)),
            Layer(f"{hidden}.gate_up", mlp_in.in_features, mlp_in.slices),
            Layer(f"{hidden}.down", mlp_out.in_features, mlp_out.slices),
        ]
    return tuple(layers)


def case_key(case: bench.Case) -> tuple:
    """The table key of ``case`` (:data:`.table.KEY_FIELDS`, then the layer, ``"dense"``): K
    and N are the shrink's hidden and rank, the expand's rank and widest slice."""
    K, N = (case.hidden, case.rank) if case.op == "shrink" else (case.rank, max(case.slices))
    per_lora = tokens_per_lora(case.T, case.num_loras)
    return (case.op, case.dtype, len(case.slices), K, N, case.rank, case.T, per_lora, "dense")


def lora_counts(num_tokens: int) -> list[int]:
    """1, ceil(sqrt(T)) and T (at most :data:`MAX_LORAS`) LoRAs, each once."""
    root = math.ceil(math.sqrt(num_tokens))
    return sorted({1, root, min(num_tokens, MAX_LORAS)})


def grid(layers, ranks, tokens, dtypes, ops=("shrink", "expand")) -> list[SweepCase]:
    """Every problem of the product, ordered dtype, rank, layer, op, T, LoRAs; a key met
    twice (the same K, N and slices in two layers, or LoRA counts of one bucket) once."""
    cases, seen = [], set()
    for dtype in dtypes:
        for rank in ranks:
            for layer in layers:
                for op in ops:
                    for T in tokens:
                        for loras in lora_counts(T):
                            case = SweepCase(
                                op, T, "given", layer.K, rank, dtype, list(layer.widths), loras
                            )
                            if case_key(case) not in seen:
                                seen.add(case_key(case))
                                cases.append(case)
    return cases


def quick_grid(ranks=QUICK_RANKS, dtypes=("bf16",)) -> list[SweepCase]:
    """The ``--quick`` grid: hidden 4096, one slice or QKV's three, T 1-4096."""
    return grid(QUICK_LAYERS, ranks, QUICK_TOKENS, dtypes)


def full_grid(ranks=FULL_RANKS, dtypes=("bf16", "fp16"), hiddens=MODEL_HIDDENS) -> list[SweepCase]:
    """The full grid: the layers of :func:`model_layers` (of the models of ``hiddens``),
    T 1-8192."""
    return grid(model_layers(hiddens), ranks, FULL_TOKENS, dtypes)


def smoke_grid() -> list[SweepCase]:
    """Three tiny problems for the simulator: a shrink of one token; one of two slices on
    one LoRA; an fp32 expand of four tokens on two LoRAs (which the tensor cores cannot
    take: their configuration is skipped)."""
    return [
        SweepCase("shrink", 1, "given", 8, 4, "bf16", [8], loras=1),
        SweepCase("shrink", 4, "given", 8, 4, "bf16", [8, 4], loras=1),
        SweepCase("expand", 4, "given", 8, 4, "fp32", [8], loras=2),
    ]


def _measure(case, config, pool, meta, slots, repeats: int):
    """``("skipped", None)``, ``("failed", why)`` or ``("timed", µs)`` for one forced
    configuration."""
    if config.to_rank is not None and case.rank > config.to_rank:
        return "skipped", None
    with force_launch_config(case.op, config):
        try:
            taken = bench._prepared_op(case, pool[0], meta).config
            # Refused (the heuristic's instead): a kernel the call cannot use. (A one-LoRA
            # row shrink may run as the one-token row kernel: still "rows".)
            if taken.kernel != config.kernel:
                return "skipped", None
            bench._check(case, pool[0], meta, slots)
            # Each set's launch prepared once (the benchmark prepares it at every call: the
            # graph holds the same kernels, and the host's work is halved).
            calls = [bench._prepared_op(case, a, meta) for a in pool]
            return "timed", max(round(bench.time_calls(calls, repeats), 3), 0.001)
        except Exception as error:  # a wrong result, or a kernel that does not run
            if not isinstance(error, AssertionError):
                stop_if_the_context_is_lost(case, config)
            return "failed", f"{type(error).__name__}: {error}"[:REASON_CHARS]


def stop_if_the_context_is_lost(case, config) -> None:
    """After a kernel raised: go on if the GPU still works (a launch refused for its
    resources leaves it working); stop the run if not (a fault loses the CUDA context, and
    every later measurement would fail). The problem is not written, so ``--resume``
    starts from it in a new process."""
    if SIMULATOR:
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:
        raise RuntimeError(
            f"the CUDA context was lost after {config_name(config)} on {case}: {error}"
        ) from error


def _pool(case: SweepCase, seed: int) -> tuple:
    """``(pool, meta, slots)``: the problem's argument sets (together twice the L2, as the
    benchmark's), its metadata and its tokens' slots on the device."""
    device = device_of()
    gen = torch.Generator().manual_seed(seed)
    slots = bench._slots(case, gen).to(device)
    # The values are drawn on the GPU (gigabytes in milliseconds there).
    fill = gen if SIMULATOR else torch.Generator(device=device).manual_seed(seed)
    meta = LoRAKernelMeta.make(case.num_loras, case.T, device)
    meta.prepare_tensors(slots)
    size = bench.pool_size(case.floor_bytes())
    return [bench._argument_set(case, fill, device) for _ in range(size)], meta, slots


def _measure_all(case: SweepCase, configs, repeats: int, seed: int) -> tuple:
    """``(times, failed, skipped, usable)`` of ``configs`` on one pool of ``case``: µs by
    name, why by name, the names skipped, and the kernels that ran (by kind)."""
    pool, meta, slots = _pool(case, seed)
    times, failed, skipped, usable = {}, {}, [], {}
    for config in configs:
        name = config_name(config)
        outcome, value = _measure(case, config, pool, meta, slots, repeats)
        if outcome == "skipped":
            skipped.append(name)
        elif outcome == "failed":
            failed[name] = value
        else:
            times[name] = value
            usable[config.kernel] = True  # (the heuristic's pick is among those timed)
    return times, failed, skipped, usable


def tune_case(
    case: SweepCase, repeats: int = REPEATS, seed: int = 0, near: tuple | None = None
) -> dict:
    """Check and time every configuration on ``case``; return its table entry (with no
    ``config`` where none passed: an *unresolved* key). ``near``: ``(N, names)``, only the
    configurations named, the short list of ``N`` neighbours (:mod:`.near`), which the
    entry records as ``near``: N."""
    start = time.perf_counter()
    configs = launch_configs(case.op)
    if near is not None:
        configs = tuple(c for c in configs if config_name(c) in near[1])
    times, failed, skipped, usable = _measure_all(case, configs, repeats, seed)
    # (zip stops before the layer: a dense entry is written without one, its default)
    entry = dict(zip(KEY_FIELDS, case_key(case)), loras=case.num_loras, widths=case.slices)
    if near is not None:
        entry["near"] = near[0]

    def heuristic() -> str:  # (asked only where something ran: ``usable`` is then known)
        _, _, slices, K, N, rank, T, _, _ = case_key(case)
        mma, lanes = usable.get("mma", False), usable.get("lanes", False)
        return config_name(
            heuristic_config(case.op, T, case.num_loras, rank, slices, K, N, mma, lanes)
        )

    return ranked_entry(entry, configs, times, failed, skipped, heuristic, start)


def ranked_entry(entry, configs, times, failed, skipped, heuristic, start) -> dict:
    """``entry`` (its key) completed: the fastest of ``times`` (µs by name; ties to the
    earlier of ``configs``) as its ``config``, the next as its runner-up, ``heuristic()``'s
    name with its time, every time, ``failed``, ``skipped`` and the seconds since
    ``start`` (``time.perf_counter``); with no ``config`` where nothing was timed (an
    *unresolved* key)."""
    order = {config_name(c): i for i, c in enumerate(configs)}
    ranked = sorted(times, key=lambda name: (times[name], order[name]))
    if ranked:
        runner_up = ranked[1] if len(ranked) > 1 else None
        picked = heuristic()
        entry.update(
            config=ranked[0],
            us=times[ranked[0]],
            runner_up=runner_up,
            runner_up_us=times.get(runner_up),
            heuristic=picked,
            heuristic_us=times.get(picked),
            times_us=times,
        )
    seconds = round(max(time.perf_counter() - start, 1e-3), 3)
    entry.update(failed=failed, skipped=skipped, tuned_s=seconds)
    return entry


def entry_case(entry: dict) -> SweepCase:
    """The problem an entry was tuned on: its op, dtype, slice widths, K (shrink's hidden;
    an expand's hidden is not in its key, and it reads none), rank, T and LoRAs."""
    widths = list(entry["widths"])
    hidden = entry["K"] if entry["op"] == "shrink" else max(widths)
    return SweepCase(
        entry["op"], entry["T"], "given", hidden, entry["rank"], entry["dtype"], widths,
        entry["loras"],
    )  # fmt: skip


def retime_entry(
    entry: dict,
    names: list[str],
    repeats: int = REPEATS,
    seed: int = 0,
    keep_others: bool = True,
    measure=None,
) -> dict:
    """``entry`` after its problem is timed again under its own configuration and those
    named (of its op), on one pool in this process: the fastest of them is its
    configuration, the next its runner-up (of those timed again: the other configurations'
    times are another process's); their times replace those of the same names in
    ``times_us``, and ``retimed_with`` lists the names. A named configuration that fails its
    check is recorded under ``failed`` (its earlier time dropped) and never chosen; one the
    problem cannot use, under ``skipped``. Where the entry's own fails now too, the entry
    keeps its choice. ``keep_others=False`` drops the other configurations' times (another
    GPU's, which nothing timed here may be set beside). ``measure(configs)``: ``(times,
    failed, skipped, ...)`` of those configurations on the entry's problem; by default the
    dense sweep's (a MoE entry's: :func:`.moe_sweep.measure_problem`)."""
    by_name = {config_name(c): c for c in launch_configs(entry["op"])}
    wanted = list(dict.fromkeys([entry["config"], *names]))
    configs = [by_name[name] for name in wanted if name in by_name]
    if measure is None:
        times, failed, skipped, _ = _measure_all(entry_case(entry), configs, repeats, seed)
    else:
        times, failed, skipped, _ = measure(configs)
    new = dict(entry)
    stale = set(failed) | set(skipped)  # (an earlier time of one that fails now is dropped)
    earlier = entry.get("times_us", {}) if keep_others else {}
    new["times_us"] = {k: v for k, v in earlier.items() if k not in stale}
    new["times_us"].update(times)
    new["failed"] = {k: v for k, v in entry.get("failed", {}).items() if k not in times}
    new["failed"].update(failed)
    new["skipped"] = sorted(set(entry.get("skipped", [])) | set(skipped))
    new["retimed_with"] = sorted(set(entry.get("retimed_with", [])) | set(names))
    ranked = sorted(times, key=lambda name: (times[name], wanted.index(name)))
    if ranked:
        runner_up = ranked[1] if len(ranked) > 1 else None
        new.update(
            config=ranked[0],
            us=times[ranked[0]],
            runner_up=runner_up,
            runner_up_us=times.get(runner_up),
        )
    return new


def _part(text: str) -> tuple[int, int]:
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part: expected I/N, got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"--part: expected 1 <= I <= N, got {text!r}")
    return index, count


def _moe_layer(text: str) -> dict:
    from .moe_sweep import layer_spec

    try:
        return layer_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--moe-layer: {error}") from None


def _numbers(kind):
    return lambda text: [kind(v) for v in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba tune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help=f"where this GPU's table goes (default: ${CONFIG_DIR_VARIABLE})",
    )
    parser.add_argument("--quick", action="store_true", help="the quick grid (128 problems)")
    parser.add_argument(
        "--moe", action="store_true", help="the MoE op's calls of the dense kernels' instead"
    )
    parser.add_argument(
        "--moe-layer",
        action="append",
        type=_moe_layer,
        metavar="H,E,K,I",
        help="--moe: tune this MoE layer (hidden, experts, top-k, expert intermediate size) in "
        "place of the grid's models; once a layer",
    )
    parser.add_argument("--resume", action="store_true", help="add to the table; skip its keys")
    parser.add_argument("--part", type=_part, metavar="I/N", help="the I-th of N parts")
    parser.add_argument(
        "--budget-s", type=float, metavar="S", help="stop before a problem could end past S s"
    )
    parser.add_argument("--ranks", type=_numbers(int), help="only these ranks (e.g. 16,64)")
    parser.add_argument("--slices", type=_numbers(int), help="only these slice counts (2,3)")
    parser.add_argument(
        "--retime",
        type=_numbers(str),
        metavar="NAMES",
        help="run no grid: time these configurations (comma-separated names) on the problems "
        "of the table in --out, beside each entry's own, and keep the fastest",
    )
    parser.add_argument("--dtypes", type=_numbers(str), help="only these dtypes (bf16,fp16)")
    parser.add_argument(
        "--hiddens",
        type=_numbers(int),
        help=f"the full grid: only the models of these hidden sizes (of {MODEL_HIDDENS})",
    )
    parser.add_argument(
        "--near",
        type=int,
        metavar="N",
        help="time each problem only under the three fastest configurations of its N nearest "
        "entries in the table and the heuristic's picks (tuning/near.py; every configuration "
        "where none is near); with --report, what that would lose on the TABLE",
    )
    parser.add_argument("--repeats", type=int, default=REPEATS, help="replays timed (median)")
    parser.add_argument("--commit", default=None, help="the commit tuned (default: git HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="count the problems; run none")
    parser.add_argument(
        "--report",
        metavar="TABLE",
        help="weigh this package's heuristic against a tuned TABLE (a JSON file) and stop: "
        "its time over the fastest on each problem (no GPU needed)",
    )
    return parser


def _grid(args) -> list:
    """The problems asked for: the grid (the smoke grid on the simulator), its part."""
    grids = (smoke_grid, quick_grid, full_grid)
    if args.moe:  # (its options checked by main: no --hiddens, no --slices)
        from . import moe_sweep

        grids = (moe_sweep.smoke_grid, moe_sweep.quick_grid, moe_sweep.full_grid)
    if SIMULATOR:
        cases = grids[0]()
    else:
        hiddens = tuple(args.hiddens) if args.hiddens else None
        options = dict(ranks=args.ranks, dtypes=args.dtypes, hiddens=hiddens, layers=args.moe_layer)
        cases = grids[1 if args.quick else 2](**{k: v for k, v in options.items() if v})
    if args.slices:
        cases = [case for case in cases if len(case.slices) in args.slices]
    if args.part:
        index, count = args.part
        cases = cases[(index - 1) * len(cases) // count : index * len(cases) // count]
    return cases


def _retime(args, parser, path: Path) -> int:
    """``--retime``: the table's entries (of the named configurations' op, and of the
    ranks, dtypes and slice counts asked for) timed again beside those configurations; with
    ``--moe`` its MoE shrink entries (:func:`.moe_sweep.problem_of`), else its dense ones."""
    from . import moe_sweep

    ops = ("shrink",) if args.moe else OPS
    names_of = {  # each op's configurations among those named
        op: [n for n in args.retime if n in {config_name(c) for c in launch_configs(op)}]
        for op in OPS
    }
    unknown = sorted(set(args.retime) - {n for op in ops for n in names_of[op]})
    if unknown and args.moe:
        parser.error(
            f"--moe --retime {unknown}: not shrink configurations of this machine (a MoE "
            "expand entry does not record its call's input width, so it is not timed again)"
        )
    if unknown:
        parser.error(f"--retime {unknown}: not configurations of this machine")
    if not path.exists():
        print(f"tune --retime: no table at {path} to time again", file=sys.stderr)
        return 2
    doc = read_table(path)
    layer = "moe" if args.moe else "dense"
    problems = {}  # a MoE shrink entry's problem, made again from its fields, where the op's
    for k, e in enumerate(doc["entries"]):  # default version still takes the dense op there
        problem = moe_sweep.problem_of(e) if args.moe else None  # (None: not a MoE shrink's)
        if problem is not None and moe_sweep.path_of(problem.case) is not None:
            problems[k] = problem
    chosen = [
        k
        for k, e in enumerate(doc["entries"])
        if names_of[e["op"]]
        and layer_of(e) == layer
        and "widths" in e
        and "loras" in e
        and (not args.moe or k in problems)
        and (not args.ranks or e["rank"] in args.ranks)
        and (not args.dtypes or e["dtype"] in args.dtypes)
        and (not args.slices or e["slices"] in args.slices)
    ]
    print(f"tune: timing {len(chosen)} problems of {path} again beside {', '.join(args.retime)}")
    gpu = gpu_name()
    same_gpu = doc["gpu"] == gpu
    if not same_gpu:  # (a copy of another GPU's table, to weigh its picks on this one)
        print(
            f"tune: the table is {doc['gpu']}'s and this is {gpu}: the entries timed again "
            "keep only this run's times"
        )
    from tqdm import tqdm

    started, longest, left, gains = time.monotonic(), 0.0, len(chosen), []
    for k in tqdm(chosen, desc="retime", unit="problem", file=sys.stderr):
        if args.budget_s and time.monotonic() - started + longest > args.budget_s:
            break
        begun, old = time.monotonic(), doc["entries"][k]
        measure = None
        if args.moe:  # (the whole MoE call timed under each, as tune --moe times it)
            measure = functools.partial(
                moe_sweep.measure_problem, problems[k], repeats=args.repeats
            )
        doc["entries"][k] = new = retime_entry(
            old, names_of[old["op"]], repeats=args.repeats, keep_others=same_gpu, measure=measure
        )
        if new["config"] != old["config"]:  # the old pick's time of this run over the new's
            gains.append(new["times_us"][old["config"]] / new["us"])
        write_table(path, doc)
        longest, left = max(longest, time.monotonic() - begun), left - 1
        if not SIMULATOR:
            torch.cuda.empty_cache()
    done = len(chosen) - left
    print(f"tune: {len(gains)} of {done} problems timed again took another configuration")
    if gains:
        mean = geometric_mean(gains)
        print(
            f"tune: there the old pick took {mean:.3f}x the new one's time (geometric mean; "
            f"at most {max(gains):.3f}x), both timed in this run"
        )
    if left:
        print(f"tune: stopped by --budget-s with {left} problems left")
    return 0


def _summary(entries: list[dict]) -> str:
    """How often the tuned choice differs from the heuristic's, and by how much it is faster."""
    both = [e for e in entries if e.get("heuristic_us")]
    if not both:
        return "tune: nothing measured against the heuristic"
    other = [e for e in both if e["config"] != e["heuristic"]]
    gain = geometric_mean(e["heuristic_us"] / e["us"] for e in both)
    return (
        f"tune: the tuned configuration differs from the heuristic's on {len(other)} of "
        f"{len(both)} problems; the heuristic's time over the tuned one: {gain:.3f}x "
        "(geometric mean)"
    )


def _tuned(tune, case, args, doc: dict) -> dict:
    """``case``'s entry: timed under the short list of its ``--near`` neighbours in ``doc``
    where it has a neighbour and one of the list passes its check, else under every
    configuration (:mod:`.near`)."""
    if args.near:
        key = case_key(case)
        names = near_names(doc, key, case.num_loras, args.near)
        if names is not None:
            entry = tune(case, repeats=args.repeats, near=(args.near, names))
            if "config" in entry:
                return entry
    return tune(case, repeats=args.repeats)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; return 0, or 2 for a usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.near is not None and args.near < 1:
        parser.error(f"--near takes a count of neighbours, 1 or more, got {args.near}")
    if args.near and args.retime:
        parser.error("--near picks what a grid's problems are timed under; --retime names it")
    if args.report:
        try:
            print(report(read_table(args.report), near=args.near))
        except (OSError, TunedTableError) as error:
            print(f"tune --report: {error}", file=sys.stderr)
            return 2
        return 0
    folder = args.out or os.environ.get(CONFIG_DIR_VARIABLE)
    if not folder:
        parser.error(f"give --out DIR or set {CONFIG_DIR_VARIABLE}")
    if args.hiddens and args.quick:
        parser.error("--hiddens picks models of the full grid; the quick grid has one")
    for given, flag in (
        (args.hiddens, "--hiddens"),
        (args.slices, "--slices"),
        (args.near, "--near"),
    ):
        if given and args.moe:
            parser.error(f"{flag} is not an option of --moe (its grid: tuning/moe_sweep.py)")
    if args.moe_layer and not args.moe:
        parser.error("--moe-layer is an option of --moe")
    unknown = sorted(set(args.hiddens or ()) - set(MODEL_HIDDENS))
    if unknown:
        parser.error(f"--hiddens {unknown}: choose from {MODEL_HIDDENS}")
    gpu = gpu_name()
    path = Path(folder) / table_file_name(gpu)
    if args.retime:
        return _retime(args, parser, path)
    cases = _grid(args)
    if args.moe:
        from .moe_sweep import problem_key as key_of
        from .moe_sweep import tune_problem as tune
    else:
        key_of, tune = case_key, tune_case
    if args.dry_run:
        print(f"tune: {len(cases)} problems for {path}")
        return 0
    if path.exists() and not args.resume:
        print(f"tune: {path} exists; pass --resume to add to it, or remove it", file=sys.stderr)
        return 2
    commit = args.commit or bench._commit()
    if path.exists():
        doc = read_table(path)
        if doc["package"]["commit"] != commit:
            print(f"tune: adding to a table tuned at {doc['package']['commit']}, now at {commit}")
    else:
        doc = new_table(gpu, __version__, commit, gpu_capability())
    done = {entry_key(e) for e in doc["entries"] + doc.get("unresolved", [])}
    doc.setdefault("unresolved", [])
    todo = [case for case in cases if key_of(case) not in done]
    print(f"tune: {len(todo)} of {len(cases)} problems to measure into {path}")
    from tqdm import tqdm

    started, longest, left, listed = time.monotonic(), 0.0, len(todo), 0
    with tqdm(todo, desc="tune", unit="problem", file=sys.stderr) as bar:
        for case in bar:
            if args.budget_s and time.monotonic() - started + longest > args.budget_s:
                break
            begun = time.monotonic()
            entry = _tuned(tune, case, args, doc)
            listed += "near" in entry
            doc["entries" if "config" in entry else "unresolved"].append(entry)
            write_table(path, doc)
            longest, left = max(longest, time.monotonic() - begun), left - 1
            bar.set_postfix_str(f"{entry.get('config', 'unresolved')} {entry.get('us', '')}")
            if not SIMULATOR:
                torch.cuda.empty_cache()
    if left:
        print(f"tune: stopped by --budget-s with {left} problems left; run again with --resume")
    if args.near:
        print(
            f"tune: --near {args.near}: {listed} of {len(todo) - left} problems timed under "
            "their neighbours' short lists, the others under every configuration"
        )
    print(_summary(doc["entries"]))
    if doc["unresolved"]:
        print(f"tune: {len(doc['unresolved'])} problems where no configuration passed")
    if SIMULATOR:
        print("tune: simulator smoke grid: times are host wall-clock µs and mean nothing for speed")
    return 0
