"""``python -m punica_numba bench --grid``: shrink, expand and the whole layer over real shapes.

A kernel library is judged on its users' shapes, not on the few its authors tuned for, so
this grid takes the kernels over five hidden sizes, each with the real widths of one model's
three LoRA layers, and over ranks, token counts, LoRA mixes and dtypes. Every case times
three things on one GPU, each the way :mod:`punica_numba.bench` times an op (a pool of
argument sets larger than the L2 captured into one CUDA graph, the median device time per
call, checked against the float64 reference before it is timed):

* **shrink**: ``lora_shrink`` of the layer, ``x @ A^T`` into the fp32 buffer ``[S, T, r]``;
* **expand**: ``lora_expand``, ``buffer @ B^T`` added into the layer's output slices;
* **pair**: the layer as a model calls it, ``PunicaWrapperNumba.add_lora_linear`` (its
  shrink, storing into the wrapper's buffer rather than adding to one, then its expand,
  which may load B before it waits for the shrink; both in one graph per argument set),
  and torch's gather + ``bmm`` of the same pair, zeroed buffer included, for comparison
  (skipped where it would gather more than :data:`TORCH_GATHER_LIMIT` bytes of weights at
  once).

Each time comes with its floor (the fewest bytes the op must move: x once, each active
LoRA's weights once, the output once, read and written where expand adds; the pair's is
the sum of its two ops', its buffer written once and read once) and the fraction of the
copy bandwidth, measured in the same process, that this reaches. After its table the grid
counts the runs that meet each of its targets (:mod:`punica_numba.bench_grid_targets`; with
``--against PATH``, another grid's times too).

**The axes.**

=========  ==========================================================================
axis       values
=========  ==========================================================================
rank r     8, 16, 32, 64, 128, 256
hidden H   2560, 4096, 5120, 8192, 14336, each with its model's three layers (below)
layer      ``qkv`` (3 slices), ``mlp_in`` (gate_up: 2 slices; BLOOM's up: 1),
           ``mlp_out`` (down: 1 slice)
tokens T   1, 8, 32, 128, 512, 2048, 8192, in random order
LoRA mix   ``identical`` (1 LoRA), ``eight`` (8 LoRAs, equal shares), ``distinct256``
           (every token its own LoRA, up to 256 LoRAs: ``min(T, 256)`` in equal shares)
dtype      bf16, fp16
=========  ==========================================================================

The layers, from each model's public ``config.json`` (heads x head size for q, KV heads x
head size for k and v, ``intermediate_size`` for the MLP):

=======  ===========  ====================  ================  ===================
H        model        qkv (q / k / v)       mlp_in            mlp_out
=======  ===========  ====================  ================  ===================
2560     Qwen3-4B     4096 / 1024 / 1024    9728 x 2          9728 -> 2560
4096     Llama-3-8B   4096 / 1024 / 1024    14336 x 2         14336 -> 4096
5120     Qwen2.5-14B  5120 / 1024 / 1024    13824 x 2         13824 -> 5120
8192     Llama-3-70B  8192 / 1024 / 1024    28672 x 2         28672 -> 8192
14336    BLOOM-176B   14336 x 3             57344 (1 slice)   57344 -> 14336
=======  ===========  ====================  ================  ===================

Qwen3-4B: 32 heads and 8 KV heads of 128 (its q is wider than its hidden size);
Llama-3-8B: 32 and 8 of 128; Qwen2.5-14B: 40 and 8 of 128; Llama-3-70B: 64 and 8 of 128,
all with gated (SwiGLU) MLPs. The public model with hidden size 14336 used here is
BLOOM-176B (we know of none with grouped-query attention or a gated MLP at that size): 112
heads of 128 and no KV grouping (q, k and v as wide as the hidden size), and a GeLU MLP with
a single up-projection; its layers are taken as they are, so at H=14336 the MLP's input
layer has one slice, not two.

**The design.**

The full product is 6 x 5 x 3 x 7 x 3 x 2 = 3,780 points, far too many. Three designs
make a structured subset of 71 cases (:func:`grid_cases`); a case in more than one is run
once, and its ``design`` lists the designs it is in:

* ``star``: a base case, Llama-3-8B's QKV, r=16, 128 tokens over 8 LoRAs, bf16, varied
  one axis at a time through every value of that axis (the sweeps read as curves);
* ``pairs``: a covering array of strength 2 (built greedily, :func:`covering_array`):
  every value of any axis meets every value of every other axis in some case, so each
  two-axis interaction (rank x tokens, dtype x mix, model x rank, ...) is seen; it takes
  42 cases, the fewest possible (the 7 token counts times the 6 ranks);
* ``corner``: the extremes, 1 or 8192 tokens x rank 8 or 256 x the layer with the fewest
  or the most weights per rank (Qwen3-4B's mlp_out, BLOOM's qkv), one LoRA at 1 token and
  256 LoRAs at 8192 tokens.

**Twins.** ``--twins`` adds each case's twin in the other dtype (design ``twin``), so that
every shape is timed in bf16 and in fp16 and the two can be set side by side: the grid then
has 140 cases (the 71, of which 2 already have their twin, and 69 twins), estimated in 3
parts.

Two combinations do not exist and are left out: 1 token on 8 or 256 LoRAs (a token has
one LoRA), and 8 tokens on ``distinct256`` (the same case as ``eight``). A case whose
estimated peak GPU memory passes :data:`MEMORY_LIMIT` is never chosen (:func:`peak_bytes`).

**Parts and their time.**

``--part I/N`` runs the I-th of N parts: the grid in its run order (:func:`grid_cases`),
cut into N consecutive runs of about equal estimated time (:func:`split`); together the
parts hold every case once. A case's time is estimated (:func:`estimate_s`) as
:data:`CASE_S` for what does not scale with the pool (kernel compiles, the checks, filling
the pools) plus, for each of its four timings (shrink, expand, pair, torch's pair), the
pool size times (two host preparations of the call, :data:`HOST_US`, one eager and one
captured, plus 24 device runs: the eager one, 3 warm-up replays and 20 timed replays),
a device run taking :data:`LAUNCH_US` per launch plus its bytes at :data:`ASSUMED_TBPS`.
A part adds :data:`PROCESS_S` for the process. :func:`parts_needed` gives the fewest parts
each estimated under :data:`PART_BUDGET_S`, half a 10-minute limit, as the estimate is
rough: 2 parts of about 165 s each, with the constants set from the whole grid's run on the
H200 (263 s for the 71 cases, in 3 parts). Every record keeps its ``estimate_s`` beside its
measured ``wall_s``, to correct the estimate from a run.
``--list`` prints the cases, their estimates and the parts without running anything. A part
stopped by its limit has its finished cases in its JSON already; ``--resume`` that file,
with the same ``--part``, runs only the rest.

**The JSON.**

``--json PATH`` writes the format family of ``bench``'s (``commit``, ``gpu``, ``tuned_table``,
``copy_bandwidth_tbps``), with the grid under the key ``"grid"``, rewritten after every
case so that a part stopped by its time limit keeps what it measured::

    {"commit": ..., "gpu": ..., "tuned_table": ..., "copy_bandwidth_tbps": ...,
     "grid": {"format": "punica_numba.bench_grid/1", "part": "1/3",
              "cases_in_grid": 71, "twins": false, "axes": {...}, "models": [...],
              "parts": [{"part": "1/3", "copy_bandwidth_tbps": ..., "cases": ...,
                         "estimate_s": ..., "wall_s": ...}],
              "cases": [{"id": "Llama-3-8B qkv_proj r16 T128 eight bf16",
                         "model", "hidden", "kind", "layer", "in_features", "slices",
                         "rank", "T", "lora_mode", "num_loras", "dtype", "design",
                         "shrink": {"us", "bytes", "of_copy_bw", "pool", "config",
                                    "relative_error"},
                         "expand": {... the same ...},
                         "pair": {"us", "bytes", "of_copy_bw", "pool", "relative_error",
                                  "torch_gather_bmm_us" (null where skipped),
                                  "torch_skipped" (why, where skipped)},
                         "estimate_s", "wall_s", "error" (only where the case failed)}]}}

``us`` is the median device µs per call, ``bytes`` the floor, ``of_copy_bw`` the floor over
the copy bandwidth divided by the time (null on the simulator). ``--merge A.json B.json
...`` joins parts into one file (``--json``) and one plot (``--plot``). ``--plot PATH``
draws the roofline: time against the floor, log axes, the copy-bandwidth line, shrink,
expand, pair and torch's pair marked. On the CUDA simulator (or with ``--quick``) it runs
three tiny cases whose times are host wall-clock times and mean nothing for speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import bench, reference
from . import bench_grid_targets as targets
from ._cuda import SIMULATOR, device_of
from .mapping import LoRAMapping
from .wrapper import PunicaWrapperNumba

__all__ = [
    "GridCase",
    "Layer",
    "MODELS",
    "covering_array",
    "estimate_s",
    "grid_cases",
    "main",
    "parts_needed",
    "peak_bytes",
    "run_grid_case",
    "split",
    "twin",
]

FORMAT = "punica_numba.bench_grid/1"

RANKS = (8, 16, 32, 64, 128, 256)
HIDDENS = (2560, 4096, 5120, 8192, 14336)
KINDS = ("qkv", "mlp_in", "mlp_out")
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
MIXES = ("identical", "eight", "distinct256")  # keys of bench.LORA_MODES
GRID_DTYPES = ("bf16", "fp16")

#: The axes of the grid, in the order the covering array fills them (most values first).
AXES: dict[str, tuple] = {
    "T": TOKENS,
    "rank": RANKS,
    "hidden": HIDDENS,
    "kind": KINDS,
    "lora_mode": MIXES,
    "dtype": GRID_DTYPES,
}

#: The base case of the star: the project's first target layer, a mixed decode batch.
BASE = {"T": 128, "rank": 16, "hidden": 4096, "kind": "qkv", "lora_mode": "eight", "dtype": "bf16"}

#: The estimate of a case's peak GPU memory may not pass this (the H200 has 141 GB).
MEMORY_LIMIT = 100 * 2**30
#: torch's baseline gathers each token's weights, ``[T, r, K]`` and ``[T, N_s, r]``; it is
#: skipped where one gathered tensor would pass this.
TORCH_GATHER_LIMIT = 2 * 2**30

# The time estimate (seconds), for cutting the grid into parts. Rough by design: every
# record keeps its estimate beside its measured wall time, to correct these from a run.
PROCESS_S = 15.0  # a part's process: imports, CUDA context, copy bandwidth, graph settling
CASE_S = 4.0  # a case's fixed cost: its new kernels' compiles (up to four: the op's shrink
# and expand, the layer's storing shrink and its expand), the float64 checks, filling the
# pools on the GPU, graph instantiation. Measured on the H200 at e8b108f: the 71 cases took
# 263 s in all (a median of 3.5 s, the longest 9.3), of which this model's pool-dependent
# part was 17 s; each part's process, 8-10 s besides its cases (first estimate: 45 s and
# 8 s a case, which made 3 parts of 240 s that ran in 80-107 s)
HOST_US = {"shrink": 150.0, "expand": 150.0, "pair": 300.0}  # preparing one call on the
# host: 53 µs an eager shrink and 132 µs an add_lora_linear with moved tensors on the H200
# machine's host (docs/benchmarks/README.md), about doubled for its slow processes
TORCH_OP_HOST_US = 25.0  # one torch op of the baseline, on the host
LAUNCH_US = 3.0  # a kernel's launch and latency, on the device
ASSUMED_TBPS = 1.5  # the bytes of a run at this rate (the kernels reached 0.2-0.9 of 4.15)
DEVICE_RUNS = 1 + 3 + 20  # the eager call, the warm-up replays, time_calls' 20 timed ones
PART_BUDGET_S = 300.0  # what a part may be estimated at: half a 600 s limit (the estimate is
# rough, and the H200 machine's host runs some processes at half speed)


@dataclass(frozen=True)
class Layer:
    """One LoRA layer of a model: x ``[T, in_features]``, output slices ``slices``."""

    model: str
    hidden: int  # the model's hidden size
    kind: str  # qkv, mlp_in or mlp_out
    name: str  # the model's own name of the module
    in_features: int
    slices: tuple[int, ...]

    def weights_per_rank(self) -> int:
        """Elements of one LoRA's A and B per unit of rank: ``S * in_features + sum(N_s)``."""
        return len(self.slices) * self.in_features + sum(self.slices)


