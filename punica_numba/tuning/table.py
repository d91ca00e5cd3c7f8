"""The tuned table: per GPU, the launch configuration measured fastest on each problem.

:func:`tuned_config` answers the launcher (:func:`punica_numba.launch.choose_launch_config`)
with the configuration of the nearest problem that ``python -m punica_numba tune``
(:mod:`.sweep`) measured on this GPU, or None, and the launcher falls back to its
hand-written heuristic.

Where a table is found: one JSON file per GPU, named after
``torch.cuda.get_device_name()`` with spaces (and any character other than letters,
digits, ``.``, ``-`` and ``_``) as ``_``, e.g. ``NVIDIA_H200.json``; looked for in the
folder named by the environment variable ``PUNICA_NUMBA_CONFIG_DIR`` first, then in the
package's own ``punica_numba/configs/``. The first file found is the table; the two are
not merged. On the CUDA simulator there is never a table.

With ``PUNICA_NUMBA_TABLE_FALLBACK=1``, a GPU with no file of its name reads instead the
table of another GPU of the same compute capability, if one in those folders says it was
tuned on one (its ``capability``; the first such file, by folder and then by name): an H100
reads the H200's. The two are one chip with other memory, and the launch configurations are
the same code on both; on the 128 problems of the H100's quick grid the H200's picks took
1.016x (shrinks) and 1.010x (expands) the H100's fastest, the heuristic 1.027x and 1.017x.
It is off by default: on the peers' ten layers on an H100 (2f3d682) the H200's answers moved
6 of the 10 shrinks, which took 0.981x their time over the ten, but the pair 1.025x, in
geometric mean (the lab notes, "The lookups timed on an H100"). :func:`tuned_table_gpu`
says whose table a process reads.

When: once per process, at the first lookup. What a call chose under the table never
changes after that, so nothing that records a call's launches (the wrapper's replays,
keyed on :func:`~punica_numba.launch.forced_launch_configs`) needs the table in its key.
:func:`reload_tuned_tables` forgets it (for tests; records made before stay as they were).

The format (:data:`FORMAT` 1)::

    {"format": 1, "gpu": "NVIDIA H200", "capability": [9, 0],
     "package": {"version": "0.1.0", "commit": "6a5f2e2..."},
     "entries": [{"op": "shrink", "dtype": "bf16", "slices": 1, "K": 4096, "N": 16,
                  "rank": 16, "T": 256, "tokens_per_lora": 16,
                  "config": "mma_t512_m16_n0", "us": 7.52,
                  "runner_up": "rows_t256_m4_n4", "runner_up_us": 8.47, ...}],
     "unresolved": []}

``capability`` (optional) is the compute capability of the GPU it was tuned on, which makes
it a fallback for others of that capability.

An entry's key is ``op, dtype, slices, K, N, rank, T, tokens_per_lora`` (:data:`KEY_FIELDS`)
and its ``layer`` (:data:`LAYERS`): K and N are the product's inner and outer sizes (shrink:
hidden and rank; expand: rank and the widest slice), ``tokens_per_lora`` the bucket of
:func:`tokens_per_lora`. ``layer`` is ``"moe"`` for an entry that ``tune --moe`` measured on
the MoE op's calls of the dense op's kernels (:mod:`punica_numba.ops.moe_dense`: T is the
call's (token, expert) pairs, ``tokens_per_lora`` their bucket a (slot, expert)), and
``"dense"`` (the default: an entry without the field) for one of a linear layer's. It
names the fastest configuration by :func:`~punica_numba.launch.config_name` with its
device µs per call, and the runner-up's; what else the tuner recorded
(:data:`OPTIONAL_FIELDS`) is checked too. ``unresolved`` holds the keys on which every
configuration failed its check or could not run (the tuner does not try them again).

Nearest: an entry matches a call only on the same layer, op and slice count, on its dtype (but
see below), and where its configuration takes the call's rank (its ``to_rank``: a
configuration made for small ranks, picked at r=32, says nothing of r=64, and an entry the
call cannot run would leave it to the heuristic though a usable entry is near); among those
the nearest is the one of least :func:`distance`, the sum of the absolute differences of
log2 K, log2 N, log2 rank, log2 T and log2 tokens_per_lora (so a factor 2 in one of them
costs 1; the rank is counted twice, once as itself and once as shrink's N or expand's K,
since it moves the choice most). Ties go to the smaller problem: the least
``(T, tokens_per_lora, rank, K, N)``. Past :data:`MAX_DISTANCE` nothing is near.

The answer: on an entry's own key, its pick. Elsewhere the :data:`NEIGHBOURS_WEIGHED`
nearest entries are weighed (:func:`pick`): of the configurations they timed that the call
can use, the one whose time over each entry's fastest is least in the mean of logs weighted
by ``2 ** -distance``. The nearest entry's pick alone took 1.085x the fastest on the H200
table's problems, each left out in turn, and the weighed answer 1.052x (``tune --report``;
the lab notes, "Weighing the neighbours"). Timed on an H100 with its quick grid's table, on the
6 of the grid's 280 lookups where the two differ, the weighed answer took 0.856x the nearest
pick's time (every one faster) and 0.946x the heuristic's (the benchmarks' probe
``lookup_ab.py``; the lab notes, "The lookups timed on an H100").

Where nothing of the call's own dtype is near, a 16-bit call takes the nearest entry of
the other 16-bit dtype (:data:`SIBLING_DTYPES`): bf16 and fp16 run the same kernels, move
the same bytes and make as many products, so the other's pick is a better guess than the
heuristic (the H200's table, bf16 only at ad02648: there the fp16 expand of 256 tokens, each
on its own LoRA, at r=16 took 23.13 µs by the heuristic and 15.43 by the bf16 entry's pick;
its fp16 entries since 684ac42 cover the quick grid's r=16 and r=64 one-slice problems and
r=16's QKV).
A MoE call looks among the MoE entries first, and among them only at the configurations of
the kernels its path runs (``kernels``); where none is near, among the dense ones as any call
(:func:`punica_numba.launch.choose_launch_config`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from .._cuda import SIMULATOR, device_of

__all__ = [
    "CONFIG_DIR_VARIABLE",
    "FALLBACK_VARIABLE",
    "FORMAT",
    "KEY_FIELDS",
    "LAYERS",
    "MAX_DISTANCE",
    "NEIGHBOURS_WEIGHED",
    "UNTIMED_RATIO",
    "TunedTableError",
    "answer",
    "configs_by_name",
    "distance",
    "entry_key",
    "entry_loras",
    "entry_times",
    "fallback_table",
    "find_table",
    "gpu_capability",
    "gpu_name",
    "grouped_entries",
    "layer_of",
    "nearest_entries",
    "nearest_with_distances",
    "new_table",
    "pick",
    "read_table",
    "reload_tuned_tables",
    "table_file_name",
    "tokens_per_lora",
    "tuned_config",
    "tuned_table_gpu",
    "tuned_table_path",
    "validate_table",
    "write_table",
]

#: The version of the file format this module reads and writes.
FORMAT = 1
#: The environment variable naming a folder of the user's own tables (searched first).
CONFIG_DIR_VARIABLE = "PUNICA_NUMBA_CONFIG_DIR"
#: The environment variable that, set to "1", lets a GPU without a table of its own read
#: the table of another GPU of its compute capability.
FALLBACK_VARIABLE = "PUNICA_NUMBA_TABLE_FALLBACK"
#: The tables shipped with the package.
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "configs"
#: The fields of an entry's key, in the order of :func:`entry_key`.
KEY_FIELDS = ("op", "dtype", "slices", "K", "N", "rank", "T", "tokens_per_lora")
#: The layers an entry may be tuned on (its ``layer`` field; absent: the first).
LAYERS = ("dense", "moe")
#: The key's sizes that :func:`distance` measures, in log2.
SIZE_FIELDS = ("K", "N", "rank", "T", "tokens_per_lora")
#: Beyond this :func:`distance` no entry is near: a factor 8 in T alone, or a factor 2 in
#: the rank (which counts twice) and in T.
MAX_DISTANCE = 3.0
#: The nearest entries a lookup weighs (:func:`pick`).
NEIGHBOURS_WEIGHED = 8
#: What a configuration counts on a neighbour that has no time for it: twice its fastest.
UNTIMED_RATIO = 2.0
#: The dtype whose entries a call of the key's dtype takes where none of its own is near.
SIBLING_DTYPES = {"bf16": "fp16", "fp16": "bf16"}
#: Lookups remembered at once (a serving process sees a few shapes, but every row count).
MAX_CACHED = 1 << 16

OPS = ("shrink", "expand")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: What the tuner may record beside the key and the winner, and the type of each.
OPTIONAL_FIELDS = {
    "loras": int,  # LoRAs the tuned problem's tokens were spread over
    "widths": list,  # the expand's slice widths (shrink: the layer's, for the record)
    "heuristic": str,  # what the hand-written heuristic picks there ...
    "heuristic_us": float,  # ... and its µs (None where it failed its check)
    "times_us": dict,  # every configuration timed: name -> µs
    "failed": dict,  # name -> why (its check failed, or it did not run)
    "skipped": list,  # names the problem cannot use (tensor cores, lanes, to_rank)
    "tuned_s": float,  # wall seconds the tuner spent on this key
    "retimed_with": list,  # configurations timed again beside the entry's (tune --retime)
    "near": int,  # tune --near: only its N nearest entries' picks and the heuristic's timed
    "tokens": int,  # a MoE entry's tokens (its T is their pairs with the experts) ...
    "experts": int,  # ... the experts of its layer ...
    "top_k": int,  # ... and the experts a token
}
_ENTRY_FIELDS = {
    "config": str,
    "us": float,
    "runner_up": str,
    "runner_up_us": float,
}
_NULLABLE = {"runner_up", "runner_up_us", "heuristic", "heuristic_us"}
_UNRESOLVED_FIELDS = (
    "loras",
    "widths",
    "failed",
    "skipped",
    "tuned_s",
    "tokens",
    "experts",
    "top_k",
)


class TunedTableError(ValueError):
    """A tuned table that cannot be read: the message names the file and the bad field."""


def table_file_name(gpu: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"``: spaces, and any character other
    than letters, digits, ``.``, ``-`` and ``_``, become ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", gpu) + ".json"


def gpu_name() -> str:
    """The name whose table this process reads: ``torch.cuda.get_device_name()`` of the
    current device (``"simulator"`` on the simulator)."""
    return "simulator" if SIMULATOR else torch.cuda.get_device_name(device_of())


def gpu_capability() -> tuple[int, int] | None:
    """The compute capability of the current device, ``(9, 0)`` on Hopper (None on the
    simulator)."""
    return None if SIMULATOR else tuple(torch.cuda.get_device_capability(device_of()))


def tokens_per_lora(num_tokens: int, active_slots: int | None) -> int:
    """The tokens-per-LoRA bucket of a call: ``T / active_slots`` rounded to the nearest
    power of two in log2 (halves up), at least 1. ``active_slots`` None or 0 (metadata not
    built by ``LoRAKernelMeta``) counts as a token per slot, as the heuristic takes it."""
    per_slot = num_tokens / active_slots if active_slots else 1.0
    return 1 << max(0, math.floor(math.log2(max(per_slot, 1.0)) + 0.5))


def distance(a: dict, b: dict) -> float:
    """The distance between two keys (dicts with the :data:`SIZE_FIELDS`): the sum over
    K, N, rank, T and tokens_per_lora of ``|log2 a - log2 b|``, rounded to 6 decimals so
    that equal sums tie exactly."""
    return round(sum(abs(math.log2(a[f]) - math.log2(b[f])) for f in SIZE_FIELDS), 6)


def layer_of(entry: dict) -> str:
    """An entry's ``layer``: ``"dense"`` where it has none (:data:`LAYERS`)."""
    return entry.get("layer", LAYERS[0])


