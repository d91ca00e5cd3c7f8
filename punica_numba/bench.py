"""``python -m punica_numba bench``: shrink and expand against the copy-bandwidth limit.

For every case it (1) builds a pool of independent argument sets, together larger
than the GPU's L2 cache, so every call reads its weights from HBM; (2) checks the
op's result on the first set against the float64 reference; (3) captures one call
per set into a CUDA graph and times replays with CUDA events, reporting the median
device time per call (every graph timed after the process's first few:
:func:`settle_graphs`); (4) times the same calls through torch (gather + bmm, and a
loop over LoRAs) the same way; and (5) reports the bytes the op must move at the
least and the fraction of the copy bandwidth (measured first) that this reaches.

The cases are those of the project's performance issue: hidden 4096, rank 16, one
slice, bf16, decode and prefill token counts, tokens in random order; then real
layer shapes (QKV with GQA widths, rank 64). ``--hidden``, ``--rank``, ``--dtype``
and ``--slices`` change them. On the CUDA simulator it runs a tiny smoke version
(``--quick``) whose "times" are host wall-clock times and mean nothing for speed.

``--moe`` times MoE LoRA instead (:mod:`punica_numba.bench_moe`). ``--grid`` runs the
grid of real model shapes instead (:mod:`punica_numba.bench_grid`:
ranks 8-256, five hidden sizes, their QKV, MLP-in and MLP-out layers, 1-8192 tokens, three
LoRA mixes, bf16 and fp16), in parts that each fit a 10-minute device limit. ``--peers``
times the ten layers where the strongest peers were timed, beside their figures
(:mod:`punica_numba.bench_peers`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from . import reference
from ._cuda import SIMULATOR, device_of
from .launch import config_name, force_launch_config, launch_configs
from .meta import LoRAKernelMeta
from .ops import prepare_expand, prepare_shrink
from .wrapper import PunicaWrapperNumba

__all__ = ["Case", "default_cases", "main"]

L2_BYTES = 60 * 2**20  # the H200's L2; a pool of argument sets at least twice this
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The aim against a peer's kernel (the dense peers of ``bench --peers``, vLLM's MoE LoRA of
#: ``bench --moe --against``): each case in at most this fraction of the peer's time.
TARGET_RATIO = 0.67

#: How many LoRAs the tokens of a case use, by ``lora_mode``, from the token count T. The
#: tokens take them in equal shares (as equal as T allows), in random token order.
LORA_MODES: dict[str, Callable[[int], int]] = {
    "identical": lambda t: 1,  # every token on one LoRA
    "uniform": lambda t: math.ceil(math.sqrt(t)),  # ceil(sqrt(T)) LoRAs
    "distinct": lambda t: t,  # every token its own LoRA
    "eight": lambda t: min(8, t),  # 8 LoRAs (fewer when T < 8)
    "distinct256": lambda t: min(t, 256),  # every token its own LoRA, up to 256 LoRAs
}

#: vLLM v0.9.2's Triton kernels on this H200, measured the same way (from the
#: project's performance issue), keyed by (op, T, num_loras, slices, rank).
VLLM_US = {
    **{
        ("shrink", t, n, (4096,), 16): us
        for t, n, us in [
            (1, 1, 4.0),
            (16, 16, 7.8),
            (64, 64, 22.6),
            (256, 256, 35.1),
            (64, 8, 7.9),
            (256, 16, 14.5),
            (256, 1, 14.1),
            (1024, 32, 19.1),
            (4096, 64, 53.5),
            (4096, 1, 19.9),
        ]
    },
    **{
        ("expand", t, n, (4096,), 16): us
        for t, n, us in [
            (1, 1, 3.9),
            (16, 16, 8.2),
            (64, 64, 16.9),
            (256, 256, 72.2),
            (64, 8, 5.4),
            (256, 16, 8.4),
            (256, 1, 5.4),
            (1024, 32, 21.9),
            (4096, 64, 110.6),
            (4096, 1, 24.2),
        ]
    },
    **{
        (op, t, n, (4096, 1024, 1024), 16): us
        for op, t, n, us in [
            ("shrink", 1, 1, 5.0),
            ("expand", 1, 1, 11.2),
            ("shrink", 64, 64, 171.5),
            ("expand", 64, 64, 88.4),
            ("shrink", 256, 256, 96.0),
            ("expand", 256, 256, 445.0),
            ("shrink", 256, 16, 20.9),
            ("expand", 256, 16, 33.5),
            ("shrink", 4096, 64, 136.6),
            ("expand", 4096, 64, 583.5),
        ]
    },
    **{
        (op, t, n, (4096,), 64): us
        for op, t, n, us in [
            ("shrink", 1, 1, 4.7),
            ("expand", 1, 1, 5.6),
            ("shrink", 64, 64, 77.3),
            ("expand", 64, 64, 31.5),
            ("shrink", 256, 256, 102.8),
            ("expand", 256, 256, 115.7),
            ("shrink", 256, 16, 16.0),
            ("expand", 256, 16, 11.4),
            ("shrink", 4096, 64, 169.4),
            ("expand", 4096, 64, 116.6),
        ]
    },
}


@dataclass
class Case:
    """One benchmark problem. ``slices`` are the expand output widths (shrink uses their count)."""

    op: str
    T: int
    lora_mode: str  # a key of LORA_MODES: identical, uniform, distinct, eight, distinct256
    hidden: int  # the shrink's input width (K of x: [T, K])
    rank: int
    dtype: str
    slices: list[int] = field(default_factory=list)

    @property
    def num_loras(self) -> int:
        return LORA_MODES[self.lora_mode](self.T)

    def floor_bytes(self) -> int:
        """The fewest bytes the op must move: x once, each active LoRA's weights once,
        the output once (read and written where expand adds)."""
        elem = torch.tensor([], dtype=DTYPES[self.dtype]).element_size()
        n, widths = self.num_loras, self.slices
        if self.op == "shrink":
            s = len(widths)
            return (
                self.T * self.hidden * elem
                + n * s * self.rank * self.hidden * elem
                + (s * self.T * self.rank * 4)
            )
        total = sum(widths)
        return (
            len(widths) * self.T * self.rank * 4
            + n * total * self.rank * elem
            + (2 * self.T * total * elem)
        )


def default_cases(hidden=4096, rank=16, dtype="bf16", slices=None, quick=False) -> list[Case]:
    """The issue's two tables (or a tiny version of them for the simulator)."""
    if quick:
        return [
            Case(op, t, mode, 24, 4, dtype, [8, 4])
            for op in ("shrink", "expand")
            for t, mode in ((1, "identical"), (6, "distinct"), (9, "uniform"))
        ]
    first = [
        (1, "identical"),
        (16, "distinct"),
        (64, "distinct"),
        (256, "distinct"),
        (64, "uniform"),
        (256, "uniform"),
        (256, "identical"),
        (1024, "uniform"),
        (4096, "uniform"),
        (4096, "identical"),
    ]
    widths = list(slices) if slices else [hidden]
    cases = [
        Case(op, t, mode, hidden, rank, dtype, widths)
        for t, mode in first
        for op in ("shrink", "expand")
    ]
    if slices is None and hidden == 4096 and rank == 16:  # the real-layer table
        layer = [
            (1, "identical"),
            (64, "distinct"),
            (256, "distinct"),
            (256, "uniform"),
            (4096, "uniform"),
        ]
        for shape_rank, shape_slices in ((16, [4096, 1024, 1024]), (64, [4096])):
            cases += [
                Case(op, t, mode, hidden, shape_rank, dtype, shape_slices)
                for t, mode in layer
                for op in ("shrink", "expand")
            ]
    return cases


