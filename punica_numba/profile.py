"""Where a decode step's time goes: the engine's step split into its parts, measured.

The engine (:mod:`punica_numba.engine`) generates a batch one step at a time.
:func:`profile_decode` takes an engine and a batch (``python -m punica_numba demo
--profile`` builds the demo's: the model, the PEFT adapters in their slots, the
mixed batch, and the same prompts without adapters) and measures its decode steps:

1. **As served.** ``generate`` with nothing attached but a clock at each step's
   start (the ``on_step`` callback): milliseconds per decode step, CUDA graphs
   replayed where the engine has them; and again eagerly (``use_cuda_graphs =
   False``), where it has them.
2. **Host, by part** (eager). The same, with each part of the step wrapped (the
   wrappers are put on the engine's objects for the run and taken off after it):
   the host's time in each part, exclusive of the parts nested in it (a LoRA call
   inside a linear layer counts as LoRA, not as the layer's GEMM). What no part holds
   is the step loop's own Python (and its waits for the device).
3. **Device, by part** (GPU only, eager). Once more under ``torch.profiler``: the
   kernels each part launched and their device time, attributed to the innermost
   part that launched them; and the kernels by name.
4. **Device, graphs** (GPU only, where the engine replays graphs). The kernels of
   the replayed decode graphs, by name, under ``torch.profiler``.
5. **Before decode step 1, by part.** Once more as served, with the engine's
   ``update_metadata`` for the prefill and for decoding, its prefill and the prefill's
   LoRA calls wrapped: the host's time in each, per ``generate``
   (:data:`BEFORE_PARTS`).

A decode step is the time between two ``on_step`` calls: one forward pass over
the batch, its sampling, and whatever the loop does before the next step. Steps
``1 .. n-2`` of ``n`` new tokens are measured (step 0 is the prefill; the last one
has no next step to end it), so at least 3 new tokens are needed; the device is
drained at the window's edges, so the window holds those steps' work and no more.
Parts an engine does not have (or does not call in its decode steps) are left out.
On the simulator the tables hold host times only, and say nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ._cuda import SIMULATOR

__all__ = [
    "PartTime",
    "Probe",
    "StepProfile",
    "exclusive_times",
    "instrumented",
    "one_cycle_profiler",
    "profile_decode",
]

#: The parts of a decode step, in the order they are printed. Each is one or more
#: callables of the engine (see :func:`_targets`).
PARTS = (
    "update_metadata",
    "embedding",
    "rotary (RoPE)",
    "attention",
    "base GEMMs",
    "LoRA (add_lora_linear)",
    "norms",
    "MLP activation",
    "LM head",
    "sampling and token feedback",
    "forward, other ops",
)

#: What the host spent outside every part: the step loop's own Python (and, when the
#: engine reads tokens back, the wait for the device).
LOOP = "step loop (outside the parts)"

#: The prefix of the ``torch.profiler`` ranges the parts open.
RANGE_PREFIX = "punica_part/"

#: Decode steps are timed over this many ``generate`` calls on a GPU (one on the simulator).
GPU_REPEATS = 3


# -- the probe: exclusive host time per part ---------------------------------------------


class Probe:
    """Exclusive host time per part, from ``enter``/``exit`` calls that nest.

    Semantics:
        host[p] = time the host spent inside part p and in no part nested in it,
                  counted only while ``active``
        calls[p] = how often p was entered while active
    With ``ranges``, each part is also a ``torch.profiler`` range named
    ``RANGE_PREFIX + part``.
    """

    def __init__(self, ranges: bool = False):
        self.active = False
        self.ranges = ranges
        self.host: dict[str, float] = defaultdict(float)  # seconds
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [part, time of the last resume, range or None]

    def enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._stack and self.active:  # the enclosing part pauses
            top = self._stack[-1]
            self.host[top[0]] += now - top[1]
        span = None
        if self.ranges and self.active:
            span = torch.profiler.record_function(RANGE_PREFIX + part)
            span.__enter__()
        if self.active:
            self.calls[part] += 1
        self._stack.append([part, time.perf_counter(), span])

    def exit(self) -> None:
        part, resumed, span = self._stack.pop()
        now = time.perf_counter()
        if self.active:
            self.host[part] += now - resumed
        if span is not None:
            span.__exit__(None, None, None)
        if self._stack:
            self._stack[-1][1] = time.perf_counter()  # the enclosing part resumes

    def wrap(self, part: str, fn: Callable) -> Callable:
        """``fn`` inside part ``part``."""

        def wrapped(*args, **kwargs):
            self.enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        wrapped.__wrapped__ = fn
        return wrapped


def _targets(engine) -> Iterator[tuple[object, str, str]]:
    """``(object, attribute, part)`` for every callable of the engine that makes a part.

    Module forwards are wrapped on the instance (``module.forward``); an engine's own
    methods by their names when it has them (``_attention``, ``_rotary``, ``_sample``,
    ``_forward``: the forward pass, whose own ops are "forward, other ops").
    """
    hf = engine.model.model
    yield engine.punica, "update_metadata", "update_metadata"
    yield engine.punica, "add_lora_linear", "LoRA (add_lora_linear)"
    yield hf.embed_tokens, "forward", "embedding"
    yield hf.rotary_emb, "forward", "rotary (RoPE)"
    yield hf.norm, "forward", "norms"
    yield engine.model.lm_head, "forward", "LM head"
    for decoder, lora in zip(hf.layers, engine.layers):
        yield decoder.input_layernorm, "forward", "norms"
        yield decoder.post_attention_layernorm, "forward", "norms"
        yield decoder.mlp.act_fn, "forward", "MLP activation"
        for linear in lora.values():
            yield linear, "forward", "base GEMMs"
    for method, part in (
        ("_attention", "attention"),
        ("_rotary", "rotary (RoPE)"),
        ("_sample", "sampling and token feedback"),
        ("_feed_back", "sampling and token feedback"),
        ("_forward", "forward, other ops"),
    ):
        if callable(getattr(engine, method, None)):
            yield engine, method, part


@contextlib.contextmanager
def instrumented(engine, probe: Probe):
    """Wrap each part's callables of ``engine`` with ``probe`` for the block; unwrap after.

    The wrappers are instance attributes, so nothing outside this engine changes;
    ``transformers``' ``apply_rotary_pos_emb`` (looked up at call time by an engine that
    imports it inside its forward) is wrapped in its module for the block too.
    """
    from transformers.models.llama import modeling_llama

    undo = []
    for obj, attr, part in _targets(engine):
        had = attr in vars(obj)
        undo.append((obj, attr, had, vars(obj).get(attr)))
        setattr(obj, attr, probe.wrap(part, getattr(obj, attr)))
    rope = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = probe.wrap("rotary (RoPE)", rope)
    try:
        yield probe
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for obj, attr, had, old in reversed(undo):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


# -- device time per part, from torch.profiler --------------------------------------------


def exclusive_times(events, prefix: str = RANGE_PREFIX, attr: str = "device_time_total"):
    """Per range name (without ``prefix``): its time minus that of the ranges nested in it.

    Semantics:
        for each event e named prefix + p:
            out[p] += e.<attr> - sum(f.<attr> for f = the nearest ranges below e)
    ``events`` are ``torch.profiler``'s function events (``prof.events()``), whose
    ``cpu_children`` form the nesting; ``attr`` is ``"device_time_total"`` (µs of the
    kernels launched inside) or ``"cpu_time_total"``. Returns ``{part: (µs, kernels)}``,
    kernels counting the launches inside the part and in no nested range.
    """
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if not event.name.startswith(prefix):
            continue
        nested = list(_nearest_ranges(event, prefix))
        total = getattr(event, attr) - sum(getattr(f, attr) for f in nested)
        entry = out[event.name[len(prefix) :]]
        entry[0] += total
        entry[1] += _own_kernels(event, prefix)
    return {part: (us, kernels) for part, (us, kernels) in out.items()}


def _nearest_ranges(event, prefix: str):
    for child in event.cpu_children:
        if child.name.startswith(prefix):
            yield child
        else:
            yield from _nearest_ranges(child, prefix)


def _own_kernels(event, prefix: str) -> int:
    return len(event.kernels) + sum(
        _own_kernels(c, prefix) for c in event.cpu_children if not c.name.startswith(prefix)
    )


def kernel_table(events) -> list[tuple[str, float, int]]:
    """``(kernel name, µs, launches)`` over every device event, the longest first."""
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name]
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    return sorted(((n, us, k) for n, (us, k) in by_name.items()), key=lambda r: -r[1])


# -- one profile ---------------------------------------------------------------------------


@dataclass
class PartTime:
    """One part of a decode step: host ms per step, and (GPU) device ms and launches per step."""

    part: str
    host_ms: float
    host_share: float
    device_ms: float | None = None
    device_share: float | None = None
    launches: float | None = None


@dataclass
class StepProfile:
    """A profile of the engine's decode steps (see the module docstring)."""

    label: str
    steps: int  # decode steps measured
    batch: int
    step_ms: float  # plain: as served (graphs replayed where the engine has them)
    before_ms: float  # per generate, before decode step 1: metadata, prefill, set-up
    eager_step_ms: float | None  # plain, with the engine told to run eagerly (None: same)
    probed_step_ms: float  # with the wrappers on (their own cost included)
    parts: list[PartTime]
    device_step_ms: float | None = None  # kernels' device time per step (torch.profiler)
    kernels: list[dict] = field(default_factory=list)  # eager, by name
    graph_device_step_ms: float | None = None  # the kernels' time per replayed step
    graph_kernels: list[dict] = field(default_factory=list)  # in the replayed graphs, by name
    device_error: str | None = None  # why the device's part could not be measured
    # ``before_ms`` in parts (host ms per generate, :func:`_before_parts`)
    before_parts: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


