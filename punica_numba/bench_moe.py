"""``python -m punica_numba bench --moe``: MoE LoRA against the copy-bandwidth limit.

The cases are one MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert
intermediate 768) with rank-16 adapters, bf16: its gate/up projection (w13: two slices
2048 -> 768, a row of x per token) and its down projection (w2: one slice 768 -> 2048, a
row per pair, weighted by the router), at T = 1, 16, 64, 256 and 2048 tokens on 1, 4 and
16 adapters (equal shares, random token order), each token on 8 distinct experts drawn
at random. What is timed is the op of ``add_lora_fused_moe``
(:func:`punica_numba.ops.moe.fused_moe_lora`: the shrink and the expand) on blocks made
before (:func:`punica_numba.moe_meta.align_pairs`, block size 16), as vLLM's
``fused_moe_lora`` is timed, the same way as the linear ops (:mod:`punica_numba.bench`:
a pool of argument sets larger than twice the L2, checked against the float64
reference on the first, CUDA-graph replays timed with CUDA events), with the kernels of
``--version`` (:data:`punica_numba.ops.moe.VERSIONS`; by default the op's own,
``DEFAULT_VERSION``), which each record names, with ``configs``: the dense op's
configuration that its shrink and its expand took (:func:`.ops.moe_dense.recorded_launches`;
versions 7 and later), none where the call ran no kernel of the dense op (the one launch of
version 11 and later, or a version before 7).

The byte floor of a case is what the op must move at the least: the A and B of every
(adapter, expert) its pairs use, once; the input rows; the output rows of every pair,
read and written. On the simulator a tiny smoke version runs (``--quick``), whose times
are host wall-clock and mean nothing for speed.

**Against a peer.** ``--against PATH`` sets each case beside another run of the same cases:
the figures of a peer's kernel (``docs/benchmarks/peers/vllm_moe_lora.py --json`` writes
them; ``docs/benchmarks/h200_moe_vllm_0.33.json`` holds vLLM 0.33's on an H200) or an earlier
``bench --moe --json``. A case meets the aim where it takes at most :data:`TARGET_RATIO` of
the peer's time; the table gives each ratio and says how many meet it, and ``--json`` records
the file, the peer and each case's ``peer_us`` and ``ratio``. Cases are matched by their
shape (:data:`SHAPE_FIELDS`); a record that leaves a field out is at this benchmark's own
layer (the peer script records projection, T and adapters only), so a ``--quick`` run
matches no full-size figure. ``--report RUN`` reads a stored run instead of timing one, on
any machine: ``bench --moe --report RUN.json --against PEER.json``. The count names the
other run's GPU: a ratio to another GPU's figures judges nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import torch

from . import bench, reference
from ._cuda import SIMULATOR, device_of
from .launch import config_name
from .moe_meta import align_pairs
from .ops import moe_dense
from .ops.moe import DEFAULT_VERSION, VERSIONS, fused_moe_lora

__all__ = [
    "SHAPE_FIELDS",
    "TARGET_RATIO",
    "MoECase",
    "against_peer",
    "argument_set",
    "case_shape",
    "default_cases",
    "floor_bytes",
    "main",
    "measure",
    "peer_times",
    "read_run",
    "run_case",
]

#: The layer measured: Qwen3-30B-A3B's MoE block.
HIDDEN, EXPERTS, TOP_K, INTERMEDIATE = 2048, 128, 8, 768
TOKENS = (1, 16, 64, 256, 2048)
LORAS = (1, 4, 16)
RANK = 16
BLOCK_SIZE = 16
#: The aim: each case in at most this fraction of the peer's time (the package's one aim
#: against a peer, :data:`punica_numba.bench.TARGET_RATIO`).
TARGET_RATIO = bench.TARGET_RATIO


@dataclass
class MoECase:
    """One MoE LoRA call: ``projection`` w13 (gate/up) or w2 (down)."""

    projection: str
    T: int
    loras: int
    hidden: int = HIDDEN
    experts: int = EXPERTS
    top_k: int = TOP_K
    intermediate: int = INTERMEDIATE
    rank: int = RANK
    dtype: str = "bf16"
    block_size: int = BLOCK_SIZE

    @property
    def slices(self) -> int:
        return 2 if self.projection == "w13" else 1

    @property
    def K(self) -> int:
        """The width of an input row."""
        return self.hidden if self.projection == "w13" else self.intermediate

    @property
    def N(self) -> int:
        """The width of an output slice."""
        return self.intermediate if self.projection == "w13" else self.hidden

    @property
    def by_pair(self) -> bool:
        """w2 reads a row per pair and weights it by the router (``mul_routed_weight``)."""
        return self.projection == "w2"

    @property
    def name(self) -> str:
        return f"moe {self.projection} T={self.T} loras={self.loras}"


#: The fields that name a case's shape, by which ``--against`` matches two runs' cases.
SHAPE_FIELDS = (
    "projection",
    "T",
    "loras",
    "hidden",
    "experts",
    "top_k",
    "intermediate",
    "rank",
    "dtype",
)


#: MoECase's defaults: the benchmark's own layer.
_OWN_LAYER = {f.name: f.default for f in fields(MoECase)}


def case_shape(record: dict) -> tuple:
    """A record's shape (:data:`SHAPE_FIELDS`); a field it leaves out is this benchmark's own
    (MoECase's default). ``bench --compare`` matches MoE runs' cases by it too."""
    return tuple(record.get(name, _OWN_LAYER.get(name)) for name in SHAPE_FIELDS)


def default_cases(quick: bool = False) -> list[MoECase]:
    """Both projections at every token count and adapter count; tiny ones with ``quick``."""
    if quick:
        small = dict(hidden=8, experts=4, top_k=2, intermediate=6, rank=2, block_size=2)
        return [
            MoECase(p, T, loras, **small) for p in ("w13", "w2") for T, loras in ((1, 1), (5, 2))
        ]
    return [MoECase(p, T, n) for p in ("w13", "w2") for T in TOKENS for n in LORAS]


def argument_set(case: MoECase, gen: torch.Generator, device) -> dict:
    """Weights, inputs, routing and blocks of one call (the routing differs per set)."""
    dt = bench.DTYPES[case.dtype]
    T, k, E, L = case.T, case.top_k, case.experts, case.loras

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.1).to(dt)

    slots = torch.arange(T, device=device) % L
    slots = slots[torch.randperm(T, generator=gen, device=device)]  # [T] equal shares
    topk_ids = torch.stack(
        [torch.randperm(E, generator=gen, device=device)[:k] for _ in range(T)]
    )  # [T, top_k] distinct experts
    enabled = torch.ones(L, dtype=torch.int32, device=device)
    blocks = align_pairs(topk_ids, slots, E, case.block_size, L, enabled)
    return dict(
        y=randn(T, k, case.slices * case.N),
        x=randn(T * k if case.by_pair else T, case.K),
        lora_a=[randn(L, E, case.rank, case.K) for _ in range(case.slices)],
        lora_b=[randn(L, E, case.N, case.rank) for _ in range(case.slices)],
        topk_ids=topk_ids,
        topk_weights=torch.rand(T, k, generator=gen, device=device),
        slots=slots,
        enabled=enabled,
        blocks=blocks,
    )


def _call(case: MoECase, args: dict, version: int = DEFAULT_VERSION):
    def call() -> None:
        fused_moe_lora(
            args["y"],
            args["x"],
            args["lora_a"],
            args["lora_b"],
            args["topk_weights"],
            *args["blocks"],
            args["enabled"],
            block_size=case.block_size,
            mul_routed_weight=case.by_pair,
            version=version,
        )

    return call


def floor_bytes(case: MoECase, args: dict) -> int:
    """The least the call must move (module docstring), from its routing."""
    size = bench.DTYPES[case.dtype].itemsize
    used = len(set(zip(args["slots"][:, None].expand_as(args["topk_ids"]).reshape(-1).tolist(),
                       args["topk_ids"].reshape(-1).tolist())))  # fmt: skip
    weights = used * case.slices * case.rank * (case.K + case.N)
    pairs = case.T * case.top_k
    rows = args["x"].shape[0] * case.K
    outputs = 2 * pairs * case.slices * case.N
    return (weights + rows + outputs) * size


def measure(case: MoECase, make_call) -> tuple[float, float, dict, int]:
    """``(µs, relative error, first argument set, pool size)``: ``make_call(args)`` (a
    call of some implementation on one argument set) checked against the reference on a
    first set, then timed over a pool of sets (the benchmark's method). The peer scripts
    under ``docs/benchmarks/peers`` measure theirs with it too."""
    first, pool, check = checked_pool(case)
    error = check(make_call)
    us = bench.time_calls([make_call(args) for args in pool])
    return us, error, first, len(pool)


def checked_pool(case: MoECase) -> tuple[dict, list[dict], Callable]:
    """``(first, pool, check)``: the case's argument sets (seed 0; ``first`` leads the pool,
    which fills twice the L2), and ``check(make_call)``, which runs ``make_call(first)``
    once on ``first``'s output as it was made and returns its error against the float64
    reference (raising past the dtype's tolerance), so that several implementations can
    be checked and timed on one pool."""
    device = device_of()
    gen = torch.Generator(device=device).manual_seed(0)
    first = argument_set(case, gen, device)
    y0 = first["y"].clone()
    want = reference.fused_moe_lora(
        first["y"], first["x"], first["lora_a"], first["lora_b"], first["topk_ids"],
        first["topk_weights"], first["slots"], mul_routed_weight=case.by_pair,
    )  # fmt: skip
    size = reference.fused_moe_lora(
        first["y"].abs(), first["x"].abs(), [a.abs() for a in first["lora_a"]],
        [b.abs() for b in first["lora_b"]], first["topk_ids"], first["topk_weights"],
        first["slots"], mul_routed_weight=case.by_pair,
    )  # fmt: skip
    set_bytes = sum(
        t.numel() * t.element_size()
        for t in (first["x"], first["y"], *first["lora_a"], *first["lora_b"])
    )
    pool = [first] + [
        argument_set(case, gen, device) for _ in range(bench.pool_size(set_bytes) - 1)
    ]

    def check(make_call) -> float:
        first["y"].copy_(y0)
        make_call(first)()
        return bench.checked_error(case, first["y"], want, size)

    return first, pool, check


def run_case(case: MoECase, bandwidth: float, version: int = DEFAULT_VERSION) -> dict:
    """Check the first argument set against the reference, then time the pool, with the
    kernels of ``version`` (``ops.moe.fused_moe_lora``), noting the configurations the
    dense op's kernels took."""
    with moe_dense.recorded_launches() as launched:
        us, error, first, pool = measure(case, lambda args: _call(case, args, version))
    floor = floor_bytes(case, first)
    return {
        **asdict(case),
        "name": case.name,
        "us": round(us, 3),
        "floor_bytes": floor,
        "floor_us": round(floor / (bandwidth * 1e6), 3) if bandwidth else None,
        "of_copy_bandwidth": round(floor / (us * 1e-6) / (bandwidth * 1e12), 3)
        if bandwidth
        else None,
        "relative_error": error,
        "pool": pool,
        "version": version,
        "shrink_version": version,  # (the key of records made before version 3)
        "configs": {op: config_name(config) for op, config in sorted(launched.items())},
    }


def read_run(path: str) -> dict:
    """The run in the JSON file ``path`` (a ``bench --moe --json`` or a peer script's), whose
    ``cases`` each hold at least ``projection``, ``T``, ``loras`` and ``us``.

    Raises:
        ValueError: the file cannot be read as such a run (the message names it and why).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
        for case in doc["cases"]:
            missing = [k for k in ("projection", "T", "loras", "us") if k not in case]
            if missing:
                raise KeyError(f"a case without {', '.join(missing)}")
            if isinstance(case["us"], bool) or not isinstance(case["us"], (int, float)):
                raise TypeError(f"a case whose us is {case['us']!r}, not a number")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path}: not a run of MoE cases, each with projection, T, loras and us "
            f"({type(error).__name__}: {error})"
        ) from None
    return doc


def peer_times(path: str) -> tuple[str, dict[tuple, float]]:
    """``(who, {shape: µs})`` of the run in ``path`` (:func:`read_run`): ``who`` is its
    ``peer`` (a peer script's) or else its commit and kernel versions, and its GPU."""
    doc = read_run(path)
    versions = sorted({c["version"] for c in doc["cases"] if "version" in c})
    who = doc.get("peer") or " ".join(
        [str(doc.get("commit", path))] + [f"version {v}" for v in versions]
    )
    if doc.get("gpu"):
        who += f" on {doc['gpu']}"
    return who, {case_shape(c): float(c["us"]) for c in doc["cases"]}


def against_peer(records: Sequence[dict], times: dict[tuple, float]) -> list[dict]:
    """``records`` with the peer's time of each case it holds (``peer_us``) and the ratio
    of the two (``ratio``: ours over the peer's); a case the peer lacks has neither (a stored
    run's figures from an earlier ``--against`` are dropped)."""
    out = []
    for r in records:
        r = {k: v for k, v in r.items() if k not in ("peer_us", "ratio")}
        peer = times.get(case_shape(r))
        out.append(r if peer is None else {**r, "peer_us": peer, "ratio": round(r["us"] / peer, 3)})
    return out


def _name(record: dict) -> str:
    return record.get("name") or MoECase(record["projection"], record["T"], record["loras"]).name


def _summary(records: list[dict], who: str) -> str:
    """How many of ``records`` (:func:`against_peer`'s) meet the aim, and the furthest."""
    compared = sorted((r for r in records if "ratio" in r), key=lambda r: -r["ratio"])
    met = sum(r["us"] <= TARGET_RATIO * r["peer_us"] for r in compared)  # not the rounded ratio
    line = f"{met} of {len(compared)} cases take at most {TARGET_RATIO}x the time of {who}"
    if len(compared) < len(records):
        line += f" ({len(records) - len(compared)} without its figure)"
    if compared:
        line += f"; the furthest: {_name(compared[0])}, {compared[0]['ratio']}x"
    return line


def _table(records: list[dict], who: str | None = None) -> str:
    peer = f" {'peer µs':>9s} {'x peer':>7s}" if who else ""
    lines = [f"  {'case':34s} {'µs':>9s} {'floor µs':>9s} {'of copy bw':>10s}{peer}"]
    for r in records:
        floor = "" if r.get("floor_us") is None else f"{r['floor_us']:9.2f}"
        share = "" if r.get("of_copy_bandwidth") is None else f"{r['of_copy_bandwidth']:10.0%}"
        ratio = ""
        if who:
            ratio = f" {'':>9s} {'':>7s}"
            if "ratio" in r:
                ratio = f" {r['peer_us']:9.2f} {r['ratio']:7.3f}"
        lines.append(f"  {_name(r):34s} {r['us']:9.2f} {floor:>9s} {share:>10s}{ratio}")
    if who:
        lines.append(_summary(records, who))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba bench --moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="tiny cases (the simulator's)")
    parser.add_argument(
        "--version",
        "--shrink-version",
        dest="version",
        type=int,
        choices=VERSIONS,
        default=DEFAULT_VERSION,
        help="the kernels (ops.moe): 1 a thread per output, 2 the shrink in shared-memory "
        "tiles, 3 the shrink with K split across a block and the expand with B in registers, "
        "4 both on the tensor cores, 5 4's shrink where blocks average 4 pairs or more (else "
        "3's) and 3's expand, 6 5's shrinks and the expand of a chunk of pairs at once as "
        "outer products, 7-9 the dense op's kernels (ops.moe's notes), 11 9's but one "
        "launch for calls of at most 8 pairs (--shrink-version: the same, its earlier name)",
    )
    parser.add_argument(
        "--against",
        metavar="PATH",
        help="set each case beside another run's (a peer's figures, or a bench --moe --json): "
        f"its ratio, and how many take at most {TARGET_RATIO}x the other's time",
    )
    parser.add_argument(
        "--report",
        metavar="RUN",
        help="time nothing: print the table of a stored bench --moe --json run (with --against)",
    )
    args = parser.parse_args(argv)
    who, times = None, {}
    try:
        if args.against:
            who, times = peer_times(args.against)
        if args.report:
            if args.json:
                parser.error("--report prints a stored run; --json is for a run timed here")
            records = read_run(args.report)["cases"]
    except ValueError as error:
        parser.error(str(error))
    if args.report:
        print(_table(against_peer(records, times), who))
        return 0
    cases = default_cases(quick=args.quick or SIMULATOR)
    from tqdm import tqdm

    bandwidth = 0.0 if SIMULATOR else bench.copy_bandwidth_tbps()
    records = []
    for case in tqdm(cases, desc="bench --moe", unit="case", file=sys.stderr):
        records.append(run_case(case, bandwidth, args.version))
        if not SIMULATOR:
            torch.cuda.empty_cache()
    records = against_peer(records, times)
    print(_table(records, who))
    if SIMULATOR:
        print("(simulator: times are host wall-clock and say nothing about GPU speed)")
    if args.json:
        result = {
            "commit": args.commit or bench._commit(),
            **bench.machine_record(bandwidth),
            **(
                {"against": {"file": args.against, "who": who, "target_ratio": TARGET_RATIO}}
                if who
                else {}
            ),
            "cases": records,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