def _model(name, hidden, heads, kv_heads, head_dim, intermediate, gated=True) -> tuple:
    """A model's three layers from its config: q is heads x head_dim wide, k and v
    kv_heads x head_dim; a gated MLP has gate and up (2 slices), else up alone."""
    q, kv = heads * head_dim, kv_heads * head_dim
    mlp_in = (intermediate, intermediate) if gated else (intermediate,)
    names = ("qkv_proj", "gate_up_proj", "down_proj")
    if not gated:
        names = ("query_key_value", "dense_h_to_4h", "dense_4h_to_h")
    return (
        Layer(name, hidden, "qkv", names[0], hidden, (q, kv, kv)),
        Layer(name, hidden, "mlp_in", names[1], hidden, mlp_in),
        Layer(name, hidden, "mlp_out", names[2], intermediate, (hidden,)),
    )


#: hidden size -> that model's (qkv, mlp_in, mlp_out) layers
MODELS: dict[int, tuple[Layer, Layer, Layer]] = {
    2560: _model("Qwen3-4B", 2560, 32, 8, 128, 9728),
    4096: _model("Llama-3-8B", 4096, 32, 8, 128, 14336),
    5120: _model("Qwen2.5-14B", 5120, 40, 8, 128, 13824),
    8192: _model("Llama-3-70B", 8192, 64, 8, 128, 28672),
    14336: _model("BLOOM-176B", 14336, 112, 112, 128, 57344, gated=False),
}