def _slots(case: Case, gen: torch.Generator) -> torch.Tensor:
    """Each token's slot, in random token order."""
    n = case.num_loras
    slots = torch.arange(case.T) % n  # equal shares (identical: all 0; distinct: all own)
    return slots[torch.randperm(case.T, generator=gen)]


def _argument_set(case: Case, gen: torch.Generator, device) -> dict:
    """One argument set of ``case`` on ``device``, its values drawn by ``gen`` on the
    generator's own device (a CUDA generator fills gigabytes in milliseconds)."""
    dtype = DTYPES[case.dtype]
    n, r, H, T = case.num_loras, case.rank, case.hidden, case.T

    def rand(*shape, dt=dtype):
        values = torch.randn(*shape, generator=gen, device=gen.device)
        return (values * 0.5).to(dtype=dt, device=device)

    if case.op == "shrink":
        return dict(
            x=rand(T, H),
            weights=[rand(n, r, H) for _ in case.slices],
            out=torch.zeros(len(case.slices), T, r, device=device),
        )
    return dict(
        x=rand(len(case.slices), T, r, dt=torch.float32),
        weights=[rand(n, w, r) for w in case.slices],
        out=rand(T, sum(case.slices)),
    )


def _prepared_op(case: Case, args: dict, meta: LoRAKernelMeta):
    """The op's checked launch for one argument set (``.config``: the configuration)."""
    if case.op == "shrink":
        return prepare_shrink(args["x"], args["weights"], args["out"], *meta.meta_args(case.T), 1.0)
    return prepare_expand(
        args["x"],
        args["weights"],
        args["out"],
        *meta.meta_args(case.T),
        offset_start=0,
        add_inputs=True,
    )


