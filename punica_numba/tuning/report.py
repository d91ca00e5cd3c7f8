"""How far the hand-written heuristic is from a tuned table: ``tune --report TABLE``.

A table written by the tuner (:mod:`.sweep`) holds, for every problem, the time of every
configuration that passed its check (``times_us``). So the heuristic of *this* package
(:func:`punica_numba.launch.choose_launch_config`, with the configurations of the table's
machine: the GPU's, or the simulator's for a simulator table) can be weighed against the
fastest on each problem without a GPU: its time there over the fastest time. The report
gives, per op, the geometric mean and the largest of those ratios, how many exceed 1.10
and 1.25, and the worst problems. A problem where the heuristic picks a configuration that
was not timed (it failed its check, or did not exist when the table was made) is counted
apart, as *not timed*.

The ratios are in-sample wherever thresholds were set from the same table: they say how
well the rules fit these problems, not how they do on others.

A MoE entry (``tune --moe``) is weighed by its own ``heuristic``, the configuration the op
took when it was tuned (the dense entries' or the heuristic's), and reported apart, as "moe
shrink" and "moe expand".

The table's own lookup is weighed too (:func:`lookup_ratios`): each entry left out of the
table in turn, the time there of the configuration the launcher would take from the rest
(:func:`.table.answer`) over the fastest. That is what a call whose shape the table does not
hold gets, a step away from the shapes it does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..launch import config_name
from .near import heuristic_config, left_out_ratios
from .table import (
    SIZE_FIELDS,
    answer,
    configs_by_name,
    entry_loras,
    grouped_entries,
    layer_of,
    nearest_with_distances,
    table_machine,
)

__all__ = [
    "NearSummary",
    "geometric_mean",
    "heuristic_ratios",
    "lookup_by_distance",
    "lookup_ratios",
    "near_summary",
    "report",
]

#: The ratios past which a problem counts as a miss in the report.
MISSES = (1.10, 1.25)


def geometric_mean(values) -> float:
    """The geometric mean of positive numbers: how ratios of times are averaged here."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def heuristic_ratios(doc: dict) -> tuple[list[tuple[float, dict, str]], list[tuple[dict, str]]]:
    """``(timed, not_timed)``: for each entry of ``doc`` (a table as :func:`.table.read_table`
    returns it) with ``times_us``, the heuristic's time over the entry's fastest, the
    entry and the configuration picked; and the entries whose pick was not timed."""
    timed, not_timed = [], []
    machine = table_machine(doc)
    for entry in doc["entries"]:
        times = entry.get("times_us")
        if not times:
            continue
        if layer_of(entry) == "moe":  # (the op's own pick, recorded as it was tuned)
            name = entry.get("heuristic")
            if name in times:
                timed.append((times[name] / min(times.values()), entry, name))
            elif name is not None:
                not_timed.append((entry, name))
            continue
        kinds = {name.split("_", 1)[0] for name in times}
        config = heuristic_config(
            entry["op"], entry["T"], entry_loras(entry), entry["rank"], entry["slices"],
            entry["K"], entry["N"], "mma" in kinds, "lanes" in kinds, machine,
        )  # fmt: skip
        name = config_name(config)
        if name in times:
            timed.append((times[name] / min(times.values()), entry, name))
        else:
            not_timed.append((entry, name))
    return timed, not_timed


def _left_out(doc: dict, apart: str | None = None):
    """For each entry of ``doc`` with ``times_us``: ``(entry, groups)``, the other entries
    grouped for :func:`.table.answer`, less those sharing its ``apart`` field's value in
    its layer, where given."""
    entries = doc["entries"]
    for k, entry in enumerate(entries):
        if not entry.get("times_us"):
            continue
        rest = entries[:k] + entries[k + 1 :]
        if apart is not None:
            layer = layer_of(entry)
            rest = [e for e in rest if layer_of(e) != layer or e[apart] != entry[apart]]
        yield entry, grouped_entries(rest)