#: The simulator's grid: one tiny model (hidden 32, 4 heads and 2 KV heads of 8, MLP 48).
QUICK_MODEL = _model("tiny", 32, 4, 2, 8, 48)


@dataclass(frozen=True)
class GridCase:
    """One point of the grid: a layer, its rank, tokens, LoRA mix and dtype."""

    layer: Layer
    rank: int
    T: int
    lora_mode: str
    dtype: str
    design: tuple[str, ...] = field(default=(), compare=False)  # the designs it came from

    @property
    def num_loras(self) -> int:
        return bench.LORA_MODES[self.lora_mode](self.T)

    @property
    def id(self) -> str:
        return (
            f"{self.layer.model} {self.layer.name} r{self.rank} T{self.T} "
            f"{self.lora_mode} {self.dtype}"
        )

    def op_case(self, op: str) -> bench.Case:
        """The ``bench.Case`` of one op of this layer (``hidden`` there: the shrink's K)."""
        layer = self.layer
        return bench.Case(
            op, self.T, self.lora_mode, layer.in_features, self.rank, self.dtype, list(layer.slices)
        )

    def floor_bytes(self, run: str) -> int:
        """The floor of ``run`` (shrink, expand, or pair: the sum of the two)."""
        if run == "pair":
            return self.floor_bytes("shrink") + self.floor_bytes("expand")
        return self.op_case(run).floor_bytes()

    def element_size(self) -> int:
        return torch.tensor([], dtype=bench.DTYPES[self.dtype]).element_size()

    def gathered_bytes(self) -> int:
        """The largest tensor torch's gather + bmm makes: one slice's weights for every
        token, ``[T, r, K]`` (shrink) or ``[T, N_s, r]`` (expand)."""
        widest = max(self.layer.in_features, *self.layer.slices)
        return self.T * self.rank * widest * self.element_size()

    def describe(self) -> dict:
        """The case's fields as its JSON record starts."""
        layer = self.layer
        return {
            "id": self.id,
            "model": layer.model,
            "hidden": layer.hidden,
            "kind": layer.kind,
            "layer": layer.name,
            "in_features": layer.in_features,
            "slices": list(layer.slices),
            "rank": self.rank,
            "T": self.T,
            "lora_mode": self.lora_mode,
            "num_loras": self.num_loras,
            "dtype": self.dtype,
            "design": list(self.design),
        }


def _set_bytes(case: GridCase) -> dict[str, int]:
    """Bytes of one argument set of each run, as the benchmark allocates it."""
    e, T, r, n = case.element_size(), case.T, case.rank, case.num_loras
    K, widths = case.layer.in_features, case.layer.slices
    S, N = len(widths), sum(widths)
    x, buffer, y = T * K * e, S * T * r * 4, T * N * e
    a, b = n * S * r * K * e, n * N * r * e
    return {"shrink": x + a + buffer, "expand": buffer + b + y, "pair": x + a + b + y + buffer}