def _run_op(case: Case, args: dict, meta: LoRAKernelMeta) -> None:
    _prepared_op(case, args, meta)()


def _run_gather_bmm(case: Case, args: dict, slots: torch.Tensor) -> None:
    """The straightforward torch baseline: gather each token's weights, batched matmul."""
    x, out = args["x"], args["out"]
    if case.op == "shrink":
        for s, w in enumerate(args["weights"]):
            out[s] += torch.bmm(x.unsqueeze(1), w[slots].transpose(1, 2)).squeeze(1).float()
        return
    column = 0
    for s, w in enumerate(args["weights"]):
        width = w.shape[1]
        xs = x[s].to(w.dtype).unsqueeze(1)  # [T, 1, r]
        out[:, column : column + width] += torch.bmm(xs, w[slots].transpose(1, 2)).squeeze(1)
        column += width


def _check(case: Case, args: dict, meta: LoRAKernelMeta, slots: torch.Tensor) -> float:
    """Run the op once on copies and compare with the float64 reference; return the error
    relative to the magnitude (the reference on absolute values)."""
    copy = {k: (v.clone() if isinstance(v, torch.Tensor) else list(v)) for k, v in args.items()}
    _run_op(case, copy, meta)
    x, w, out = args["x"], args["weights"], args["out"]
    if case.op == "shrink":
        want = reference.lora_shrink(x, w, out, slots, 1.0)
        size = reference.lora_shrink(x.abs(), [a.abs() for a in w], out.abs(), slots, 1.0)
    else:
        want = reference.lora_expand(x, w, out, slots, 0, True)
        size = reference.lora_expand(x.abs(), [b.abs() for b in w], out.abs(), slots, 0, True)
    return checked_error(case, copy["out"], want, size)


def checked_error(what, got: torch.Tensor, want: torch.Tensor, size: torch.Tensor) -> float:
    """The largest error of ``got`` against the float64 ``want``, relative to ``size`` (the
    reference computed on absolute values); raise if it is over the tolerance of the
    case's dtype, ``what.dtype`` (1e-2 for bf16 and fp16, 1e-5 for fp32)."""
    err = float(((got.double() - want).abs() / size.clamp_min(1e-30)).max())
    if not err <= (1e-5 if what.dtype == "fp32" else 1e-2):
        raise AssertionError(f"{what}: relative error {err:.3g} before timing")
    return err


#: Graph captures a process makes before the first graph it times. On the H200 a process's
#: first three CUDA graphs ran small kernels about 0.35 µs a call faster than every graph
#: from its fourth capture on, the first graph included (docs/benchmarks/lab_notes.md, "The
#: first graphs of a process"); a serving engine, which captures many, runs in the later
#: state, so every case is timed in it.
SETTLING_CAPTURES = 8
_settled = False