def _answer_at(configs: dict, groups: dict, entry: dict, neighbours: int | None):
    """:func:`.table.answer` from ``groups`` at ``entry``'s key, ``neighbours`` weighed."""
    op, sizes = entry["op"], {f: entry[f] for f in SIZE_FIELDS}
    return answer(
        groups, configs[op], op, entry["dtype"], entry["slices"], sizes, layer_of(entry),
        neighbours=neighbours,
    )  # fmt: skip


def _over_fastest(entry: dict, config, untimed: float) -> float:
    """``config``'s time on ``entry`` over its fastest; ``untimed`` where it has none."""
    times, name = entry["times_us"], config_name(config)
    return times[name] / min(times.values()) if name in times else untimed


def lookup_ratios(
    doc: dict, apart: str | None = None, neighbours: int | None = None
) -> list[tuple[float, dict]]:
    """For each entry of ``doc`` with ``times_us`` and another entry near it: ``(ratio,
    entry)``, the time there of the configuration :func:`.table.answer` takes from the
    table without that entry, over the entry's fastest (``inf`` where it has no time for
    it). ``apart``: a key field (``"rank"``, ``"T"``, ...) whose value the entry's layer's
    other entries leave the table with it, as for a table that lacks the whole rank, T...;
    ``neighbours``: :func:`.table.answer`'s (1: the nearest entry's pick alone)."""
    configs = configs_by_name(table_machine(doc))
    out = []
    for entry, groups in _left_out(doc, apart):
        chosen = _answer_at(configs, groups, entry, neighbours)
        if chosen is not None:
            out.append((_over_fastest(entry, chosen, math.inf), entry))
    return out


def lookup_by_distance(doc: dict) -> list[tuple[int, int, float, float, float]]:
    """The dense entries with ``times_us`` whose heuristic pick was timed, each left out in
    turn, grouped by how far the nearest other entry lies (up to 1, 2, 3): ``(distance,
    problems, nearest, weighed, heuristic)``, the geometric means over the fastest of the
    nearest entry's pick alone, of the weighed answer (:func:`.table.answer`) and of the
    heuristic (:func:`heuristic_ratios`); a pick with no time counts 2. The heuristic's are
    in-sample wherever its thresholds were read from the same table."""
    timed, _ = heuristic_ratios(doc)
    heuristic = {id(entry): ratio for ratio, entry, _ in timed if layer_of(entry) == "dense"}
    configs = configs_by_name(table_machine(doc))
    by_distance: dict[int, list[tuple[float, float, float]]] = {}
    for entry, groups in _left_out(doc):
        if id(entry) not in heuristic:
            continue
        where = ("dense", entry["op"], entry["dtype"], entry["slices"])
        sizes = {f: entry[f] for f in SIZE_FIELDS}
        near = nearest_with_distances(groups.get(where, ()), sizes, 1)
        picks = [_answer_at(configs, groups, entry, n) for n in (1, None)]
        if not near or None in picks:
            continue
        ratios = [_over_fastest(entry, chosen, 2.0) for chosen in picks]
        by_distance.setdefault(math.ceil(near[0][0]), []).append((*ratios, heuristic[id(entry)]))
    return [
        (far, len(rows), *(geometric_mean(r[i] for r in rows) for i in range(3)))
        for far, rows in sorted(by_distance.items())
    ]


def _lookup_lines(doc: dict) -> list[str]:
    """The lookup's paragraph: :func:`lookup_ratios` by layer."""
    ratios = lookup_ratios(doc)
    lines = ["the table's lookup, each problem left out in turn: the pick's time over the fastest"]
    for layer in sorted({layer_of(e) for _, e in ratios}):
        mine = [r for r, e in ratios if layer_of(e) == layer]
        finite = [r for r in mine if math.isfinite(r)]
        misses = ", ".join(f"{sum(r > m for r in finite)} over {m:.2f}x" for m in MISSES)
        line = f"  {layer}: {len(mine)} problems with a neighbour"
        if finite:
            line += f", geometric mean {geometric_mean(finite):.4f}x, largest {max(finite):.2f}x"
            line += f"; {misses}"
        if len(finite) < len(mine):
            line += f"; {len(mine) - len(finite)} picks with no time there"
        lines.append(line)
    return lines


def _group(entry: dict) -> str:
    """``"shrink"``, ``"expand"``, ``"moe shrink"`` or ``"moe expand"``."""
    return entry["op"] if layer_of(entry) == "dense" else f"{layer_of(entry)} {entry['op']}"