def peak_bytes(case: GridCase) -> int:
    """An upper estimate of the GPU memory a case holds at once: the largest of its runs'
    pools plus that run's check (a copy of the set, its absolute values, and the float64
    reference: one slice's weights, x and the output twice over) or torch's gathered
    weights and products."""
    sets = _set_bytes(case)
    T, r, n = case.T, case.rank, case.num_loras
    K, widths = case.layer.in_features, case.layer.slices
    S, N = len(widths), sum(widths)
    weight64 = n * r * max(K, *widths) * 8  # one slice's weights in float64
    outputs64 = {"shrink": S * T * r * 8, "expand": T * N * 8, "pair": T * N * 8 + S * T * r * 8}
    torch_temps = 2 * case.gathered_bytes() if case.gathered_bytes() <= TORCH_GATHER_LIMIT else 0
    peak = 0
    for run, set_bytes in sets.items():
        pool = bench.pool_size(case.floor_bytes(run), gpu=True)
        check = 2 * set_bytes + weight64 + T * K * 8 + 4 * outputs64[run]
        extra = max(check, torch_temps if run == "pair" else 0)
        peak = max(peak, pool * set_bytes + extra)
    return peak


def estimate_s(case: GridCase) -> float:
    """The estimated seconds of a case on the H200 (the module's **Parts and their time**)."""
    total = CASE_S
    S = len(case.layer.slices)
    e, T, r = case.element_size(), case.T, case.rank
    torch_bytes = sum(2 * T * r * (case.layer.in_features + w) * e for w in case.layer.slices)
    pools = {run: bench.pool_size(case.floor_bytes(run), gpu=True) for run in HOST_US}
    for run, launches in (("shrink", 1), ("expand", 1), ("pair", 2)):
        device_us = launches * LAUNCH_US + case.floor_bytes(run) / (ASSUMED_TBPS * 1e6)
        total += pools[run] * (2 * HOST_US[run] + DEVICE_RUNS * device_us) * 1e-6
    if case.gathered_bytes() <= TORCH_GATHER_LIMIT:  # torch's pair: about 9 ops a slice
        pool, ops = pools["pair"], 9 * S + 1
        device_us = ops * LAUNCH_US + (case.floor_bytes("pair") + torch_bytes) / (
            ASSUMED_TBPS * 1e6
        )
        total += pool * (2 * ops * TORCH_OP_HOST_US + DEVICE_RUNS * device_us) * 1e-6
    return total


# -- the design ------------------------------------------------------------------------


def _exists(point: dict) -> bool:
    """Whether a (partial) point of the axes names a real case: a token has one LoRA, and
    8 tokens on ``distinct256`` are the case ``eight`` already is."""
    T, mode = point.get("T"), point.get("lora_mode")
    if T == 1 and mode not in (None, "identical"):
        return False
    return not (T == 8 and mode == "distinct256")


def _case(point: dict, design: tuple[str, ...] = ()) -> GridCase:
    layer = MODELS[point["hidden"]][KINDS.index(point["kind"])]
    return GridCase(layer, point["rank"], point["T"], point["lora_mode"], point["dtype"], design)


def _allowed(point: dict) -> bool:
    """A (partial) point may be chosen: it exists and, once complete, fits in memory."""
    if not _exists(point):
        return False
    return len(point) < len(AXES) or peak_bytes(_case(point)) <= MEMORY_LIMIT


def covering_array(axes: dict[str, Sequence], allowed: Callable[[dict], bool]) -> list[dict]:
    """Points of ``axes`` in which every allowed pair of values of two axes occurs at least
    once (a covering array of strength 2), built greedily and deterministically.

    Each point starts from each of the first uncovered pairs in turn and fills the other
    axes in order, each with the value that covers the most uncovered pairs together with
    the values already chosen (ties: the value used least so far, then the first); the
    point that covers the most is kept. ``allowed`` judges partial points; a pair it
    rejects need not be covered, and no point it rejects is made."""
    names = list(axes)
    todo = {
        ((a, va), (b, vb))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for va in axes[a]
        for vb in axes[b]
        if allowed({a: va, b: vb})
    }
    order = {(name, v): (i, j) for i, name in enumerate(names) for j, v in enumerate(axes[name])}
    uses = {key: 0 for key in order}

    def pair(a, b):  # the pair's key as ``todo`` holds it (axes in ``names`` order)
        return (a, b) if order[a] < order[b] else (b, a)

    points = []
    while todo:
        best, best_new = None, set()
        for seed in sorted(todo, key=lambda p: (order[p[0]], order[p[1]]))[:48]:
            point = dict(seed)
            for name in names:
                if name in point:
                    continue
                options = [v for v in axes[name] if allowed({**point, name: v})]
                if not options:
                    break

                def gain(v, name=name, point=point, todo=todo):
                    new = sum(pair((a, point[a]), (name, v)) in todo for a in point)
                    return (new, -uses[(name, v)], -order[(name, v)][1])

                point[name] = max(options, key=gain)
            if len(point) < len(names) or not allowed(point):
                continue
            new = {pair((a, point[a]), (b, point[b])) for a in point for b in point if a < b}
            new &= todo
            if len(new) > len(best_new):
                best, best_new = point, new
        if best is None:
            raise ValueError(f"no allowed point covers any of the {len(todo)} pairs left")
        points.append(best)
        todo -= best_new
        for key in best.items():
            uses[key] += 1
    return points