def settle_graphs(captures: int = SETTLING_CAPTURES) -> None:
    """Capture and replay ``captures`` one-kernel CUDA graphs, once per process (later
    calls return at once), so that the graphs timed after them run in the state a process
    keeps from its fourth capture on. Nothing on the simulator, which has no graphs."""
    global _settled
    if _settled or SIMULATOR:
        return
    scratch = torch.zeros(1024, device=device_of())
    for _ in range(captures):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scratch.add_(1.0)
        graph.replay()
    torch.cuda.synchronize()
    _settled = True


def time_calls(calls: list[Callable[[], None]], repeats: int = 20) -> float:
    """Median device µs per call: all calls captured into one CUDA graph, replays timed
    with CUDA events. On the simulator: host wall-clock µs per call."""
    for call in calls:  # compile, and fix launch shapes, outside capture
        call()
    if SIMULATOR:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls) * 1e6
    torch.cuda.synchronize()
    settle_graphs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def machine_record(bandwidth: float) -> dict:
    """What a benchmark's JSON says of where it ran: ``gpu`` (``"simulator"`` there),
    ``tuned_table``, the table the launcher reads (``{"gpu": whose, "file": its name}``: this
    GPU's, or another's of its compute capability; None: the heuristic alone), and
    ``copy_bandwidth_tbps``, the measured ``bandwidth``."""
    from .tuning.table import tuned_table_gpu, tuned_table_path

    path = tuned_table_path()
    return {
        "gpu": "simulator" if SIMULATOR else torch.cuda.get_device_name(),
        "tuned_table": None if path is None else {"gpu": tuned_table_gpu(), "file": path.name},
        "copy_bandwidth_tbps": round(bandwidth, 3),
    }