def entry_loras(entry: dict) -> int:
    """The LoRAs an entry's tokens were spread over: its ``loras``, or where it has none,
    its T over its tokens a LoRA."""
    return entry.get("loras") or max(1, round(entry["T"] / entry["tokens_per_lora"]))


def entry_key(entry: dict) -> tuple:
    """An entry's key: its :data:`KEY_FIELDS` values, in order, then its layer."""
    return (*(entry[f] for f in KEY_FIELDS), layer_of(entry))


def new_table(gpu: str, version: str, commit: str, capability=None) -> dict:
    """An empty table for ``gpu`` (of compute ``capability``, if given), tuned at package
    ``version`` and ``commit``."""
    doc = {"format": FORMAT, "gpu": gpu}
    if capability is not None:
        doc["capability"] = list(capability)
    doc.update(package={"version": version, "commit": commit}, entries=[], unresolved=[])
    return doc


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #
def table_machine(doc: dict) -> str:
    """Whose configurations a table names: "simulator" for a table the tuner wrote on the
    simulator (its ``gpu`` is ``"simulator"``), else "gpu"."""
    return "simulator" if doc.get("gpu") == "simulator" else "gpu"


def configs_by_name(machine: str) -> dict:
    """``op -> {config_name: LaunchConfig}`` of ``machine``'s configurations."""
    # Imported here: launch imports this module to consult the table.
    from ..launch import config_name, launch_configs

    return {op: {config_name(c): c for c in launch_configs(op, machine)} for op in OPS}