def _star() -> list[dict]:
    """The base case, then each axis through each of its values, the rest at the base
    (1 token takes one LoRA)."""
    points = [dict(BASE)]
    for name, values in AXES.items():
        for v in values:
            if v != BASE[name]:
                point = {**BASE, name: v}
                if not _exists(point):
                    point["lora_mode"] = "identical"
                points.append(point)
    return points


def _corners() -> list[dict]:
    """1 or 8192 tokens x rank 8 or 256 x the layer with the fewest or the most weights
    per rank; one LoRA at 1 token, 256 at 8192; bf16."""
    layers = [layer for model in MODELS.values() for layer in model]
    layers.sort(key=Layer.weights_per_rank)
    points = []
    for layer in (layers[0], layers[-1]):
        for T in (TOKENS[0], TOKENS[-1]):
            for rank in (RANKS[0], RANKS[-1]):
                mode = "identical" if T == 1 else "distinct256"
                where = {"hidden": layer.hidden, "kind": layer.kind}
                points.append(dict(T=T, rank=rank, **where, lora_mode=mode, dtype="bf16"))
    return points


def _run_order(case: GridCase) -> tuple:
    """Cases sharing a dtype and a rank run together (they share compiled kernels)."""
    return (
        GRID_DTYPES.index(case.dtype) if case.dtype in GRID_DTYPES else 0,
        case.rank,
        case.layer.hidden,
        KINDS.index(case.layer.kind),
        case.T,
        case.num_loras,
    )


def grid_cases(quick: bool = False, twins: bool = False) -> list[GridCase]:
    """The grid (the module's **The design**), each case once, in run order; ``quick``: three
    tiny cases of :data:`QUICK_MODEL` for the simulator (every layer kind, both dtypes);
    ``twins``: with each case's twin in the other dtype (:func:`twin`)."""
    if quick:
        qkv, mlp_in, mlp_out = QUICK_MODEL
        cases = [
            GridCase(qkv, 4, 1, "identical", "bf16", ("quick",)),
            GridCase(mlp_in, 4, 5, "distinct256", "fp16", ("quick",)),
            GridCase(mlp_out, 4, 9, "eight", "bf16", ("quick",)),
        ]
    else:
        cases = list(_the_grid())
    if twins:
        found = set(cases)  # GridCase compares without its design
        cases += [t for t in dict.fromkeys(twin(c) for c in cases) if t not in found]
        cases.sort(key=_run_order)
    return cases


def twin(case: GridCase) -> GridCase:
    """The same layer, rank, tokens and LoRA mix in the grid's other dtype."""
    (other,) = (d for d in GRID_DTYPES if d != case.dtype)
    return GridCase(case.layer, case.rank, case.T, case.lora_mode, other, ("twin",))


@functools.cache
def _the_grid() -> tuple[GridCase, ...]:
    """The whole grid, built once (the covering array takes a second or two)."""
    found: dict[GridCase, list[str]] = {}
    for design, points in (
        ("star", _star()),
        ("pairs", covering_array(AXES, _allowed)),
        ("corner", _corners()),
    ):
        for point in points:
            tags = found.setdefault(_case(point), [])
            if design not in tags:
                tags.append(design)
    cases = [
        GridCase(c.layer, c.rank, c.T, c.lora_mode, c.dtype, tuple(tags))
        for c, tags in found.items()
    ]
    return tuple(sorted(cases, key=_run_order))


# -- parts ---------------------------------------------------------------------------


def split(cases: Sequence[GridCase], parts: int) -> list[list[GridCase]]:
    """``cases`` in ``parts`` consecutive runs of about equal estimated time: a run ends
    where the running total first reaches its share of the whole (every run keeps at
    least one case while cases last)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    times = [estimate_s(c) for c in cases]
    total, out = sum(times), [[] for _ in range(parts)]
    index, done = 0, 0.0  # the part being filled; the estimated seconds placed so far
    for k, (case, t) in enumerate(zip(cases, times)):
        left = len(cases) - k  # cases still to place, this one included
        # The next part begins at the first case whose middle lies past this part's
        # share, or where each part left needs one of the cases left.
        past_share = done + t / 2 > total * (index + 1) / parts
        if index < parts - 1 and out[index] and (past_share or left <= parts - 1 - index):
            index += 1
        out[index].append(case)
        done += t
    return out


def part_estimate_s(part: Iterable[GridCase]) -> float:
    return PROCESS_S + sum(estimate_s(c) for c in part)


def parts_needed(cases: Sequence[GridCase], budget_s: float = PART_BUDGET_S) -> int:
    """The fewest parts of :func:`split` that are each estimated under ``budget_s``."""
    for n in range(1, len(cases) + 1):
        if max(part_estimate_s(p) for p in split(cases, n)) <= budget_s:
            return n
    raise ValueError(f"a single case is estimated over {budget_s} s")


def _part_arg(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part takes I/N, e.g. 1/3; got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--part I/N needs 1 <= I <= N; got {text!r}")
    return i, n


# -- running -------------------------------------------------------------------------


def _entry(us: float, floor: int, bandwidth: float, **extra) -> dict:
    """A run's record: µs, the floor in bytes, the fraction of the copy bandwidth."""
    fraction = floor / (bandwidth * 1e6) / us if bandwidth and us > 0 else None
    return {
        "us": round(us, 3),
        "bytes": floor,
        "of_copy_bw": None if fraction is None else round(fraction, 4),
        **extra,
    }


