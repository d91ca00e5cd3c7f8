"""Fresh weights and metadata just before every call: the ops read what was just written.

A serving engine rewrites a slot's weights when it loads an adapter, and the metadata every
step. Here, before *every* shrink, expand or ``add_lora_linear``, a writer rewrites the
weights (A and B, every slot, new random values each iteration) and the metadata (the live
``LoRAKernelMeta``'s buffers, alternating between two prepared mappings of the same token
and slot counts, and its host facts), and each result is checked against the float64
reference computed from the new values. A stale read of either shows: last iteration's B
gives other products, last iteration's table other tokens or none.

The writer is the kernel just ahead of the op on the stream (:mod:`tests.fresh_writer`):
torch's ordinary copies, or a Numba kernel of our own that says ``launch_dependents`` as its
first statement and then, slowly, writes. The second is what a kernel that reads before its
``griddepcontrol.wait`` cannot survive: the tensor-core expand that asks ahead
(``punica_numba.kernels.expand_mma``, "Asking ahead", "B before the wait"). The bare
``lora_expand`` builds it to only ask L2 for lines before its wait (nothing read there reaches
a result); ``add_lora_linear``'s expand, launched just behind the wrapper's own shrink (which
waits for the writer before it ends), also loads its rows of B and leaves an empty tile there.
Which build ran is read from its PTX (:func:`expand_build`) and checked.

These tests can fail on the GPU, and did: at 9807a63, before 4f176bc made B before the wait
the wrapper's alone, the bare expand loaded B before its wait, and with the early writer
(then spinning 200,000 cycles) 12 of 60 eager and 60 of 62 graph iterations of r=64 at 256
tokens over 16 LoRAs were wrong (up to 208 times the bound), 60 of 62 graph ones at r=16,
41 of 60 eager and 61 of 62 graph ones at r=64, 64 over 8; torch's copies and the slow
control, 0 of each. After it, the probe's "promise broken" rows (the bare r=64 expand built
with B before the wait, behind the early writer spinning 2 ms) are wrong in 100 of 100 eager
and 102 of 102 graph iterations, and right in every one behind torch's copies or the slow
writer; every scenario here is right in every iteration (H200, 100-150 of each).

Each scenario runs eagerly and inside a captured CUDA graph (the writer and the op captured
once, new source values written before each replay), over many iterations. Scenarios: the
bare ops (``lora_shrink`` / ``lora_expand`` with ``LoRAKernelMeta.meta_args``) and the
wrapper's ``add_lora_linear`` (metadata from ``update_metadata`` with a ``LoRAMapping``), at
rank 16 and 64, on shapes that take the asking build (one slice of 4096 columns, 256 tokens
over 16 LoRAs, or 64 over 8) and on the QKV layer's three slices, which do not.

Sections:

1. the harness: scenarios, their tensors, writers, a run of iterations, the check;
2. on any machine (tiny on the simulator): the writer copies, every scenario's setup and
   check pass with both writers eagerly, and the check catches a stale B, a stale A and
   stale metadata (the tests can fail);
3. on the GPU: every scenario x writer x eager/graph, each iteration checked, and which
   expand build ran. ``tests/fresh_weights_probe.py`` runs the same for longer and prints
   how often each goes wrong.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import punica_numba
from punica_numba import LoRAKernelMeta, LoRAMapping, PunicaWrapperNumba, _cuda, reference

from .fresh_writer import WRITER_BLOCKS, WRITER_THREADS, NumbaWriter, torch_writer, writer_kernel
from .tolerance import error_bound

SIMULATOR = _cuda.SIMULATOR
DEVICE = _cuda.device_of()

# -- 1. the harness -----------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One layer call, and the two mappings its metadata alternates between."""

    name: str
    op: str  # "shrink", "expand" (the bare ops) or "linear" (the wrapper's add_lora_linear)
    tokens: int  # T: rows of the activations, every one of them mapped
    active: int  # slots in use in each mapping (the same number in both)
    slots: int  # L: slots each weight stack holds (>= 2: not the one-slot path)
    rank: int
    widths: tuple[int, ...]  # the layer's output slices (a shrink uses only how many)
    hidden: int = 0  # H (shrink, linear)
    no_lora: int = 0  # tokens without a LoRA (-1) in each mapping
    build: str | None = None  # GPU: the tensor-core expand build it takes (expand_build)

    @property
    def slices(self) -> int:
        return len(self.widths)