def copy_bandwidth_tbps() -> float:
    """HBM copy bandwidth: bytes read + written by a 1 GiB ``copy_``, eager, CUDA events."""
    a = torch.empty(2**29, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return 2 * a.numel() * a.element_size() / statistics.median(times[2:]) / 1e12


def host_overhead_us(dtype=torch.bfloat16, calls: int = 400) -> dict[str, float]:
    """Host time per eager call: ``add_lora_linear`` (one slice, metadata prepared, no bias)
    and ``lora_shrink``, 16 tokens on 16 LoRAs, hidden 4096, rank 16.

    ``add_lora_linear_eager`` repeats one call on the same tensors, as a serving step
    does, which the wrapper replays from a record of its launches;
    ``add_lora_linear_eager_moved`` takes x and y from 8 pairs in turn, so that every
    call has its activations at addresses its weight no longer remembers (it remembers
    ``REPLAYS_PER_WEIGHT``): the wrapper makes it from the record with the pointers
    moved, launch by launch."""
    device = device_of()
    T, H, r, L = (16, 4096, 16, 16) if not SIMULATOR else (4, 16, 4, 4)
    wrapper = PunicaWrapperNumba(256, 64, device, max_loras=L)
    from .mapping import LoRAMapping

    ids = list(range(1, L + 1))
    wrapper.update_metadata(
        LoRAMapping([1 + t % L for t in range(T)], [1 + t % L for t in range(T)]),
        ids,
        L + 1,
        32000,
        256,
    )
    x = torch.randn(T, H, device=device).to(dtype)
    y = torch.zeros(T, H, device=device, dtype=dtype)
    a = (torch.randn(L, 1, r, H, device=device) * 0.01).to(dtype)
    b = (torch.randn(L, 1, H, r, device=device) * 0.01).to(dtype)
    buf = torch.zeros(1, T, r, device=device)
    pairs = itertools.cycle([(x.clone(), y.clone()) for _ in range(8)])

    def moved() -> None:
        xm, ym = next(pairs)
        wrapper.add_lora_linear(ym, xm, (a,), (b,), None, 1.0, (H,))

    results = {}
    for name, call in (
        (
            "add_lora_linear_eager",
            lambda: wrapper.add_lora_linear(y, x, (a,), (b,), None, 1.0, (H,)),
        ),
        ("add_lora_linear_eager_moved", moved),
        ("lora_shrink_eager", lambda: wrapper.add_shrink(buf, x, (a,), 1.0)),
    ):
        n = calls if not SIMULATOR else 3
        for _ in range(min(n, 20)):
            call()
        if not SIMULATOR:
            torch.cuda.synchronize()
        # What ran before (the benchmark's argument pools) is collected first, so that a
        # collection of its garbage is not charged to these calls. (It is not what decides
        # the figure: v18's runs with and without it, and with the collector off, gave the
        # same range, and in v22's run one machine took 42.9 µs in the benchmark with it
        # and 41.1-47.4 in fresh processes; the machine does.)
        gc.collect()
        start = time.perf_counter()
        for _ in range(n):
            call()
        if not SIMULATOR:
            torch.cuda.synchronize()
        results[name] = (time.perf_counter() - start) / n * 1e6
    return results


def pool_size(set_bytes: int, pool_bytes: int = 2 * L2_BYTES, gpu: bool | None = None) -> int:
    """How many independent argument sets of ``set_bytes`` each a timed pool holds: enough
    to fill ``pool_bytes`` (twice the L2 by default, so that no call finds what the call
    before it touched still in L2), 2 to 1024 of them; 1 on the simulator, which is not
    timed for its memory. ``gpu`` asks for the size on a GPU (True) or on the simulator
    (False) wherever this runs; by default, for the machine it runs on."""
    if not (gpu if gpu is not None else not SIMULATOR):
        return 1
    return max(2, min(1024, math.ceil(pool_bytes / set_bytes)))


def run_case(
    case: Case,
    pool_bytes: int = 2 * L2_BYTES,
    seed: int = 0,
    all_configs: bool = False,
    baseline: bool = True,
    device_fill: bool = False,
) -> dict:
    """Check, then time the op and (``baseline``) the torch baseline on one case; return its
    record. ``device_fill`` draws the pool's values on the GPU (seeded, but other values
    than the default's, which are drawn on the host); the slots are drawn on the host
    either way."""
    device = device_of()
    gen = torch.Generator().manual_seed(seed)
    slots = _slots(case, gen)
    fill = gen
    if device_fill and not SIMULATOR:
        fill = torch.Generator(device=device).manual_seed(seed)
    meta = LoRAKernelMeta.make(case.num_loras, case.T, device)
    meta.prepare_tensors(slots.to(device))
    slots_d = slots.to(device)
    size = pool_size(case.floor_bytes(), pool_bytes)
    pool = [_argument_set(case, fill, device) for _ in range(size)]
    error = _check(case, pool[0], meta, slots_d)
    ours = time_calls([lambda a=a: _run_op(case, a, meta) for a in pool])
    chosen = getattr(_prepared_op(case, pool[0], meta), "config", None)  # the heuristic's
    per_config = {}
    for config in launch_configs(case.op) if all_configs else ():
        with force_launch_config(case.op, config):
            error = max(error, _check(case, pool[0], meta, slots_d))
            calls = [lambda a=a: _run_op(case, a, meta) for a in pool]
            per_config[config_name(config)] = round(time_calls(calls), 3)
    record = asdict(case)
    record.update(num_loras=case.num_loras, us=round(ours, 3))
    if baseline:
        torch_us = time_calls([lambda a=a: _run_gather_bmm(case, a, slots_d) for a in pool])
        record.update(torch_gather_bmm_us=round(torch_us, 3))
    record.update(
        bytes=case.floor_bytes(),
        relative_error=error,
        pool=size,
        config=config_name(chosen) if chosen else None,
    )
    if per_config:
        record["config_us"] = per_config
    vllm = VLLM_US.get((case.op, case.T, case.num_loras, tuple(case.slices), case.rank))
    if vllm is not None and case.hidden == 4096 and case.dtype == "bf16":
        record["vllm_us"] = vllm
    return record


def _table(records: list[dict], bandwidth: float) -> str:
    head = (
        f"{'op':<7}{'T':>6} {'mode':<10}{'LoRAs':>6} {'slices':<16}{'r':>4}"
        f"{'us':>11}{'floor':>8}{'of BW':>7}{'vLLM':>8}{'x vLLM':>8}{'torch':>9}"
    )
    lines = [head, "-" * len(head)]
    for c in records:
        floor = c["bytes"] / (bandwidth * 1e6) if bandwidth else float("nan")
        vllm = c.get("vllm_us")
        lines.append(
            f"{c['op']:<7}{c['T']:>6} {c['lora_mode']:<10}{c['num_loras']:>6} "
            f"{'/'.join(map(str, c['slices'])):<16}{c['rank']:>4}{c['us']:>11.2f}{floor:>8.2f}"
            f"{floor / c['us']:>7.0%}{vllm if vllm else float('nan'):>8.1f}"
            f"{c['us'] / vllm if vllm else float('nan'):>8.2f}{c['torch_gather_bmm_us']:>9.1f}"
        )
    return "\n".join(lines)


def roofline_plot(result: dict, path: str) -> None:
    """Achieved bandwidth per case (bars) against the measured copy bandwidth (line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    labels = [
        f"{c['op']} T={c['T']} {c['lora_mode']} {'/'.join(map(str, c['slices']))} r{c['rank']}"
        for c in cases
    ]
    ours = [c["bytes"] / c["us"] / 1e6 for c in cases]  # TB/s
    theirs = [c["bytes"] / c["vllm_us"] / 1e6 if c.get("vllm_us") else 0 for c in cases]
    fig, ax = plt.subplots(figsize=(12, 0.28 * len(cases) + 1.5))
    y = range(len(cases))
    ax.barh([i + 0.2 for i in y], ours, height=0.4, label="punica-numba")
    ax.barh([i - 0.2 for i in y], theirs, height=0.4, label="vLLM Triton (reference figures)")
    ax.axvline(result["copy_bandwidth_tbps"], color="k", ls="--", label="copy bandwidth")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("achieved bandwidth: fewest bytes / device time (TB/s)")
    ax.set_title(f"{result['gpu']}, commit {result['commit'][:10]}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--grid" in argv:  # the grid of real model shapes: a command of its own
        from . import bench_grid

        return bench_grid.main([a for a in argv if a != "--grid"])
    if "--peers" in argv:  # the layers where the strongest peers were timed
        from . import bench_peers

        return bench_peers.main([a for a in argv if a != "--peers"])
    if "--moe" in argv:  # MoE LoRA at Qwen3-30B-A3B's shape: a command of its own
        from . import bench_moe

        return bench_moe.main([a for a in argv if a != "--moe"])
    if "--compare" in argv:  # two runs, case by case: a command of its own
        from . import bench_compare

        return bench_compare.main([a for a in argv if a != "--compare"])
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--slices",
        type=lambda s: [int(w) for w in s.split(",")],
        default=None,
        help="expand output widths, comma-separated (default: one of --hidden)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the roofline plot (PNG)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="tiny cases (the simulator's)")
    parser.add_argument(
        "--all-configs",
        action="store_true",
        help="also check and time every launch configuration (recorded as config_us)",
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help="run the grid of real model shapes instead: see `bench --grid --help`",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="time the ten layers where the strongest peers were timed, beside their "
        "figures, instead: see `bench --peers --help`",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="time MoE LoRA (add_lora_fused_moe's op) at Qwen3-30B-A3B's shape instead: see "
        "`bench --moe --help`",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="compare two sets of runs (OLD NEW JSON files) case by case instead: see "
        "`bench --compare --help`",
    )
    args = parser.parse_args(argv)
    quick = args.quick or SIMULATOR
    cases = default_cases(args.hidden, args.rank, args.dtype, args.slices, quick=quick)
    from tqdm import tqdm

    bandwidth = 0.0 if SIMULATOR else copy_bandwidth_tbps()
    records = []
    for case in tqdm(cases, desc="bench", unit="case", file=sys.stderr):
        records.append(run_case(case, all_configs=args.all_configs))
        torch.cuda.empty_cache() if not SIMULATOR else None
    result = {
        "commit": args.commit or _commit(),
        **machine_record(bandwidth),
        "cases": records,
        "host_overhead_us": {k: round(v, 2) for k, v in host_overhead_us().items()},
    }
    print(_table(records, bandwidth))
    print("host overhead per eager call (µs):", result["host_overhead_us"])
    if SIMULATOR:
        print("(simulator: times are host wall-clock and say nothing about GPU speed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        roofline_plot(result, args.plot)
    return 0