def _release() -> None:
    """Hand the last run's pool back before the next run allocates its own."""
    if not SIMULATOR:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _layer_wrapper(case: GridCase, slots: torch.Tensor, device) -> PunicaWrapperNumba:
    """A wrapper whose metadata puts token t on slot ``slots[t]`` (adapter id slot + 1 in
    slot ``slot``: ``lora_index_to_id = [1, ..., n]``)."""
    n = case.num_loras
    wrapper = PunicaWrapperNumba(case.T, case.T, device, max_loras=n)
    ids = [int(s) + 1 for s in slots]
    wrapper.update_metadata(LoRAMapping(ids, ids), list(range(1, n + 1)), n + 1, 32000, 256)
    return wrapper


def _pair_set(case: GridCase, gen: torch.Generator, device) -> dict:
    """One layer's tensors: x, A per slice, B per slice, y, and torch's fp32 buffer."""
    shrink = bench._argument_set(case.op_case("shrink"), gen, device)  # x, A_s, buffer
    expand = bench._argument_set(case.op_case("expand"), gen, device)  # (buffer), B_s, y
    return {
        "x": shrink["x"],  # [T, K]
        "a": tuple(shrink["weights"]),  # S x [n, r, K]
        "b": tuple(expand["weights"]),  # S x [n, N_s, r]
        "y": expand["out"],  # [T, sum N_s]
        "buffer": shrink["out"],  # [S, T, r] fp32, torch's (the wrapper keeps its own)
    }


def _check_pair(case, args, wrapper, slots, scale) -> float:
    """The layer once, on a copy of y, against the float64 reference layer."""
    slices = case.layer.slices
    y = args["y"].clone()
    wrapper.add_lora_linear(y, args["x"], args["a"], args["b"], scale, slices)
    want = reference.add_lora_linear(
        args["y"], args["x"], args["a"], args["b"], None, scale, slices, slots
    )
    size = reference.add_lora_linear(
        args["y"].abs(),
        args["x"].abs(),
        [a.abs() for a in args["a"]],
        [b.abs() for b in args["b"]],
        None,
        scale,
        slices,
        slots,
    )
    return bench.checked_error(case, y, want, size)


def _torch_pair(case: GridCase, args: dict, slots: torch.Tensor) -> None:
    """torch's layer: a zeroed buffer (its shrink adds), gather + bmm in, gather + bmm out."""
    args["buffer"].zero_()
    shrink = {"x": args["x"], "weights": args["a"], "out": args["buffer"]}
    bench._run_gather_bmm(case.op_case("shrink"), shrink, slots)
    expand = {"x": args["buffer"], "weights": args["b"], "out": args["y"]}
    bench._run_gather_bmm(case.op_case("expand"), expand, slots)


def _run_pair(case: GridCase, bandwidth: float, seed: int) -> dict:
    """Check, then time the layer (``add_lora_linear``) and torch's pair on one pool."""
    device = device_of()
    gen = torch.Generator().manual_seed(seed)
    slots = bench._slots(case.op_case("shrink"), gen)  # the tokens' slots as run_case's
    fill = gen if SIMULATOR else torch.Generator(device=device).manual_seed(seed)
    wrapper = _layer_wrapper(case, slots, device)
    slots_d = slots.to(device)
    scale = case.layer.in_features**-0.5  # keeps y's growth over the replays small
    floor = case.floor_bytes("pair")
    size = bench.pool_size(floor)
    pool = [_pair_set(case, fill, device) for _ in range(size)]
    error = _check_pair(case, pool[0], wrapper, slots_d, scale)
    slices = case.layer.slices
    us = bench.time_calls(
        [
            lambda p=p: wrapper.add_lora_linear(p["y"], p["x"], p["a"], p["b"], scale, slices)
            for p in pool
        ]
    )
    entry = _entry(us, floor, bandwidth, pool=size, relative_error=error)
    gathered = case.gathered_bytes()
    if gathered <= TORCH_GATHER_LIMIT:
        torch_us = bench.time_calls([lambda p=p: _torch_pair(case, p, slots_d) for p in pool])
        entry["torch_gather_bmm_us"] = round(torch_us, 3)
    else:
        entry["torch_gather_bmm_us"] = None
        entry["torch_skipped"] = (
            f"it would gather {gathered / 2**30:.1f} GiB of weights at once "
            f"(limit {TORCH_GATHER_LIMIT / 2**30:.0f} GiB)"
        )
    return entry


def run_grid_case(case: GridCase, bandwidth: float, seed: int = 0) -> dict:
    """Check and time a case's shrink, expand and pair; return its record. A failure
    (a check, or memory) is recorded under ``error`` rather than raised, so that a part
    goes on with its other cases."""
    record = case.describe()
    record["estimate_s"] = round(estimate_s(case), 1)
    start = time.perf_counter()
    try:
        for op in ("shrink", "expand"):
            got = bench.run_case(case.op_case(op), seed=seed, baseline=False, device_fill=True)
            record[op] = _entry(
                got["us"],
                got["bytes"],
                bandwidth,
                pool=got["pool"],
                config=got["config"],
                relative_error=got["relative_error"],
            )
            _release()
        record["pair"] = _run_pair(case, bandwidth, seed)
    except Exception as error:  # recorded, reported, and the exit status says so
        record["error"] = f"{type(error).__name__}: {error}"
        print(f"{case.id}: {record['error']}", file=sys.stderr)
    _release()
    record["wall_s"] = round(time.perf_counter() - start, 1)
    return record


# -- output --------------------------------------------------------------------------


