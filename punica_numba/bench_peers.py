"""``python -m punica_numba bench --peers``: the layers where the strongest peers were timed.

The strongest current peers of these kernels, vLLM 0.33's Triton LoRA ops (default
configurations), SGLang 0.5.23's chunked SGMV ("csgmv", split-K shrink, its H200-tuned
blocks) and vLLM v0.9.2's Triton kernels, were timed on an H200 on ten layers of
Llama-3-8B's shapes, bf16, the pair of one layer (shrink and expand) per call, replayed from
CUDA graphs over a pool larger than the L2, tokens in random order, the LoRAs in equal
shares or one per token. :data:`PEER_CASES` keeps each case with the best peer's time and
who it was (figures measured by others, the same way; not re-measured here).

This command times the package on the same ten layers, the way :mod:`punica_numba.bench_grid`
times a case (:func:`~punica_numba.bench_grid.run_grid_case`: shrink, expand and the pair
through ``PunicaWrapperNumba.add_lora_linear``, each checked against the float64
reference before it is timed), and sets the pair beside the best peer: the ratio, and
whether it is at most :data:`TARGET_RATIO`.

``--json PATH`` writes ``{"commit", "gpu", "tuned_table", "copy_bandwidth_tbps", "target_ratio",
"cases": [the grid record + "peer": {"us", "who"}, "ratio"]}``. On the CUDA simulator (or
with ``--quick``) two tiny layers run through the same code, whose times are host
wall-clock and mean nothing for speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from . import bench, bench_grid
from ._cuda import SIMULATOR
from .bench_grid import GridCase, Layer

__all__ = [
    "PEER_CASES",
    "PeerCase",
    "TARGET_RATIO",
    "main",
    "meets_target",
    "peer_cases",
    "run_peer_case",
]

#: The pair's time over the best peer's, at most (:data:`punica_numba.bench.TARGET_RATIO`).
TARGET_RATIO = bench.TARGET_RATIO

_QKV, _GATE_UP, _DOWN = bench_grid.MODELS[4096]
#: Llama-3-8B's attention output projection: one slice as wide as its input.
_O = Layer("Llama-3-8B", 4096, "o", "o_proj", 4096, (4096,))


@dataclass(frozen=True)
class PeerCase:
    """A layer case with the best peer's µs for its pair, and that peer."""

    case: GridCase
    peer_us: float
    peer: str


def _peer(layer: Layer, rank: int, T: int, mode: str, us: float, who: str) -> PeerCase:
    return PeerCase(GridCase(layer, rank, T, mode, "bf16"), us, who)


#: The ten cases (Llama-3-8B's shapes, bf16): layer, rank, tokens, LoRA mix, and the best
#: peer's µs for the pair.
PEER_CASES: tuple[PeerCase, ...] = (
    _peer(_QKV, 32, 32, "eight", 14.5, "SGLang 0.5.23"),  # 4 tokens per LoRA
    _peer(_GATE_UP, 32, 32, "eight", 27.2, "SGLang 0.5.23"),
    _peer(_DOWN, 32, 32, "eight", 13.3, "vLLM v0.9.2"),
    _peer(_QKV, 32, 128, "eight", 21.2, "SGLang 0.5.23"),
    _peer(_DOWN, 32, 128, "eight", 43.8, "SGLang 0.5.23"),
    _peer(_O, 128, 64, "eight", 27.6, "SGLang 0.5.23"),
    _peer(_O, 16, 64, "eight", 11.2, "vLLM 0.33"),
    _peer(_O, 16, 4096, "identical", 44.5, "vLLM v0.9.2"),
    _peer(_QKV, 16, 64, "distinct256", 31.6, "SGLang 0.5.23"),  # 64 LoRAs, one a token
    _peer(_O, 16, 256, "distinct256", 54.8, "SGLang 0.5.23"),  # 256 LoRAs
)

_TINY_QKV, _TINY_IN, _ = bench_grid.QUICK_MODEL
#: The simulator's stand-ins: two tiny layers, no peer figure of their own.
QUICK_CASES: tuple[PeerCase, ...] = (
    PeerCase(GridCase(_TINY_QKV, 4, 8, "eight", "bf16"), float("nan"), "none (simulator)"),
    PeerCase(GridCase(_TINY_IN, 8, 4, "identical", "bf16"), float("nan"), "none (simulator)"),
)


def peer_cases(quick: bool = False) -> tuple[PeerCase, ...]:
    """The cases to run: :data:`PEER_CASES`, or on the simulator :data:`QUICK_CASES`."""
    return QUICK_CASES if quick else PEER_CASES


def run_peer_case(peer: PeerCase, bandwidth: float, seed: int = 0) -> dict:
    """The grid record of ``peer.case`` with the peer's figure and the pair's ratio to it
    (None where the case failed or has no peer figure)."""
    record = bench_grid.run_grid_case(peer.case, bandwidth, seed)
    record["peer"] = {"us": peer.peer_us, "who": peer.peer}
    pair = record.get("pair")
    ratio = pair["us"] / peer.peer_us if pair and peer.peer_us == peer.peer_us else None
    record["ratio"] = None if ratio is None else round(ratio, 3)
    return record


def meets_target(record: dict) -> bool | None:
    """Whether a record's pair takes at most :data:`TARGET_RATIO` of the peer's time, by the
    two times (not the ratio rounded for the record); None where it has no ratio."""
    if record["ratio"] is None:
        return None
    return record["pair"]["us"] <= TARGET_RATIO * record["peer"]["us"]


def _table(records: list[dict]) -> str:
    head = (
        f"{'layer':<14}{'r':>4}{'T':>6}{'LoRAs':>6} {'shrink':>9} {'expand':>9} {'pair':>9}"
        f" {'peer':>7}  {'ratio':>6}  who"
    )
    lines = [head, "-" * len(head)]
    for c in records:
        if "error" in c:
            lines.append(f"{c['layer']:<14}{c['rank']:>4}{c['T']:>6}  error: {c['error']}")
            continue
        ratio = "" if c["ratio"] is None else f"{c['ratio']:.2f}"
        mark = {None: "", True: "  ok", False: "  over"}[meets_target(c)]
        lines.append(
            f"{c['layer']:<14}{c['rank']:>4}{c['T']:>6}{c['num_loras']:>6}"
            f" {c['shrink']['us']:>9.2f} {c['expand']['us']:>9.2f} {c['pair']['us']:>9.2f}"
            f" {c['peer']['us']:>7.1f}  {ratio:>6}{mark}  {c['peer']['who']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Time the peer cases; return 0, or 1 if a case failed its check or its run."""
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba bench --peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="two tiny layers (the simulator's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cases = peer_cases(quick=args.quick or SIMULATOR)
    from tqdm import tqdm

    bandwidth = 0.0 if SIMULATOR else bench.copy_bandwidth_tbps()
    records = [
        run_peer_case(peer, bandwidth, args.seed)
        for peer in tqdm(cases, desc="peers", unit="case", file=sys.stderr)
    ]
    result = {
        "commit": args.commit or bench._commit(),
        **bench.machine_record(bandwidth),
        "target_ratio": TARGET_RATIO,
        "cases": records,
    }
    print(_table(records))
    met = [c for c in records if meets_target(c)]
    rated = [c for c in records if c["ratio"] is not None]
    if rated:
        print(f"{len(met)} of {len(rated)} cases at most {TARGET_RATIO}x the best peer's time")
    if SIMULATOR:
        print("(simulator: times are host wall-clock and say nothing about GPU speed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any("error" in c for c in records) else 0