def _fail(source, where: str, why: str):
    raise TunedTableError(f"{source}: {where}: {why}")


def _typed(source, where: str, value, kind, nullable: bool = False):
    """``value`` if it is of ``kind`` (an int is a float; a bool is neither), else fail."""
    if value is None and nullable:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
        _fail(source, where, f"expected {kind.__name__}, got {value!r}")
    if kind is float and not (math.isfinite(value) and value > 0):
        _fail(source, where, f"expected a finite time > 0, got {value!r}")
    return value


def _known(source, where: str, name, names: dict, op: str) -> None:
    if name not in names:
        _fail(source, where, f"unknown configuration {name!r} of {op!r} (known: {sorted(names)})")


def _check_key(source, where: str, entry: dict, names_by_op: dict) -> None:
    if not isinstance(entry, dict):
        _fail(source, where, f"expected an object, got {entry!r}")
    for field in KEY_FIELDS:
        if field not in entry:
            _fail(source, f"{where}.{field}", "missing")
    op, dtype = entry["op"], entry["dtype"]
    if not isinstance(op, str) or op not in names_by_op:
        _fail(source, f"{where}.op", f"expected one of {OPS}, got {op!r}")
    if dtype not in DTYPE_NAMES.values():
        _fail(
            source,
            f"{where}.dtype",
            f"expected one of {sorted(DTYPE_NAMES.values())}, got {dtype!r}",
        )
    if layer_of(entry) not in LAYERS:
        _fail(source, f"{where}.layer", f"expected one of {LAYERS}, got {entry['layer']!r}")
    for field in KEY_FIELDS[2:]:
        value = _typed(source, f"{where}.{field}", entry[field], int)
        if value < 1:
            _fail(source, f"{where}.{field}", f"expected an integer >= 1, got {value}")
    if entry["tokens_per_lora"] & (entry["tokens_per_lora"] - 1):
        _fail(
            source,
            f"{where}.tokens_per_lora",
            f"expected a power of two, got {entry['tokens_per_lora']}",
        )
    ranked = "N" if op == "shrink" else "K"  # shrink: N is the rank; expand: K is
    if entry[ranked] != entry["rank"]:
        _fail(
            source,
            f"{where}.{ranked}",
            f"{op}'s {ranked} is its rank {entry['rank']}, got {entry[ranked]}",
        )