def _axes_json(cases: Sequence[GridCase]) -> dict:
    """Each axis's values, as the cases hold them (the whole grid: every value of AXES)."""
    values = {
        "T": {c.T for c in cases},
        "rank": {c.rank for c in cases},
        "hidden": {c.layer.hidden for c in cases},
        "kind": {c.layer.kind for c in cases},
        "lora_mode": {c.lora_mode for c in cases},
        "dtype": {c.dtype for c in cases},
    }
    return {
        name: sorted(found, key=str if name in ("kind", "lora_mode", "dtype") else int)
        for name, found in values.items()
    }


def _models_json(models: Iterable[tuple[Layer, ...]]) -> list[dict]:
    return [
        {
            "hidden": layers[0].hidden,
            "model": layers[0].model,
            "layers": [
                {"kind": x.kind, "layer": x.name, "in_features": x.in_features}
                | {"slices": list(x.slices)}
                for x in layers
            ],
        }
        for layers in models
    ]


def grid_table(records: list[dict]) -> str:
    """One line per case: the layer, then µs and the fraction of the copy bandwidth of
    shrink, expand and the pair, and torch's pair."""
    head = (
        f"{'model':<12}{'layer':<16}{'slices':<20}{'r':>4}{'T':>6}{'LoRAs':>6} {'dt':<5}"
        f"{'shrink':>9}{'BW':>5}{'expand':>9}{'BW':>5}{'pair':>9}{'BW':>5}{'torch':>9}"
    )
    lines = [head, "-" * len(head)]

    def cell(entry: dict | None) -> str:
        if not entry:
            return f"{'-':>9}{'':>5}"
        share = entry.get("of_copy_bw")
        return f"{entry['us']:>9.2f}" + (f"{share:>5.0%}" if share is not None else f"{'':>5}")

    for c in records:
        pair = c.get("pair") or {}
        torch_us = pair.get("torch_gather_bmm_us")
        lines.append(
            f"{c['model']:<12}{c['layer']:<16}{'/'.join(map(str, c['slices'])):<20}"
            f"{c['rank']:>4}{c['T']:>6}{c['num_loras']:>6} {c['dtype']:<5}"
            + cell(c.get("shrink"))
            + cell(c.get("expand"))
            + cell(c.get("pair"))
            + (f"{torch_us:>9.1f}" if torch_us is not None else f"{'-':>9}")
            + (f"  ERROR {c['error']}" if "error" in c else "")
        )
    return "\n".join(lines)


def grid_plot(result: dict, path: str) -> None:
    """The grid's roofline: device time against the floor, log axes, the copy-bandwidth
    line (time = bytes / bandwidth), shrink, expand, pair and torch's pair marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["grid"]["cases"]
    bandwidth = result.get("copy_bandwidth_tbps") or 0.0
    fig, ax = plt.subplots(figsize=(9, 6.5))
    styles = {
        "shrink": dict(marker="o", color="tab:blue"),
        "expand": dict(marker="s", color="tab:orange"),
        "pair": dict(marker="^", color="tab:green"),
    }
    floors, times = [], []
    for run, style in styles.items():
        points = [(c[run]["bytes"], c[run]["us"]) for c in cases if run in c]
        floors += [b for b, _ in points]
        times += [us for _, us in points]
        if points:
            ax.scatter(*zip(*points), s=18, alpha=0.75, label=run, **style)
    torch_points = [
        (c["pair"]["bytes"], c["pair"]["torch_gather_bmm_us"])
        for c in cases
        if "pair" in c and c["pair"].get("torch_gather_bmm_us")
    ]
    if torch_points:
        ax.scatter(*zip(*torch_points), s=18, marker="x", color="0.45", label="torch pair")
    if bandwidth and floors:
        xs = [min(floors) / 2, max(floors) * 2]
        line = [b / (bandwidth * 1e6) for b in xs]  # µs at the copy bandwidth
        ax.plot(xs, line, "k--", label=f"copy bandwidth {bandwidth:.2f} TB/s")
        ax.set_ylim(bottom=max(min(line), min(times) / 5))  # the line, not far below the data
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("floor: the fewest bytes the run must move (bytes)")
    ax.set_ylabel("median device time per call (µs)")
    note = " (simulator: host times, meaningless)" if result.get("gpu") == "simulator" else ""
    part = result["grid"].get("part")
    ax.set_title(
        f"grid{' part ' + part if part else ''}: {len(cases)} cases, {result['gpu']}, "
        f"commit {str(result['commit'])[:10]}{note}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(result: dict, path: str) -> None:
    """Write ``result`` whole, through a temporary file (a reader never sees half)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(temporary, path)