def _describe(entry: dict) -> str:
    sizes = f"K={entry['K']} N={entry['N']} r={entry['rank']} T={entry['T']}"
    loras = entry.get("loras", "?")
    return f"{entry['op']} {entry['dtype']} {entry['slices']} slice(s) {sizes}, {loras} LoRAs"


def report(doc: dict, worst: int = 5, near: int | None = None) -> str:
    """The report of the module docstring, as text; with ``near``, what ``tune --near
    near`` would have lost on the table (:func:`.near.left_out_ratios`) too."""
    timed, not_timed = heuristic_ratios(doc)
    lines = [
        f"the heuristic of this package against {doc['gpu']}'s table (tuned at "
        f"{doc['package']['commit']}): its time over the fastest, per problem"
    ]
    for op in sorted({_group(entry) for _, entry, _ in timed}):
        mine = sorted((t for t in timed if _group(t[1]) == op), key=lambda t: -t[0])
        ratios = [r for r, _, _ in mine]
        geomean = geometric_mean(ratios)
        misses = ", ".join(f"{sum(r > m for r in ratios)} over {m:.2f}x" for m in MISSES)
        lines.append(
            f"{op}: {len(ratios)} problems, geometric mean {geomean:.3f}x, largest "
            f"{ratios[0]:.2f}x; {misses}"
        )
        for ratio, entry, name in mine[:worst]:
            best = min(entry["times_us"], key=entry["times_us"].get)
            lines.append(
                f"  {ratio:.2f}x {_describe(entry)}: {name} {entry['times_us'][name]} µs, "
                f"fastest {best} {entry['times_us'][best]} µs"
            )
    if not_timed:
        lines.append(f"not timed: {len(not_timed)} problems where the pick has no time")
    lines += _lookup_lines(doc)
    if near:
        lines += _near_lines(doc, near)
    return "\n".join(lines)


class NearSummary(NamedTuple):
    """What ``tune --near count`` would have lost on a table (:func:`near_summary`)."""

    problems: int  # entries with a neighbour, each left out in turn
    listed: float  # configurations in a problem's short list, on average
    checked: float  # configurations the full sweep checked a problem, on average
    ratios: list[float]  # each list's fastest over the problem's fastest (finite ones)
    untimed: int  # problems none of whose list has a time (the tuner would sweep them)

    @property
    def geomean(self) -> float:
        return geometric_mean(self.ratios)


def near_summary(doc: dict, count: int) -> NearSummary | None:
    """:func:`.near.left_out_ratios` of ``doc`` summed up; None where no problem has another
    entry near."""
    left_out = left_out_ratios(doc, count)
    if not left_out:
        return None
    finite = [r for r, _, _ in left_out if math.isfinite(r)]
    return NearSummary(
        problems=len(left_out),
        listed=sum(n for _, n, _ in left_out) / len(left_out),
        checked=sum(len(e["times_us"]) + len(e.get("failed", {})) for _, _, e in left_out)
        / len(left_out),
        ratios=finite,
        untimed=len(left_out) - len(finite),
    )


def _near_lines(doc: dict, count: int) -> list[str]:
    """The ``--near`` paragraph: each entry left out in turn, the fastest of its short list
    over its fastest."""
    summary = near_summary(doc, count)
    head = f"tune --near {count}, each problem left out of the table in turn"
    if summary is None:
        return [f"{head}: no problem has another near it"]
    lines = [
        f"{head}: {summary.problems} problems with a neighbour; {summary.listed:.1f} "
        f"configurations listed a problem, where {summary.checked:.1f} were checked in full"
    ]
    if summary.ratios:
        ratios = summary.ratios
        misses = ", ".join(f"{sum(r > m for r in ratios)} over {m:.2f}x" for m in MISSES)
        lines.append(
            f"  the list's fastest over the fastest: geometric mean {summary.geomean:.4f}x, "
            f"largest {max(ratios):.3f}x; {misses}"
        )
    if summary.untimed:
        lines.append(f"  no time for any of the list: {summary.untimed} problems")
    return lines