def _check_optional(source, where: str, entry: dict, names: dict, op: str) -> None:
    for field, kind in OPTIONAL_FIELDS.items():
        if field not in entry:
            continue
        value = _typed(source, f"{where}.{field}", entry[field], kind, field in _NULLABLE)
        if field == "heuristic" and value is not None:
            _known(source, f"{where}.heuristic", value, names, op)
        if field in ("widths", "skipped"):
            for i, item in enumerate(value):
                _typed(source, f"{where}.{field}[{i}]", item, int if field == "widths" else str)
        if field in ("times_us", "failed", "skipped"):
            for name in value:
                _known(source, f"{where}.{field}", name, names, op)
        if field == "times_us":
            for name, us in value.items():
                _typed(source, f"{where}.times_us.{name}", us, float)
        if field == "failed":
            for name, why in value.items():
                _typed(source, f"{where}.failed.{name}", why, str)


def _check_entry(source, where: str, entry: dict, names_by_op: dict, unresolved: bool) -> None:
    _check_key(source, where, entry, names_by_op)
    op = entry["op"]
    names = names_by_op[op]
    allowed = {*KEY_FIELDS, "layer"}
    allowed |= set(_UNRESOLVED_FIELDS) if unresolved else set(OPTIONAL_FIELDS)
    if not unresolved:
        allowed |= set(_ENTRY_FIELDS)
        for field, kind in _ENTRY_FIELDS.items():
            if field not in entry:
                _fail(source, f"{where}.{field}", "missing")
            _typed(source, f"{where}.{field}", entry[field], kind, field in _NULLABLE)
    unknown = sorted(set(entry) - allowed)
    if unknown:
        _fail(source, where, f"unknown fields {unknown}")
    _check_optional(source, where, entry, names, op)
    if unresolved:
        return
    config, runner_up = entry["config"], entry["runner_up"]
    _known(source, f"{where}.config", config, names, op)
    if config in entry.get("failed", {}) or config in entry.get("skipped", []):
        _fail(source, f"{where}.config", f"{config!r} failed its check or was skipped there")
    if (runner_up is None) != (entry["runner_up_us"] is None):
        _fail(source, f"{where}.runner_up_us", "given without runner_up, or missing with it")
    if runner_up is not None:
        _known(source, f"{where}.runner_up", runner_up, names, op)
        if runner_up == config:
            _fail(source, f"{where}.runner_up", f"the winner {config!r} itself")
        if entry["runner_up_us"] < entry["us"]:
            _fail(
                source,
                f"{where}.runner_up_us",
                f"{entry['runner_up_us']} µs is faster than the winner's {entry['us']}",
            )
    if "times_us" in entry and entry["times_us"].get(config) != entry["us"]:
        _fail(source, f"{where}.us", f"{entry['us']} is not times_us[{config!r}]")
    reach = names[config].to_rank
    if reach is not None and entry["rank"] > reach:
        _fail(
            source,
            f"{where}.config",
            f"{config!r} cannot take rank {entry['rank']} (to_rank {reach})",
        )