def merge(results: Sequence[dict]) -> dict:
    """Join part results of one grid (the same commit, GPU and format, no case twice)."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0]
    for other in results[1:]:
        for key in ("commit", "gpu", "tuned_table"):
            if other.get(key) != first.get(key):
                raise ValueError(f"parts of different {key}s: {first[key]!r}, {other[key]!r}")
        if other["grid"]["format"] != first["grid"]["format"]:
            raise ValueError(f"parts of different formats: {other['grid']['format']!r}")
        if other["grid"]["cases_in_grid"] != first["grid"]["cases_in_grid"]:
            raise ValueError(
                f"parts of different grids: of {first['grid']['cases_in_grid']} and "
                f"{other['grid']['cases_in_grid']} cases"
            )
    cases, parts = {}, []
    for result in results:
        parts += result["grid"]["parts"]
        for case in result["grid"]["cases"]:
            if case["id"] in cases:
                raise ValueError(f"case {case['id']!r} is in more than one part")
            cases[case["id"]] = case
    bandwidths = [p["copy_bandwidth_tbps"] for p in parts if p.get("copy_bandwidth_tbps")]
    grid = dict(first["grid"], part=None, parts=parts, cases=list(cases.values()))
    return {
        "commit": first["commit"],
        "gpu": first["gpu"],
        "tuned_table": first.get("tuned_table"),
        "copy_bandwidth_tbps": round(statistics.median(bandwidths), 3) if bandwidths else 0.0,
        "grid": grid,
    }


def _against(parser: argparse.ArgumentParser, path: str | None) -> tuple:
    """``--against``'s records and its name (its commit), as :func:`.grid_targets` takes
    them; nothing without it."""
    if path is None:
        return ()
    try:
        with open(path) as f:
            other = json.load(f)
        return other["grid"]["cases"], str(other["commit"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--against {path}: not a grid's JSON ({type(error).__name__}: {error})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba bench --grid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--part", type=_part_arg, metavar="I/N", help="run the I-th of N parts")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the roofline plot (PNG)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="three tiny cases (the simulator's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--twins", action="store_true", help="every case in both dtypes (its twin added)"
    )
    parser.add_argument(
        "--list", action="store_true", help="print the cases, estimates and parts; run nothing"
    )
    parser.add_argument(
        "--resume", metavar="PATH", help="keep the cases of this earlier JSON; run the rest"
    )
    parser.add_argument(
        "--merge", nargs="+", metavar="PART", help="join part JSONs into --json and --plot"
    )
    parser.add_argument(
        "--against",
        metavar="PATH",
        help="another grid's JSON (an earlier version's, say): its times join the targets",
    )
    args = parser.parse_args(argv)
    against = _against(parser, args.against)

    if args.merge:
        results = []
        for path in args.merge:
            with open(path) as f:
                results.append(json.load(f))
        result = merge(results)
        grid = result["grid"]
        print(grid_table(grid["cases"]))
        print(f"{len(grid['cases'])} of the grid's {grid['cases_in_grid']} cases")
        print(targets.report(targets.grid_targets(grid["cases"], *against)))
        if args.json:
            _write_json(result, args.json)
        if args.plot:
            grid_plot(result, args.plot)
        return 0

    # The simulator runs only the tiny grid; the plan of the whole one may be listed anywhere.
    quick = args.quick or (SIMULATOR and not args.list)
    everything = grid_cases(quick=quick, twins=args.twins)
    i, n = args.part or (1, 1)
    cases = split(everything, n)[i - 1]
    part = f"{i}/{n}" if args.part else None
    if part and part_estimate_s(cases) > PART_BUDGET_S:
        print(
            f"warning: part {part} is estimated at {part_estimate_s(cases):.0f} s, over "
            f"{PART_BUDGET_S:.0f}; `--grid --list` says how many parts fit",
            file=sys.stderr,
        )

    if args.list:
        for index, case in enumerate(cases):
            design = ", ".join(case.design)
            print(f"{index + 1:>3} {estimate_s(case):>6.1f} s  {case.id}  [{design}]")
        needed = parts_needed(everything)
        print(f"{len(cases)} cases, estimated {part_estimate_s(cases):.0f} s with the process")
        print(f"the grid: {len(everything)} cases, estimated {part_estimate_s(everything):.0f} s;")
        print(f"{needed} parts each estimated under {PART_BUDGET_S:.0f} s:")
        for k, chunk in enumerate(split(everything, needed)):
            print(f"  --part {k + 1}/{needed}: {len(chunk)} cases, {part_estimate_s(chunk):.0f} s")
        return 0

    commit = args.commit or bench._commit()
    done: dict[str, dict] = {}  # id -> the record of an earlier run
    earlier_parts: list[dict] = []
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            earlier = json.load(f)
        if earlier["commit"] != commit or earlier["grid"]["format"] != FORMAT:
            parser.error(f"--resume {args.resume} is of commit {earlier['commit']}, not {commit}")
        done = {c["id"]: c for c in earlier["grid"]["cases"] if "error" not in c}
        earlier_parts = earlier["grid"]["parts"]
    from tqdm import tqdm

    started = time.perf_counter()
    bandwidth = 0.0 if SIMULATOR else bench.copy_bandwidth_tbps()
    result = {
        "commit": commit,
        **bench.machine_record(bandwidth),
        "grid": {
            "format": FORMAT,
            "part": part,
            "cases_in_grid": len(everything),
            "twins": args.twins,
            "axes": _axes_json(everything),
            "models": _models_json([QUICK_MODEL] if quick else MODELS.values()),
            "parts": list(earlier_parts),  # (a resumed part's earlier runs first)
            "cases": [],
        },
    }
    summary = {
        "part": part or "1/1",
        "copy_bandwidth_tbps": round(bandwidth, 3),
        "cases": len(cases),
        "estimate_s": round(part_estimate_s(cases), 1),
        "wall_s": None,
    }
    result["grid"]["parts"].append(summary)
    records = result["grid"]["cases"]
    for case in tqdm(cases, desc="grid", unit="case", file=sys.stderr):
        records.append(done.get(case.id) or run_grid_case(case, bandwidth, args.seed))
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        if args.json:
            _write_json(result, args.json)
    print(grid_table(records))
    print(targets.report(targets.grid_targets(records, *against)))
    if SIMULATOR:
        print("(simulator: times are host wall-clock and say nothing about GPU speed)")
    if args.plot:
        grid_plot(result, args.plot)
    failed = [c["id"] for c in records if "error" in c]
    if failed:
        print(f"{len(failed)} cases failed: {failed}", file=sys.stderr)
    return 1 if failed else 0