QKV = (4096, 1024, 1024)  # a GQA attention layer's three slices

#: The H200's scenarios: 256 tokens over 16 of 20 slots (16 tokens per active slot on
#: average, at least 7 each, and 16 tokens without a LoRA), or 64 over 8 of 10 (8 on
#: average, at least 4): enough per slot for the tensor cores. One slice of 4096 columns
#: takes an asking build: the bare expand the one that only asks L2 before its wait
#: ("asks"), add_lora_linear's expand, just behind its own shrink, the one that also loads
#: B there ("asks+B"); three slices take neither ("plain").
GPU_SCENARIOS = (
    Scenario("shrink-qkv-r16", "shrink", 256, 16, 20, 16, QKV, hidden=4096, no_lora=16),
    Scenario("shrink-r64", "shrink", 256, 16, 20, 64, (4096,), hidden=4096, no_lora=16),
    Scenario("expand-r64-256/16", "expand", 256, 16, 20, 64, (4096,), no_lora=16, build="asks"),
    Scenario("expand-r16-256/16", "expand", 256, 16, 20, 16, (4096,), no_lora=16, build="asks"),
    Scenario("expand-r64-64/8", "expand", 64, 8, 10, 64, (4096,), build="asks"),
    Scenario("expand-qkv-r16", "expand", 256, 16, 20, 16, QKV, no_lora=16, build="plain"),
    Scenario("expand-qkv-r64", "expand", 256, 16, 20, 64, QKV, no_lora=16, build="plain"),
    Scenario("linear-r64", "linear", 256, 16, 20, 64, (4096,), 4096, 16, build="asks+B"),
    Scenario("linear-r16", "linear", 256, 16, 20, 16, (4096,), 4096, 16, build="asks+B"),
    Scenario("linear-r64-64/8", "linear", 64, 8, 10, 64, (4096,), 4096, build="asks+B"),
    Scenario("linear-qkv-r16", "linear", 256, 16, 20, 16, QKV, 4096, 16, build="plain"),
)

#: The simulator's: the same calls at a few hundred simulated threads a launch.
SIM_SCENARIOS = (
    Scenario("shrink-3", "shrink", 10, 3, 4, 4, (8, 4, 4), hidden=16, no_lora=2),
    Scenario("expand-1", "expand", 10, 3, 4, 4, (8,), no_lora=2),
    Scenario("expand-3", "expand", 10, 3, 4, 4, (8, 4, 4), no_lora=2),
    Scenario("linear-3", "linear", 10, 3, 4, 4, (8, 4, 4), hidden=16, no_lora=2),
)

SCALE = 0.5
#: The host-side facts of a LoRAKernelMeta the ops read to choose a kernel and check a
#: call: copied on the host with the device buffers (the same in both mappings).
HOST_FACTS = ("num_tokens", "max_slot_in_use", "active_slots")
#: The metadata tensors of vLLM's six that live on the device.
META_TENSORS = (
    "token_lora_mapping",
    "token_indices_sorted_by_lora_ids",
    "num_tokens_per_lora",
    "lora_token_start_loc",
    "active_lora_ids",
)
#: Eager calls before a capture (the first compiles and launches the ordinary way).
WARM_UPS = 2
#: (blocks, threads) of the Numba writers: few blocks on the GPU (fresh_writer), and a
#: few dozen simulated threads on the simulator.
WRITER_GRID = (2, 32) if SIMULATOR else (WRITER_BLOCKS, WRITER_THREADS)
#: The writers, by name: torch's copies, ours saying launch_dependents first, and ours
#: without it (as slow, a control for the probe).
WRITERS = {
    "torch": torch_writer,
    "early": NumbaWriter(True, *WRITER_GRID),
    "slow": NumbaWriter(False, *WRITER_GRID),
}
MODES = ("eager", "graph")