def validate_table(doc, source="<table>") -> None:
    """Check a parsed table against the format; raise :class:`TunedTableError` naming
    ``source`` (the file) and the first bad field (``entries[3].config: unknown
    configuration 'x' of 'shrink' ...``). Configuration names are checked against
    the :func:`~punica_numba.launch.launch_configs` of the table's machine
    (:func:`table_machine`), so a GPU's table reads on any machine."""
    if not isinstance(doc, dict):
        _fail(source, "the file", f"expected a JSON object, got {type(doc).__name__}")
    fields = {"format", "gpu", "capability", "package", "entries", "unresolved"}
    unknown = sorted(set(doc) - fields)
    if unknown:
        _fail(source, "the file", f"unknown fields {unknown}")
    if doc.get("format") != FORMAT:
        _fail(source, "format", f"expected {FORMAT}, got {doc.get('format')!r}")
    _typed(source, "gpu", doc.get("gpu"), str)
    capability = doc.get("capability", [0, 0])
    if not (
        isinstance(capability, list)
        and len(capability) == 2
        and all(type(v) is int and v >= 0 for v in capability)
    ):
        _fail(source, "capability", f"expected [major, minor], got {capability!r}")
    package = doc.get("package")
    if not isinstance(package, dict) or set(package) != {"version", "commit"}:
        _fail(source, "package", f"expected {{'version': ..., 'commit': ...}}, got {package!r}")
    for field in ("version", "commit"):
        _typed(source, f"package.{field}", package[field], str)
    names_by_op = configs_by_name(table_machine(doc))
    seen: dict[tuple, str] = {}
    for part in ("entries", "unresolved"):
        entries = doc.get(part, [] if part == "unresolved" else None)
        if not isinstance(entries, list):
            _fail(source, part, f"expected a list, got {entries!r}")
        for i, entry in enumerate(entries):
            where = f"{part}[{i}]"
            _check_entry(source, where, entry, names_by_op, part == "unresolved")
            key = entry_key(entry)
            if key in seen:
                named = dict(zip((*KEY_FIELDS, "layer"), key))
                _fail(source, where, f"the same key as {seen[key]}: {named}")
            seen[key] = where