class _Clock:
    """The ``on_step`` callback: the window of steps ``first .. last - 1``.

    At the window's edges it drains the device (so the window holds exactly those
    steps' work, also where the host queues graph replays ahead of the device) and
    calls ``on_window(True)`` / ``on_window(False)``, if given.
    """

    def __init__(self, first: int, last: int, device: torch.device, on_window=None):
        self.first, self.last, self.device, self.on_window = first, last, device, on_window
        self.starts: dict[int, float] = {}

    def __call__(self, step: int) -> None:
        if step in (self.first, self.last):
            _sync(self.device)
            if self.on_window is not None:
                self.on_window(step == self.first)
        self.starts[step] = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.starts[self.last] - self.starts[self.first]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _eager(engine, eager: bool):
    """The engine told to run its decode steps eagerly (when it can replay graphs)."""
    if not eager or not hasattr(engine, "use_cuda_graphs"):
        yield
        return
    before = engine.use_cuda_graphs
    engine.use_cuda_graphs = False
    try:
        yield
    finally:
        engine.use_cuda_graphs = before


def _plain_seconds(engine, requests, new_tokens: int, repeats: int, eager: bool):
    """``(decode, before)``: seconds of decode steps ``1 .. n-2`` over ``repeats`` calls,
    nothing attached, and of what comes before step 1 in them (the metadata, the
    prefill, the batch's set-up: from the call to step 1's start, the device drained)."""
    decode = before = 0.0
    with _eager(engine, eager):
        for _ in range(repeats):
            _sync(engine.device)
            clock = _Clock(1, new_tokens - 1, engine.device)
            begin = time.perf_counter()
            engine.generate(requests, new_tokens, on_step=clock)
            decode += clock.seconds
            before += clock.starts[1] - begin
    return decode, before


