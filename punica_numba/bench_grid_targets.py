"""The grid's targets, read from the records of ``bench --grid``: how many runs meet each.

The grid (:mod:`punica_numba.bench_grid`) times three runs of every case: the shrink, the
expand and the pair (the layer, both ops). Each target below is a count, for each run, of
the cases it applies to and of those that meet it, with the cases that miss it, the
furthest first:

==========  =================================================================================
target      a run meets it where
==========  =================================================================================
torch       the pair takes less time than torch's gather + bmm of the same layer (measured
            in the same process; the grid times torch's pair only)
bandwidth   it reaches :data:`COPY_SHARE` of the copy bandwidth; only runs whose floor takes
            :data:`FLOOR_US` or more at the copy bandwidth count
fp16        its fp16 time is at most :data:`FP16_OVER_BF16` times its bf16 twin's (``bench
            --grid --twins`` times every shape in both dtypes; a case without its twin does
            not count)
against     its time is at most the best of another grid's for the same case (``--against``:
            an earlier version's run, say) and, for the pair, torch's, with the
            :data:`punica_numba.bench_compare.TOLERANCE` that separates runs of the same code
==========  =================================================================================

A run's floor in µs is its ``of_copy_bw`` times its ``us`` (the fraction is the floor's time
over the measured time), so each part's own copy bandwidth is the one used. On the CUDA
simulator the fraction is null and the bandwidth target counts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .bench_compare import TOLERANCE

__all__ = ["COPY_SHARE", "FLOOR_US", "FP16_OVER_BF16", "Target", "grid_targets", "report"]

RUNS = ("shrink", "expand", "pair")
#: The bandwidth target: this fraction of the copy bandwidth ...
COPY_SHARE = 0.70
#: ... where the run's floor takes at least this many µs at the copy bandwidth.
FLOOR_US = 10.0
#: The fp16 target: an fp16 run takes at most this times its bf16 twin's time.
FP16_OVER_BF16 = 1.10


@dataclass
class Target:
    """One target on one run: ``met`` of ``of`` cases, and the misses as ``(how far, case
    id)``, the furthest first (``how far``: the ratio of times, or the fraction of the copy
    bandwidth for the bandwidth target)."""

    name: str
    run: str
    met: int = 0
    of: int = 0
    misses: list[tuple[float, str]] = field(default_factory=list)

    def count(self, meets: bool, how_far: float, case_id: str) -> None:
        self.of += 1
        if meets:
            self.met += 1
        else:
            self.misses.append((how_far, case_id))


def _entry(record: dict, run: str) -> dict | None:
    entry = record.get(run)
    return entry if isinstance(entry, dict) and entry.get("us") else None


def _twin_id(record: dict) -> str | None:
    """The id of the record's bf16 twin, for an fp16 record (its id ends in its dtype)."""
    if record.get("dtype") != "fp16" or not record["id"].endswith(" fp16"):
        return None
    return record["id"][: -len("fp16")] + "bf16"


def grid_targets(
    records: Sequence[dict], against: Sequence[dict] | None = None, against_name: str = ""
) -> list[Target]:
    """Every target on every run it applies to; the against target only with ``against``
    (another grid's records, ``against_name`` naming them, e.g. by commit)."""
    by_id = {r["id"]: r for r in records if "error" not in r}
    theirs = {r["id"]: r for r in against or () if "error" not in r}
    targets = {
        (name, run): Target(name, run)
        for name in ("torch", "bandwidth", "fp16") + (("against",) if against else ())
        for run in RUNS
        if name != "torch" or run == "pair"
    }
    for case_id, record in by_id.items():
        for run in RUNS:
            entry = _entry(record, run)
            if entry is None:
                continue
            us = entry["us"]
            torch_us = entry.get("torch_gather_bmm_us") if run == "pair" else None
            if torch_us:
                targets["torch", run].count(us < torch_us, us / torch_us, case_id)
            share = entry.get("of_copy_bw")
            if share is not None and share * us >= FLOOR_US:
                targets["bandwidth", run].count(share >= COPY_SHARE, share, case_id)
            twin = by_id.get(_twin_id(record) or "")
            twin_entry = _entry(twin, run) if twin else None
            if twin_entry:
                ratio = us / twin_entry["us"]
                targets["fp16", run].count(ratio <= FP16_OVER_BF16, ratio, case_id)
            old = _entry(theirs[case_id], run) if case_id in theirs else None
            if old:
                best = min(old["us"], torch_us or old["us"])
                ratio = us / best
                targets["against", run].count(ratio <= 1 + TOLERANCE, ratio, case_id)
    for target in targets.values():
        target.misses.sort(reverse=target.name != "bandwidth")  # the furthest first
        if against_name and target.name == "against":
            target.name = f"against {against_name}"
    return list(targets.values())


_WORDS = {
    "torch": "the pair faster than torch's gather + bmm",
    "bandwidth": f"{COPY_SHARE:.0%} of copy bandwidth where the floor is >= {FLOOR_US:g} µs",
    "fp16": f"fp16 at most {FP16_OVER_BF16:.2f}x its bf16 twin",
    "against": f"at most the best of {{}} and torch, +{TOLERANCE:.0%}",
}


def _words(name: str) -> str:
    if name.startswith("against"):
        return _WORDS["against"].format(name[len("against ") :] or "the other grid")
    return _WORDS[name]


def report(targets: Sequence[Target], worst: int = 3) -> str:
    """A table of the targets (met / of, per run; ``-`` where a target counts nothing), then
    the ``worst`` furthest misses of each."""
    names = list(dict.fromkeys(t.name for t in targets))
    cells = {(t.name, t.run): t for t in targets}
    width = max(len(_words(n)) for n in names)
    lines = [f"{'target':<{width}}" + "".join(f"{run:>10}" for run in RUNS)]
    for name in names:
        row = f"{_words(name):<{width}}"
        for run in RUNS:
            t = cells.get((name, run))
            row += f"{f'{t.met}/{t.of}' if t and t.of else '-':>10}"
        lines.append(row)
    missed = [t for t in targets if t.misses]
    if missed:
        lines.append("missed, the furthest first:")
    for t in missed:
        shown = [
            f"{how:.0%} {case}" if t.name == "bandwidth" else f"{how:.2f}x {case}"
            for how, case in t.misses[:worst]
        ]
        more = f" (and {len(t.misses) - worst} more)" if len(t.misses) > worst else ""
        lines.append(f"  {t.name}, {t.run}: " + "; ".join(shown) + more)
    return "\n".join(lines)
