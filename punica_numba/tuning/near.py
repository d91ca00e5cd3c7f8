"""``tune --near N``: a problem timed under the configurations its neighbours chose.

The sweep (:mod:`.sweep`) checks and times every configuration of the launch table on every
problem, most of them losers, so a table is slow to extend to the layers, ranks and dtypes
of more models. But neighbouring problems mostly share their winners. With ``--near N`` a
problem is timed under a short list instead (:func:`candidate_names`):

* the three fastest configurations recorded in each of the ``N`` entries nearest it in the
  table being written, by the launcher's own rule (:func:`.table.nearest_entries`: the
  same layer, op and slice count, a configuration that takes the rank, its dtype or else
  the sibling 16-bit one, within :data:`.table.MAX_DISTANCE`), nearest first;
* what the hand-written heuristic picks there, with and without the tensor cores and the
  lane split (which kernels the problem can use is known only once they have run).

Each is checked against the reference before it is timed, as in the full sweep. Where no
entry is near, or none of the list passes its check, the problem is timed under every
configuration. The grids put neighbouring problems one after another, so the first problems
of a new layer or rank are swept in full and seed the rest. An entry of a short list
records ``near`` (its ``N``).

What the short list costs in speed can be measured without a GPU on a table tuned in full
(:func:`left_out_ratios`, ``tune --report TABLE --near N``): each entry left out of the table
in turn, the fastest of its short list's recorded times over its fastest.
"""

from __future__ import annotations

import math

from ..launch import choose_launch_config, config_name
from .table import KEY_FIELDS, entry_loras, layer_of, nearest_entries, table_machine

__all__ = [
    "PICKS_A_NEIGHBOUR",
    "candidate_names",
    "heuristic_config",
    "heuristic_names",
    "left_out_ratios",
]

#: The configurations taken from each neighbour: its fastest recorded.
PICKS_A_NEIGHBOUR = 3


def heuristic_config(
    op: str,
    T: int,
    loras: int,
    rank: int,
    slices: int,
    K: int,
    N: int,
    tensor_cores: bool,
    lanes: bool,
    machine: str | None = None,
):
    """The heuristic's configuration for a problem of table key sizes ``K`` and ``N`` (the
    shrink's rules read its hidden size K, the expand's its widest slice N), with no table
    read, among ``machine``'s configurations (None: this machine's)."""
    return choose_launch_config(
        op, T, loras, rank, tensor_cores, slices, lanes,
        K=K if op == "shrink" else None, N=N if op == "expand" else None, machine=machine,
    )  # fmt: skip


def heuristic_names(
    op: str, T: int, loras: int, rank: int, slices: int, K: int, N: int, machine: str
) -> list[str]:
    """The names of :func:`heuristic_config`'s picks with and without the tensor cores and
    the lane split, each once."""
    picks = (
        heuristic_config(op, T, loras, rank, slices, K, N, tensor_cores, lanes, machine)
        for tensor_cores in (True, False)
        for lanes in (True, False)
    )
    return list(dict.fromkeys(config_name(config) for config in picks))


def candidate_names(doc: dict, key: tuple, loras: int, count: int) -> list[str] | None:
    """The short list of the module docstring for the problem of table key ``key``
    (:func:`.sweep.case_key`: op, dtype, slices, K, N, rank, T, tokens a LoRA, layer) whose
    tokens use ``loras`` LoRAs, among the entries of table ``doc``: the ``count``
    neighbours' picks, nearest first, then the heuristic's (of the table's machine); None
    where no entry is near."""
    op, dtype, slices, K, N, rank, T, per_lora, layer = key
    sizes = dict(K=K, N=N, rank=rank, T=T, tokens_per_lora=per_lora)
    near = nearest_entries(doc, layer, op, dtype, slices, sizes, count)
    if not near:
        return None
    names = [name for entry in near for name in _fastest(entry)]
    names += heuristic_names(op, T, loras, rank, slices, K, N, table_machine(doc))
    return list(dict.fromkeys(names))


def _fastest(entry: dict) -> list[str]:
    """An entry's :data:`PICKS_A_NEIGHBOUR` fastest configurations: of its ``times_us``
    (every time recorded, which a retime may leave ranked apart from ``runner_up``), or
    its ``config`` and ``runner_up`` where it has none."""
    times = entry.get("times_us")
    if times:
        return sorted(times, key=times.get)[:PICKS_A_NEIGHBOUR]
    return [name for name in (entry["config"], entry.get("runner_up")) if name]


def left_out_ratios(doc: dict, count: int) -> list[tuple[float, int, dict]]:
    """For each dense entry of ``doc`` with ``times_us`` and another entry near: ``(ratio,
    listed, entry)``, where ``ratio`` is the fastest recorded time among the configurations
    of its short list (:func:`candidate_names` over the table without it) over its fastest,
    and ``listed`` the length of that list. A list none of whose configurations has a time
    there gives ``inf`` (the tuner would have swept that problem in full)."""
    out = []
    for k, entry in enumerate(doc["entries"]):
        times = entry.get("times_us")
        if not times or layer_of(entry) != "dense":
            continue
        others = dict(doc, entries=doc["entries"][:k] + doc["entries"][k + 1 :])
        key = (*(entry[f] for f in KEY_FIELDS), "dense")
        names = candidate_names(others, key, entry_loras(entry), count)
        if names is None:
            continue
        listed = [times[n] for n in names if n in times]
        ratio = min(listed) / min(times.values()) if listed else math.inf
        out.append((ratio, len(names), entry))
    return out