#: The parts of the time before decode step 1 (:func:`_before_parts`), in order.
BEFORE_PARTS = (
    "update_metadata for the prefill",
    "prefill: its LoRA calls",
    "prefill: the rest of the forward pass",
    "update_metadata for decoding",
    "the rest (the batch's set-up, the first token)",
)


def _before_parts(engine, requests, new_tokens: int, repeats: int) -> dict[str, float]:
    """Host ms per generate of each part of what comes before decode step 1
    (:data:`BEFORE_PARTS`), the device drained at the start and at step 1: the engine's
    ``_prepare`` for the prefill and for decoding, its ``_prefill`` and, within that, the
    wrapper's ``add_lora_linear`` calls (timed by wrapping them; an engine without these
    methods gives an empty table)."""
    if not all(hasattr(engine, name) for name in ("_prepare", "_prefill", "punica")):
        return {}
    spent = dict.fromkeys(BEFORE_PARTS, 0.0)
    inside = [False]  # within the prefill
    prepare, prefill = engine._prepare, engine._prefill
    lora = engine.punica.add_lora_linear

    def timed(part, fn, when=lambda: True):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if when():
                    spent[part] += time.perf_counter() - begin

        return call

    def prepared(ids, lengths, *, prefill):
        part = BEFORE_PARTS[0] if prefill else BEFORE_PARTS[3]
        return timed(part, prepare)(ids, lengths, prefill=prefill)

    def prefilled(*args, **kwargs):
        inside[0] = True
        try:
            return timed(BEFORE_PARTS[2], prefill)(*args, **kwargs)
        finally:
            inside[0] = False

    engine._prepare, engine._prefill = prepared, prefilled
    engine.punica.add_lora_linear = timed(BEFORE_PARTS[1], lora, when=lambda: inside[0])
    before = 0.0
    try:
        for _ in range(repeats):
            _sync(engine.device)
            clock = _Clock(1, new_tokens - 1, engine.device)
            begin = time.perf_counter()
            engine.generate(requests, new_tokens, on_step=clock)
            before += clock.starts[1] - begin
    finally:
        del engine._prepare, engine._prefill, engine.punica.add_lora_linear
    spent[BEFORE_PARTS[2]] -= spent[BEFORE_PARTS[1]]  # (the calls are within the prefill)
    # the decode metadata's time runs into step 1's start: what is not a part is the rest
    spent[BEFORE_PARTS[4]] = before - sum(spent[p] for p in BEFORE_PARTS[:4])
    return {part: 1e3 * seconds / repeats for part, seconds in spent.items()}