def read_table(path) -> dict:
    """Read and validate the table at ``path`` (:func:`validate_table`)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TunedTableError(f"{path}: not JSON: {error}") from None
    validate_table(doc, path)
    return doc


def write_table(path, doc: dict) -> None:
    """Validate ``doc`` and write it to ``path`` (entries sorted by key) through a
    temporary file in the same folder, so that an interrupted write leaves the old file."""
    path = Path(path)
    validate_table(doc, path)
    doc = dict(doc)
    for part in ("entries", "unresolved"):
        doc[part] = sorted(doc.get(part, []), key=entry_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.writing")
    scratch.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(scratch, path)


def search_dirs() -> list[Path]:
    """Where tables are looked for, in order: ``PUNICA_NUMBA_CONFIG_DIR`` (when set),
    then the package's ``configs/``."""
    user = os.environ.get(CONFIG_DIR_VARIABLE)
    return ([Path(user)] if user else []) + [PACKAGE_DIR]


def find_table(gpu: str) -> Path | None:
    """The first table file for ``gpu`` in :func:`search_dirs`, or None."""
    for folder in search_dirs():
        path = folder / table_file_name(gpu)
        if path.is_file():
            return path
    return None


def fallback_table(capability) -> Path | None:
    """The first table file in :func:`search_dirs` (by folder, then by name) tuned on a GPU
    of compute ``capability`` (its ``capability`` field), or None. A file that is not a
    table's JSON is passed over here (and reported where a GPU of its name reads it)."""
    want = list(capability)
    for folder in search_dirs():
        for path in sorted(folder.glob("*.json")):
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(doc, dict) and doc.get("capability") == want:
                return path
    return None


# --------------------------------------------------------------------------- #
# Lookup
# --------------------------------------------------------------------------- #
_UNSEEN = object()
#: True once the process knows there is no table (the simulator, or no file for this GPU).
_nothing = False
#: (layer, op, dtype name, slices) -> [(key sizes, tie order, entry)]; None: not loaded.
_groups: dict | None = None
#: op -> configuration name -> LaunchConfig, of the loaded table's machine.
_configs: dict = {}
_path: Path | None = None
#: The GPU the loaded table was tuned on (None: none loaded).
_tuned_on: str | None = None
#: tuned_config's arguments -> its answer.
_found: dict = {}


def reload_tuned_tables() -> None:
    """Forget the loaded table and every lookup: the next one reads the files again."""
    global _nothing, _groups, _path, _tuned_on
    _nothing, _groups, _path, _tuned_on = False, None, None, None
    _found.clear()


def tuned_table_path() -> Path | None:
    """The file the loaded table came from (loading it now if not yet), or None."""
    _tables()
    return _path


def tuned_table_gpu() -> str | None:
    """The GPU the loaded table was tuned on (loading it now if not yet): this one's name,
    another's of the same compute capability (the module's notes), or None: no table."""
    _tables()
    return _tuned_on


def _tables() -> dict | None:
    """The loaded table's entries, grouped for lookup (read once per process)."""
    global _nothing, _groups, _path, _configs, _tuned_on
    if _groups is not None or _nothing:
        return _groups
    gpu = None if SIMULATOR else gpu_name()
    path = None if gpu is None else find_table(gpu)
    borrowed = path is None and gpu is not None and os.environ.get(FALLBACK_VARIABLE) == "1"
    if borrowed:
        path = fallback_table(gpu_capability())
    if path is None:
        _nothing = True
        return None
    doc = read_table(path)
    if doc["gpu"] != gpu and not borrowed:
        _fail(path, "gpu", f"a table for {doc['gpu']!r}, found for this GPU, {gpu!r}")
    groups = grouped_entries(doc["entries"])
    _groups, _path, _configs = groups, path, configs_by_name(table_machine(doc))
    _tuned_on = doc["gpu"]
    return groups


def grouped_entries(entries: Iterable[dict]) -> dict:
    """Entries grouped for :func:`answer`: ``(layer, op, dtype, slices)`` -> a list of
    ``(key sizes, tie order, entry)``."""
    groups: dict = {}
    for entry in entries:
        where = (layer_of(entry), entry["op"], entry["dtype"], entry["slices"])
        groups.setdefault(where, []).append(_candidate(entry, entry))
    return groups