def two_mappings(sc: Scenario, seed: int) -> tuple[list[int], list[int]]:
    """Two different token -> slot lists with the same host facts: T tokens, ``active``
    slots in use (the largest slot, L - 1, in both; the others drawn), each with at least
    half the average tokens, and ``no_lora`` tokens at -1, in a random order."""
    rng = np.random.default_rng(seed)
    with_lora = sc.tokens - sc.no_lora
    least = max(1, with_lora // sc.active // 2)
    mappings = []
    for _ in range(2):
        used = [*rng.choice(sc.slots - 1, sc.active - 1, replace=False).tolist(), sc.slots - 1]
        counts = least + rng.multinomial(with_lora - least * sc.active, [1 / sc.active] * sc.active)
        slots = np.repeat([*used, -1], [*counts.tolist(), sc.no_lora])  # [T]
        mappings.append([int(s) for s in rng.permutation(slots)])
    assert mappings[0] != mappings[1]
    return mappings[0], mappings[1]


def meta_buffers(meta: LoRAKernelMeta) -> list[tuple[str, torch.Tensor]]:
    """Every device buffer of ``meta`` a kernel may read, named: vLLM's five device tensors,
    then each tile table and each tile's tokens (``meta.host``)."""
    named = [(name, getattr(meta, name)) for name in META_TENSORS]
    named += [(f"tile_tables[{m}]", t) for m, t in sorted(meta.host.tile_tables.items())]
    named += [(f"tile_tokens[{m}]", t) for m, t in sorted(meta.host.tile_tokens.items())]
    return named


def prepared_meta(sc: Scenario, slots: list[int]) -> LoRAKernelMeta:
    meta = LoRAKernelMeta.make(sc.slots, sc.tokens, DEVICE)
    meta.prepare_tensors(torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    return meta


def prepared_wrapper(sc: Scenario, slots: list[int]) -> PunicaWrapperNumba:
    """A wrapper after ``update_metadata`` with a LoRAMapping whose tokens sit in ``slots``
    (every slot holds an adapter, ids 101...; id 0 for no LoRA)."""
    ids = [101 + s for s in range(sc.slots)]
    token_ids = tuple(ids[s] if s >= 0 else 0 for s in slots)
    wrapper = PunicaWrapperNumba(sc.tokens, sc.tokens, DEVICE, max_loras=sc.slots)
    mapping = LoRAMapping(index_mapping=token_ids, prompt_mapping=token_ids, is_prefill=True)
    wrapper.update_metadata(mapping, ids, sc.slots + 1, 32000, 256)
    assert wrapper.token_lora_indices.tolist() == slots
    return wrapper


@dataclass
class Target:
    """A tensor the op reads (``live``) and the one the writer copies into it (``staging``)."""

    label: str  # "A[0]", "B[2]", "meta.tile_tables[16]", ...
    live: torch.Tensor
    staging: torch.Tensor


class Rig:
    """One scenario's tensors: the live weights, metadata, activations and output the op
    reads and writes, their staging twins, and the two mappings' prepared metadata.

    An iteration: :meth:`refresh` (new values into the staging tensors, the activations and
    the old output; host facts), then :meth:`reset` (the output to its old values), the
    writer (staging -> live), :meth:`call` (the op); then :meth:`check`.
    """

    def __init__(self, sc: Scenario, seed: int = 0):
        self.sc = sc
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.mappings = two_mappings(sc, seed)
        T, L, r, H, S = sc.tokens, sc.slots, sc.rank, sc.hidden, sc.slices
        if sc.op == "linear":
            self.wrapper = prepared_wrapper(sc, self.mappings[0])
            self.meta = self.wrapper.token_mapping_meta
            sources = [prepared_wrapper(sc, m).token_mapping_meta for m in self.mappings]
        else:
            self.meta = prepared_meta(sc, self.mappings[0])  # the live metadata
            sources = [prepared_meta(sc, m) for m in self.mappings]
        self.sources = sources
        self.source_buffers = [dict(meta_buffers(s)) for s in sources]
        for fact in HOST_FACTS:  # so the kernels chosen are the same for both
            assert getattr(sources[0].host, fact) == getattr(sources[1].host, fact), fact
        self.meta_args = self.meta.meta_args(T)  # views of the live buffers, made once
        lead = (L, 1) if sc.op == "linear" else (L,)  # vLLM's [L, 1, N, K] in the wrapper
        bf16 = torch.bfloat16
        self.a = [self.random((*lead, r, H), bf16) for _ in range(S)] if H else []
        self.b = [self.random((*lead, n, r), bf16) for n in sc.widths] if sc.op != "shrink" else []
        if sc.op == "shrink":
            self.x = self.random((T, H), bf16)  # [T, H]
            self.out = torch.empty(S, T, r, dtype=torch.float32, device=DEVICE)  # [S, T, r]
        else:
            # expand: the fp32 shrink buffer [S, T, r]; linear: the activations [T, H]
            shape = (S, T, r) if sc.op == "expand" else (T, H)
            self.x = self.random(shape, torch.float32 if sc.op == "expand" else bf16)
            self.out = torch.empty(T, sum(sc.widths), dtype=bf16, device=DEVICE)  # [T, W]
        self.before = self.random(self.out.shape, self.out.dtype)  # the old output
        self.targets = [Target(f"A[{s}]", a, torch.empty_like(a)) for s, a in enumerate(self.a)]
        self.targets += [Target(f"B[{s}]", b, torch.empty_like(b)) for s, b in enumerate(self.b)]
        self.targets += [
            Target(f"meta.{name}", t, torch.empty_like(t)) for name, t in meta_buffers(self.meta)
        ]

    def random(self, shape, dtype) -> torch.Tensor:
        values = torch.randn(*shape, generator=self.gen, dtype=torch.float32, device=DEVICE)
        return values.to(dtype)

    def pairs(self, skip: tuple[str, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(live, staging)`` of every target whose label starts with none of ``skip``."""
        return [(t.live, t.staging) for t in self.targets if not t.label.startswith(skip)]

    def refresh(self, iteration: int) -> torch.Tensor:
        """New values for ``iteration``: random weights, the metadata of mapping
        ``(iteration + 1) % 2`` (the live metadata starts as mapping 0, so the first
        iteration changes it) in the staging tensors; the host facts of that mapping
        (on the host, the same in both); new activations and old output. Returns that
        mapping's slots, for the reference."""
        state = (iteration + 1) % 2
        source = self.sources[state]
        for target in self.targets:
            if target.label.startswith("meta."):
                target.staging.copy_(self.source_buffers[state][target.label[5:]])
            else:
                target.staging.copy_(self.random(target.staging.shape, target.staging.dtype))
        for fact in HOST_FACTS:
            setattr(self.meta.host, fact, getattr(source.host, fact))
        self.meta.no_lora_flag_cpu.copy_(source.no_lora_flag_cpu)
        self.x.copy_(self.random(self.x.shape, self.x.dtype))
        self.before.copy_(self.random(self.before.shape, self.before.dtype))
        return torch.tensor(self.mappings[state], dtype=torch.int64, device=DEVICE)

    def reset(self) -> None:
        """The output back to its old values (before the writer, so that the writer is
        the kernel just ahead of the op)."""
        self.out.copy_(self.before)

    def call(self) -> None:
        """The op, on the live tensors."""
        sc = self.sc
        if sc.op == "shrink":
            punica_numba.lora_shrink(self.x, self.a, self.out, *self.meta_args, SCALE)
        elif sc.op == "expand":
            punica_numba.lora_expand(
                self.x, self.b, self.out, *self.meta_args, offset_start=0, add_inputs=True
            )
        else:
            self.wrapper.add_lora_linear(self.out, self.x, self.a, self.b, None, SCALE, sc.widths)

    def reference(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(want, magnitude, terms)`` in float64, from the new (staging) weights."""
        sc = self.sc
        a = [t.staging for t in self.targets if t.label.startswith("A")]
        b = [t.staging for t in self.targets if t.label.startswith("B")]
        x, before = self.x, self.before
        absolute = [t.abs() for t in a], [t.abs() for t in b]
        if sc.op == "shrink":
            want = reference.lora_shrink(x, a, before, slots, SCALE)
            magnitude = reference.lora_shrink(x.abs(), absolute[0], before.abs(), slots, SCALE)
            return want, magnitude, sc.hidden
        if sc.op == "expand":
            want = reference.lora_expand(x, b, before, slots, 0, add_inputs=True)
            magnitude = reference.lora_expand(x.abs(), absolute[1], before.abs(), slots, 0, True)
            return want, magnitude, sc.rank
        want = reference.add_lora_linear(before, x, a, b, None, SCALE, sc.widths, slots)
        magnitude = reference.add_lora_linear(
            before.abs(), x.abs(), *absolute, None, SCALE, sc.widths, slots
        )
        return want, magnitude, sc.hidden + sc.rank

    def check(self, iteration: int, mode: str, slots: torch.Tensor, pairs) -> Outcome:
        """Compare the output with the reference: within tests/tolerance's bound where the
        op writes, bit for bit in the rows of tokens without a LoRA."""
        want, magnitude, terms = self.reference(slots)
        got = self.out
        err = (got.to(torch.float64) - want).abs()
        bound = error_bound(magnitude, terms, got.dtype)
        bad = (err > bound) | torch.isnan(err)
        untouched = slots == -1  # [T]
        if self.sc.op == "shrink":  # [S, T, r]
            bad[:, untouched] |= got[:, untouched] != self.before[:, untouched]
        else:  # [T, W]
            bad[untouched] |= got[untouched] != self.before[untouched]
        wrong = int(bad.sum())
        first = ""
        if wrong:
            index = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
            first = (
                f"first at {index}: got {got[index].item()!r}, want {want[index].item()!r} "
                f"(bound {bound[index].item():.3g})"
            )
        return Outcome(
            iteration=iteration,
            mode=mode,
            wrong=wrong,
            elements=bad.numel(),
            max_error=float(err.max()),
            worst=float((err / bound).max()),
            written=all(torch.equal(live, staging) for live, staging in pairs),
            first=first,
        )


@dataclass
class Outcome:
    """One iteration's check."""

    iteration: int
    mode: str  # "eager", "eager warm-up" (before a capture) or "graph"
    wrong: int  # elements out of tolerance, or changed where they must not
    elements: int
    max_error: float  # the largest |got - want|
    worst: float  # the largest |got - want| / bound (<= 1: within tolerance)
    written: bool  # every live tensor the writer was given held its new value afterwards
    first: str  # the first wrong element ("" when none)

    @property
    def ok(self) -> bool:
        return self.wrong == 0

    def describe(self) -> str:
        return (
            f"iteration {self.iteration} ({self.mode}): {self.wrong} of {self.elements} "
            f"elements wrong, max error {self.max_error:.4g} ({self.worst:.3g} x the bound); "
            f"{self.first}; writer wrote everything: {self.written}"
        )


@dataclass
class Run:
    """The outcomes of a run, and (GPU) the tensor-core expand build it launched."""

    outcomes: list[Outcome]
    build: str | None


def synchronize() -> None:
    if not SIMULATOR:
        torch.cuda.synchronize()


@contextlib.contextmanager
def launchers_used():
    """Within it, every KernelLauncher that launches is noted in the list it gives."""
    used, call = [], _cuda.KernelLauncher.__call__

    def noted(self, grid, block, args):
        used.append(self)
        return call(self, grid, block, args)

    _cuda.KernelLauncher.__call__ = noted
    try:
        yield used
    finally:
        _cuda.KernelLauncher.__call__ = call


#: A PTX load of 64-bit words through a global or generic address (``ld.u64``,
#: ``ld.v2.u64``, ``ld.global.u64`` ...). Before its wait, only the tensor-core expand's
#: words of B are such: its table rows, tile tokens and L2 asks are 32-bit loads
#: (``ld.global.v4.u32``, ``ld.global.s32``) and prefetches.
_WORD_LOAD = re.compile(r"^\s*ld(?!\.(param|local|shared))\S*\.(u64|b64|s64)\s")


def expand_build(launchers) -> str | None:
    """Which tensor-core expand these launchers ran, read from its PTX: ``"asks+B"`` (says
    ``launch_dependents`` and loads B before its ``griddepcontrol.wait``), ``"asks"``
    (says it, and before the wait only reads its table row and tokens and asks L2),
    ``"plain"`` (another build: it waits first), or None: no tensor-core expand, or the
    simulator (no PTX)."""
    if SIMULATOR:
        return None
    capability = torch.cuda.get_device_capability()
    build = None
    for launcher in {id(x): x for x in launchers}.values():
        if not launcher.dispatcher.py_func.__module__.endswith("expand_mma"):
            continue
        for kernel in launcher.kernels.values():
            ptx = kernel.inspect_asm(capability)
            if "griddepcontrol.launch_dependents" not in ptx:
                build = build or "plain"
                continue
            body = ptx[ptx.index(".entry") :]
            early = body[: body.index("griddepcontrol.wait;")].splitlines()
            return "asks+B" if any(_WORD_LOAD.match(line) for line in early) else "asks"
    return build


def run(rig: Rig, writer: str, mode: str, iterations: int, skip: tuple[str, ...] = ()) -> Run:
    """``iterations`` checked iterations of ``rig``'s call, each after ``writer`` rewrote
    every target (but those whose label starts with one of ``skip``: a deliberately stale
    tensor), eagerly or as replays of a CUDA graph of (reset, writer, op) captured after
    :data:`WARM_UPS` eager iterations (which are checked too)."""
    write, pairs = WRITERS[writer], rig.pairs(skip)
    outcomes, build = [], None

    def one_call() -> None:
        rig.reset()
        write(pairs)  # just ahead of the op's first kernel
        rig.call()

    def iterate(iteration: int, label: str, body) -> None:
        slots = rig.refresh(iteration)
        body()
        synchronize()
        outcomes.append(rig.check(iteration, label, slots, pairs))

    eager = iterations if mode == "eager" else WARM_UPS
    for i in range(eager):
        if i == 0:  # which kernels the call launches (later eager calls may replay them)
            with launchers_used() as used:
                iterate(i, "eager" if mode == "eager" else "eager warm-up", one_call)
            build = expand_build(used)
        else:
            iterate(i, "eager" if mode == "eager" else "eager warm-up", one_call)
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_call()
        for i in range(iterations):
            iterate(WARM_UPS + i, "graph", graph.replay)
        synchronize()
        del graph
    return Run(outcomes, build)


def assert_every_result_right(result: Run, sc: Scenario, writer: str, mode: str) -> None:
    wrong = [o for o in result.outcomes if not o.ok]
    assert not wrong, (
        f"{sc.name} ({sc.op}), writer {writer!r}, {mode}: {len(wrong)} of "
        f"{len(result.outcomes)} iterations wrong; max error "
        f"{max(o.max_error for o in wrong):.4g}; first: {wrong[0].describe()}"
    )


# -- 2. on any machine --------------------------------------------------------------------


def test_the_writer_copies_every_pair():
    """Both Numba writers copy each pair whole (bf16, int32 and int64 buffers of odd
    sizes), and leave everything else alone."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    shapes = [((3, 5, 6), torch.bfloat16), ((37,), torch.int32), ((2, 9), torch.int64)]
    for early in (True, False):
        dsts = [torch.zeros(s, dtype=d, device=DEVICE) for s, d in shapes]
        srcs = [
            torch.randint(-1000, 1000, s, generator=gen, device=DEVICE).to(d) for s, d in shapes
        ]
        spare = torch.zeros(7, dtype=torch.int32, device=DEVICE)
        NumbaWriter(early, *WRITER_GRID)(list(zip(dsts, srcs)))
        synchronize()
        for dst, src in zip(dsts, srcs):
            assert torch.equal(dst, src)
        assert not spare.any()


@pytest.mark.parametrize("writer", ("torch", "early"))
@pytest.mark.parametrize("sc", SIM_SCENARIOS, ids=lambda sc: sc.name)
def test_fresh_values_every_call_eagerly(sc, writer):
    """Every small scenario's setup, writer and check, on any machine (on the simulator the
    early writer is a plain copy, with no launch to overlap): three iterations, on the
    second mapping, the first, the second; each right."""
    rig = Rig(sc, seed=1)
    result = run(rig, writer, "eager", 3)
    assert_every_result_right(result, sc, writer, "eager")
    assert all(o.written for o in result.outcomes)


@pytest.mark.parametrize(
    "sc, skip",
    [
        (SIM_SCENARIOS[1], ("B",)),  # the expand reads last iteration's B
        (SIM_SCENARIOS[0], ("A",)),  # the shrink reads last iteration's A
        (SIM_SCENARIOS[3], ("B",)),
        (SIM_SCENARIOS[2], ("meta.",)),  # the expand reads the other mapping's metadata
    ],
    ids=("expand-stale-B", "shrink-stale-A", "linear-stale-B", "expand-stale-metadata"),
)
def test_the_check_catches_a_stale_tensor(sc, skip):
    """The tests can fail: with one kind of tensor left unwritten (as a read before the
    writer's write would see it), the check reports wrong results and says where. Stale
    weights are wrong every iteration (each has new ones); stale metadata in the iterations
    whose mapping is not the one the live metadata still holds (the first, the third)."""
    rig = Rig(sc, seed=2)
    outcomes = run(rig, "early", "eager", 3, skip=skip).outcomes
    wrong = [o.iteration for o in outcomes if not o.ok]
    assert wrong == ([0, 2] if skip == ("meta.",) else [0, 1, 2]), wrong
    assert "first at" in outcomes[0].first and outcomes[0].max_error > 0
    with pytest.raises(AssertionError, match=r"iteration 0 \(eager\).*max error"):
        assert_every_result_right(Run(outcomes, None), sc, "early", "eager")


# -- 3. on the GPU ------------------------------------------------------------------------

#: Checked iterations per scenario, writer and mode (tests/fresh_weights_probe.py runs more).
ITERATIONS = 64


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("writer", ("torch", "early"))
@pytest.mark.parametrize("sc", GPU_SCENARIOS, ids=lambda sc: sc.name)
def test_fresh_weights_and_metadata_before_every_call(sc, writer, mode):
    """Weights and metadata rewritten just before every call, by torch's copies or by our
    kernel that lets the op start early; every result right, eagerly and in a graph; and
    the tensor-core expand build the scenario names ran (one that asks ahead, and loads B
    before its wait or not, or neither)."""
    rig = Rig(sc, seed=4)
    result = run(rig, writer, mode, ITERATIONS)
    if sc.build is not None and punica_numba.dependent_launch():
        assert result.build == sc.build, f"{sc.name}: ran {result.build!r}, not {sc.build!r}"
    assert_every_result_right(result, sc, writer, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_the_check_catches_a_stale_b_on_the_gpu(mode):
    """The GPU run can fail too: the asking expand with B left unwritten is wrong in every
    iteration, eagerly and in a graph."""
    sc = GPU_SCENARIOS[2]
    outcomes = run(Rig(sc, seed=5), "torch", mode, 4, skip=("B",)).outcomes
    assert all(not o.ok for o in outcomes), [o.describe() for o in outcomes]


#: A PTX line that touches memory other kernels see (as tests/test_dependent_launch.py
#: reads PTX): global or generic loads, stores, atomics, copies and prefetches.
_MEMORY = re.compile(r"^\s*(ld|st|atom|red|cp|prefetch)\.(?!param|local|shared)")


def first_lines(ptx: str, *wanted: str) -> list[int]:
    """The line number, from the kernel's ``.entry``, of the first line that says each of
    ``wanted`` (``"memory"``: the first that touches memory); -1 where none does."""
    lines = ptx[ptx.index(".entry") :].splitlines()
    found = []
    for what in wanted:
        hits = [
            i
            for i, line in enumerate(lines)
            if (_MEMORY.match(line) if what == "memory" else what in line)
        ]
        found.append(hits[0] if hits else -1)
    return found


@pytest.mark.gpu
def test_the_early_writer_lets_the_next_kernel_start_first():
    """In its PTX the early writer says launch_dependents before it touches memory; the
    slow control does not say it at all."""
    test_the_writer_copies_every_pair()  # (compiles both)
    early = next(iter(writer_kernel(True).inspect_asm().values()))
    slow = next(iter(writer_kernel(False).inspect_asm().values()))
    said, touched = first_lines(early, "griddepcontrol.launch_dependents", "memory")
    assert 0 <= said < touched, (said, touched)
    assert "griddepcontrol" not in slow
    assert first_lines(slow, "%globaltimer")[0] >= 0  # (it spins all the same)