def profile_decode(
    engine, requests: Sequence, new_tokens: int, *, label: str = "engine", repeats: int = 1
) -> StepProfile:
    """Profile the engine's decode steps on ``requests`` (see the module docstring).

    Raises:
        ValueError: ``new_tokens < 3`` (no decode step would have a next one) or
            ``repeats < 1``.
    """
    if new_tokens < 3:
        raise ValueError(f"new_tokens must be >= 3 to time a decode step, got {new_tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = engine.device
    steps = (new_tokens - 2) * repeats
    _sync(device)
    step_s, before_s = _plain_seconds(engine, requests, new_tokens, repeats, eager=False)
    graphs = bool(getattr(engine, "use_cuda_graphs", False))
    eager_s = None
    if graphs:
        eager_s, _ = _plain_seconds(engine, requests, new_tokens, repeats, eager=True)

    probe = Probe()
    probed_s = 0.0
    with instrumented(engine, probe), _eager(engine, True):
        for _ in range(repeats):
            clock = _Clock(1, new_tokens - 1, device, on_window=_switch(probe))
            engine.generate(requests, new_tokens, on_step=clock)
            probed_s += clock.seconds
    parts = _host_parts(probe, probed_s, steps)

    device_step_ms, kernels, errors = None, [], []
    graph_step_ms, graph_kernels = None, []
    if device.type == "cuda":
        try:
            device_step_ms, kernels = _device_parts(engine, requests, new_tokens, parts)
        except Exception as err:  # the host's table still stands without the device's
            errors.append(f"eager: {type(err).__name__}: {err}")
            for row in parts:
                row.device_ms = row.device_share = row.launches = None
        if graphs:
            try:
                graph_step_ms, graph_kernels = _graph_kernels(engine, requests, new_tokens)
            except Exception as err:
                errors.append(f"graphs: {type(err).__name__}: {err}")
    before_parts = _before_parts(engine, requests, new_tokens, repeats)
    return StepProfile(
        label=label,
        steps=steps,
        batch=len(requests),
        step_ms=1e3 * step_s / steps,
        before_ms=1e3 * before_s / repeats,
        before_parts=before_parts,
        eager_step_ms=None if eager_s is None else 1e3 * eager_s / steps,
        probed_step_ms=1e3 * probed_s / steps,
        parts=parts,
        device_step_ms=device_step_ms,
        kernels=kernels,
        graph_device_step_ms=graph_step_ms,
        graph_kernels=graph_kernels,
        device_error="; ".join(errors) or None,
    )


def _switch(probe: Probe):
    """``on_window``: switch the probe on and off."""

    def switch(on: bool) -> None:
        probe.active = on

    return switch


def _host_parts(probe: Probe, window_s: float, steps: int) -> list[PartTime]:
    """The probe's parts (and the loop, the rest of the window) as ms per step."""
    parts = [p for p in PARTS if probe.calls.get(p)]
    inside = sum(probe.host[p] for p in parts)
    rows = [(p, probe.host[p]) for p in parts] + [(LOOP, max(window_s - inside, 0.0))]
    return [
        PartTime(part=p, host_ms=1e3 * s / steps, host_share=s / window_s if window_s else 0.0)
        for p, s in rows
    ]


def _device_parts(engine, requests, new_tokens: int, parts: list[PartTime]):
    """Fill each part's device ms and launches per step from one more ``generate`` under
    ``torch.profiler`` (started at the window's first step, stopped at its end, the
    device drained at both); return (kernel ms per step, the kernels by name)."""
    probe = Probe(ranges=True)
    steps = new_tokens - 2
    with instrumented(engine, probe), _eager(engine, True):
        events = _profiled(engine, requests, new_tokens, probe)
    times = exclusive_times(events)
    kernels = kernel_table(events)
    total_us = sum(us for _, us, _ in kernels)
    attributed = 0.0
    for row in parts:
        us, launches = times.get(row.part, (0.0, 0))
        attributed += us
        row.device_ms = us / 1e3 / steps
        row.device_share = us / total_us if total_us else 0.0
        row.launches = launches / steps
    loop = next(r for r in parts if r.part == LOOP)
    loop.device_ms = max(total_us - attributed, 0.0) / 1e3 / steps
    loop.device_share = loop.device_ms * 1e3 * steps / total_us if total_us else 0.0
    return total_us / 1e3 / steps, _per_step(kernels, steps)


def _graph_kernels(engine, requests, new_tokens: int):
    """The kernels of the replayed decode graphs, from one ``generate`` under
    ``torch.profiler``: (their ms per step, the kernels by name)."""
    steps = new_tokens - 2
    kernels = kernel_table(_profiled(engine, requests, new_tokens, None))
    return sum(us for _, us, _ in kernels) / 1e3 / steps, _per_step(kernels, steps)


def one_cycle_profiler(activities) -> torch.profiler.profile:
    """A ``torch.profiler.profile`` over ``activities`` for one start-to-stop cycle.

    It keeps its events across cycles (``acc_events=True``) where this torch can: with
    one cycle that keeps the same events, and some torch versions (2.11) warn at the
    first start of a profiler that does not, a warning the test suite treats as an error.
    """
    from torch.profiler import profile

    keep = "acc_events" in inspect.signature(profile).parameters
    return profile(activities=activities, **({"acc_events": True} if keep else {}))


def _profiled(engine, requests, new_tokens: int, probe: Probe | None):
    """``torch.profiler``'s events of decode steps ``1 .. n-2`` of one ``generate`` (the
    profiler runs from the window's start to its end; the probe, if any, is active then)."""
    from torch.profiler import ProfilerActivity

    prof = one_cycle_profiler([ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def window(on: bool) -> None:
        if probe is not None:
            probe.active = on
        if on:
            prof.start()
        else:
            prof.stop()

    engine.generate(requests, new_tokens, on_step=_Clock(1, new_tokens - 1, engine.device, window))
    return prof.events()


def _per_step(kernels, steps: int) -> list[dict]:
    return [
        {"kernel": name, "device_ms_per_step": us / 1e3 / steps, "launches_per_step": n / steps}
        for name, us, n in kernels
    ]


# -- printing ---------------------------------------------------------------------------


def print_profile(profile: StepProfile, rows: int = 12) -> None:
    """The profile as text tables."""
    from .demo import _print_table

    print(
        f"\nDecode step of the {profile.label} ({profile.batch} requests, "
        f"{profile.steps} steps measured)"
    )
    print(f"  as served: {profile.step_ms:.3f} ms/step")
    print(
        f"  before decode step 1 (metadata, prefill, the batch's set-up): "
        f"{profile.before_ms:.3f} ms per generate"
    )
    if profile.before_parts:
        print(
            f"    in a run with its parts timed: {sum(profile.before_parts.values()):.3f} ms "
            "per generate, of which (host time)"
        )
        for part, ms in profile.before_parts.items():
            print(f"      {part}: {ms:.3f} ms")
    if profile.eager_step_ms is not None:
        print(f"  eagerly (no CUDA graphs): {profile.eager_step_ms:.3f} ms/step")
    print(f"  with a probe on every part (eager): {profile.probed_step_ms:.3f} ms/step")
    if profile.device_step_ms is not None:
        print(
            f"  kernels' device time, eager (torch.profiler): {profile.device_step_ms:.3f} ms/step"
        )
    if profile.graph_device_step_ms is not None:
        print(
            f"  kernels' device time, replayed graphs (torch.profiler): "
            f"{profile.graph_device_step_ms:.3f} ms/step"
        )
    if profile.device_error:
        print(f"  device time not measured: {profile.device_error}")
    device = profile.device_step_ms is not None
    headers = ["part", "host ms/step", "host share"]
    if device:
        headers += ["device ms/step", "device share", "launches/step"]
    table = []
    for p in profile.parts:
        row = [p.part, f"{p.host_ms:.4f}", f"{100 * p.host_share:.1f}%"]
        if device:
            launches = "" if p.part == LOOP else f"{p.launches:.1f}"
            row += [f"{p.device_ms:.4f}", f"{100 * p.device_share:.1f}%", launches]
        table.append(row)
    _print_table(headers, table)
    for title, kernels in (
        ("eager decode steps", profile.kernels),
        ("replayed CUDA graphs", profile.graph_kernels),
    ):
        if kernels:
            print(f"\n  Kernels by device time, {title} (per decode step)")
            kernel_rows = [
                (
                    k["kernel"][:60],
                    f"{k['device_ms_per_step']:.4f}",
                    f"{k['launches_per_step']:.1f}",
                )
                for k in kernels
            ]
            _print_table(["kernel", "device ms/step", "launches/step"], kernel_rows, rows)
    if SIMULATOR:
        print(
            "  (on the simulator every CUDA thread is a Python thread: these times say "
            "nothing about a GPU)"
        )


def write_json(path, profiles: Sequence[StepProfile], config: dict) -> None:
    """``{"config": ..., "profiles": [...]}`` to ``path``."""
    with open(path, "w") as file:
        json.dump({"config": config, "profiles": [p.to_json() for p in profiles]}, file, indent=2)