def _candidate(entry: dict, item) -> tuple:
    """``(sizes, order, item)``: an entry's :data:`SIZE_FIELDS`, its tie order (the smaller
    problem first: T, tokens a LoRA, rank, K, N) and what a lookup answers with."""
    sizes = {f: entry[f] for f in SIZE_FIELDS}
    return sizes, tuple(entry[f] for f in ("T", "tokens_per_lora", "rank", "K", "N")), item


def nearest_with_distances(candidates: Iterable[tuple], sizes: dict, count: int) -> list:
    """The ``count`` candidates ``(sizes, order, item)`` nearest ``sizes`` (least
    :func:`distance`, then least ``order``) as ``(distance, item)`` pairs, nearest first,
    none past :data:`MAX_DISTANCE`."""
    ranked = sorted((distance(c[0], sizes), c[1], k, c[2]) for k, c in enumerate(candidates))
    return [(far, item) for far, _, _, item in ranked[:count] if far <= MAX_DISTANCE]


def entry_times(entry: dict) -> dict:
    """An entry's recorded µs by configuration: its ``times_us``, or where it has none, its
    pick's and runner-up's."""
    times = entry.get("times_us")
    if times:
        return times
    picks = ((entry["config"], entry["us"]), (entry.get("runner_up"), entry.get("runner_up_us")))
    return {name: us for name, us in picks if name and us}


def pick(neighbours: list, usable) -> str:
    """The configuration a lookup answers with, among ``neighbours``, ``(distance, entry)``
    pairs nearest first (:func:`nearest_with_distances`), whose ``usable(name)`` holds.

    An entry of the call's own key (distance 0) answers with its pick. Otherwise each
    configuration that a neighbour timed is weighed on all of them: the mean of
    ``log(its time / that neighbour's fastest)``, each neighbour weighted by
    ``2 ** -distance``, a neighbour without a time for it (or on which it failed) counting
    :data:`UNTIMED_RATIO`; the least mean wins, ties to the nearest entry's pick. So the
    answer is a configuration near the fastest on all the neighbours, not the fastest of
    one of them, which a factor 2 away may lose by 2x (the lab notes, "Weighing the
    neighbours")."""
    first_distance, first = neighbours[0]
    if first_distance == 0:
        return first["config"]
    weighed = []
    for far, entry in neighbours:
        times = entry_times(entry)
        weighed.append((2.0**-far, times, min(times.values()), entry.get("failed", {})))
    names = [first["config"]]
    names += [n for _, times, _, _ in weighed for n in sorted(times, key=times.get)]
    best, best_score = None, math.inf
    for name in dict.fromkeys(names):
        if not usable(name):
            continue
        score = sum(
            weight
            * math.log(
                times[name] / fastest if name in times and name not in failed else UNTIMED_RATIO
            )
            for weight, times, fastest, failed in weighed
        )
        if score < best_score:
            best, best_score = name, score
    return first["config"] if best is None else best


def nearest_entries(
    doc: dict, layer: str, op: str, dtype: str, slices: int, sizes: dict, count: int
) -> list[dict]:
    """The ``count`` entries of table ``doc`` nearest a problem of these ``sizes`` (a dict
    of the :data:`SIZE_FIELDS`; the rank is ``sizes["rank"]``) by the launcher's rule: the
    same layer, op and slice count, a configuration that takes the rank, of ``dtype``, or
    of its sibling 16-bit dtype where none of its own is near; nearest first."""
    configs = configs_by_name(table_machine(doc))[op]
    groups = grouped_entries(doc["entries"])
    near, _ = _neighbours(groups, configs, op, dtype, slices, sizes, layer, None, count)
    return [entry for _, entry in near]


def _neighbours(groups, configs, op, dtype, slices, sizes, layer, kernels, count) -> tuple:
    """``(near, usable)``: the ``count`` entries of ``groups`` nearest ``sizes`` whose
    configuration the call can use, as ``(distance, entry)`` pairs nearest first (of
    ``dtype``, or of its sibling 16-bit dtype where none of its own is near), and the test
    ``usable(name)``: a configuration of ``configs`` that takes the rank, of ``kernels``."""
    rank = sizes["rank"]

    def usable(name: str) -> bool:
        config = configs.get(name)
        return (
            config is not None
            and _takes_rank(config, rank)
            and (kernels is None or config.kernel in kernels)
        )

    for kind in (dtype, SIBLING_DTYPES.get(dtype)):  # its own dtype first
        takes = (c for c in groups.get((layer, op, kind, slices), ()) if usable(c[2]["config"]))
        near = nearest_with_distances(takes, sizes, count)
        if near:
            return near, usable
    return [], usable


def _takes_rank(config, rank: int) -> bool:
    """Whether a configuration takes ``rank`` (its ``to_rank``)."""
    return config.to_rank is None or rank <= config.to_rank


def _look_up(key: tuple):
    op, dtype, slices, K, N, rank, num_tokens, active_slots, layer, kernels = key
    groups = _tables()
    found = None
    name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype)
    if groups and min(K, N, rank, num_tokens) > 0:
        per_lora = tokens_per_lora(num_tokens, active_slots)
        sizes = dict(K=K, N=N, rank=rank, T=num_tokens, tokens_per_lora=per_lora)
        found = answer(groups, _configs[op], op, name, slices, sizes, layer, kernels)
    if len(_found) >= MAX_CACHED:
        _found.clear()
    _found[key] = found
    return found


def answer(
    groups: dict,
    configs: dict,
    op: str,
    dtype: str,
    slices: int,
    sizes: dict,
    layer: str = "dense",
    kernels: tuple[str, ...] | None = None,
    neighbours: int | None = None,
):
    """The lookup's answer from ``groups`` (:func:`grouped_entries`) for a problem of these
    key ``sizes`` (a dict of the :data:`SIZE_FIELDS`), as :func:`tuned_config` says: the
    LaunchConfig of ``configs`` (name -> LaunchConfig, of the op) that :func:`pick` names
    among the nearest entries the call can use (``neighbours`` of them; None:
    :data:`NEIGHBOURS_WEIGHED`), or None where none is near."""
    count = neighbours or NEIGHBOURS_WEIGHED
    near, usable = _neighbours(groups, configs, op, dtype, slices, sizes, layer, kernels, count)
    return configs[pick(near, usable)] if near else None


def tuned_config(
    op: str,
    dtype,
    slices: int,
    K: int,
    N: int,
    rank: int,
    num_tokens: int,
    active_slots: int | None,
    layer: str = "dense",
    kernels: tuple[str, ...] | None = None,
):
    """The tuned configuration for a call on this GPU (:func:`answer`), or None.

    Semantics:
        op: "shrink" | "expand"; dtype: the weights' torch dtype (or "bf16" / "fp16" /
        "fp32"); slices: the call's slice count
        K, N: shrink: hidden, rank; expand: rank, the widest slice's width
        rank: r; num_tokens: T; active_slots: slots in use (None: a token per slot)
        layer: whose entries (:data:`LAYERS`); kernels: only configurations of these
            kernels (``LaunchConfig.kernel``; None: any)
        entries with the same layer, op, dtype and slices whose configuration takes
            ``rank`` (its ``to_rank``), of ``kernels``, within MAX_DISTANCE -> the
            NEIGHBOURS_WEIGHED nearest (ties: the smaller problem) -> :func:`pick`'s
            LaunchConfig among the configurations they timed that take ``rank`` and are
            of ``kernels``; else the same among the entries of the sibling 16-bit dtype
            (bf16 <-> fp16)
        None where this GPU has no table (nor, with the fallback on, one of its compute
        capability: the module's notes; always on the simulator), or nothing is near.

    Answers are remembered per argument tuple (up to :data:`MAX_CACHED`), so that a
    repeated call costs one dict lookup; where there is no table, one flag test.

    Raises:
        TunedTableError: the table found for this GPU is malformed (at the first lookup).
    """
    if _nothing:
        return None
    key = (op, dtype, slices, K, N, rank, num_tokens, active_slots, layer, kernels)
    found = _found.get(key, _UNSEEN)
    if found is _UNSEEN:
        found = _look_up(key)
    return found
