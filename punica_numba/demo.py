"""The multi-tenant demo: many PEFT adapters, one batch, every request checked against PEFT.

A serving engine batches requests from many users at once, and each request may
ask for its own LoRA adapter (or none). This demo serves such a batch end to end:

1. **Model.** A small Llama (``LlamaForCausalLM`` built from a config, random
   weights, grouped-query attention); nothing is downloaded.
2. **Adapters.** PEFT creates N LoRA adapters on it (mixed ranks, different
   target modules, one in three with rsLoRA, random non-zero weights) and saves
   them to a temporary folder with ``save_pretrained``.
3. **Slots.** :mod:`punica_numba.peft` loads each adapter from disk into a GPU
   slot of the engine, in a shuffled order (``lora_index_to_id``), padding ranks
   and folding each adapter's scaling into B.
4. **Batch.** Requests with mixed adapters (``0`` = none) go through
   :class:`~punica_numba.engine.MultiLoRAEngine`: one prefill of every prompt, then
   decode steps of the whole batch over a KV cache (CUDA graphs on a GPU), every
   LoRA layer of the whole batch in one wrapper call. The prefill's token -> LoRA
   segments are printed.
5. **Check.** PEFT's own mixed-batch forward (``adapter_names=[...]``,
   ``"__base__"`` for none) on each request's tokens gives the logits the engine
   must reproduce; the demo prints each request's largest error.
6. **Throughput.** The engine on the batch and on the same prompts without adapters
   (its base path: LoRA's cost inside one engine, per whole ``generate`` and per
   decode step), PEFT's mixed-batch ``generate`` and the plain model's ``generate``.
   With ``--plot PATH`` (or ``--sweep``) the engine is also timed with 1, 4, 16 and
   64 distinct adapters in the batch, and tokens/s is drawn against that number.
   ``--json PATH`` writes every number measured.

Run it with ``python -m punica_numba demo`` (or ``make demo``); ``--profile`` times
the parts of a decode step instead (:mod:`punica_numba.profile`). The default sizes
are tiny on Numba's CUDA simulator (where every CUDA thread is a Python thread, so
the throughput there says nothing about a GPU) and realistic on a GPU. Exit code 0
means every request agreed with PEFT, 1 that one did not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ._cuda import SIMULATOR, device_of
from .engine import LORA_MODULES, Generation, MultiLoRAEngine, Request, tiny_llama

__all__ = ["AdapterSpec", "DEFAULTS", "Defaults", "main"]


@dataclass(frozen=True)
class Defaults:
    """Default sizes of the demo on one kind of machine."""

    requests: int
    adapters: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_rank: int
    max_prompt: int  # a request's prompt has 1 .. max_prompt tokens
    new_tokens: int
    dtype: torch.dtype


#: The simulator runs each CUDA thread as a Python thread: keep it tiny there.
DEFAULTS = {
    True: Defaults(
        requests=8,
        adapters=4,
        hidden=32,
        intermediate=64,
        layers=2,
        heads=4,
        kv_heads=2,
        vocab=128,
        max_rank=8,
        max_prompt=5,
        new_tokens=4,
        dtype=torch.float32,
    ),
    False: Defaults(
        requests=64,
        adapters=64,
        hidden=2048,
        intermediate=5632,
        layers=4,
        heads=16,
        kv_heads=4,
        vocab=32000,
        max_rank=16,
        max_prompt=64,
        new_tokens=32,
        dtype=torch.bfloat16,
    ),
}

#: How a request's logits are checked. "Exact" is PEFT's forward in float32 on the
#: same (rounded) weights. In float32 the engine must match it to REL_FLOOR of the
#: largest logit (the two differ only in summation order, ~1e-6). In bf16 or fp16
#: every activation is rounded, and two correct implementations drift apart through
#: the layers by a few percent, so the engine may err by at most NOISE_FACTOR times
#: as much as PEFT's own forward in that dtype does (plus the floor). On a hidden-2048,
#: 4-layer model with 64 adapters in bf16 (run on a CPU, the kernels' single rounding
#: emulated), that ratio ran from 0.6 to 1.6 over 64 requests, while leaving a
#: request's adapter out made it err 25 to 90 times as much as PEFT.
REL_FLOOR = 1e-4
NOISE_FACTOR = 3.0


@dataclass(frozen=True)
class Agreement:
    """How closely one request's engine logits match PEFT's."""

    engine_err: float  # max |engine - exact|
    peft_err: float  # max |PEFT in the engine's dtype - exact| (0 in float32)
    scale: float  # max |exact|

    @property
    def bound(self) -> float:
        return NOISE_FACTOR * self.peft_err + REL_FLOOR * self.scale

    @property
    def agrees(self) -> bool:
        return self.engine_err <= self.bound


def agreement(got: torch.Tensor, peft: torch.Tensor, exact: torch.Tensor) -> Agreement:
    """Compare ``[steps, V]`` logits: the engine's, PEFT's (same dtype) and exact (float32)."""
    return Agreement(
        engine_err=(got.float() - exact).abs().max().item(),
        peft_err=(peft.float() - exact).abs().max().item(),
        scale=exact.abs().max().item(),
    )


#: Adapter ids are user-visible and need not be small; these make ids and slots
#: look different in the tables.
FIRST_ADAPTER_ID = 101

#: Which projections each adapter adapts, in turn: all of them, attention only,
#: and q/v plus the MLP (so some slices of a packed layer stay zero).
TARGET_CHOICES = (
    LORA_MODULES,
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
)


@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT LoRA adapter the demo creates."""

    name: str  # PEFT's adapter name (and its folder)
    adapter_id: int  # the engine's id for it
    rank: int
    lora_alpha: int
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def adapter_specs(count: int, max_rank: int) -> list[AdapterSpec]:
    """``count`` adapters: ranks cycle max, max/2, max/4; one in three uses rsLoRA."""
    ranks = (max_rank, max(1, max_rank // 2), max(1, max_rank // 4))
    return [
        AdapterSpec(
            name=f"adapter{k}",
            adapter_id=FIRST_ADAPTER_ID + k,
            rank=ranks[k % 3],
            lora_alpha=2 * ranks[k % 3],
            use_rslora=(k % 3 == 1),
            target_modules=TARGET_CHOICES[k % len(TARGET_CHOICES)],
        )
        for k in range(count)
    ]


@contextlib.contextmanager
def _quiet_libraries():
    """Hide the deprecation notices transformers and PEFT print about each other."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def create_peft_adapters(model, specs: Sequence[AdapterSpec], folder: Path, seed: int):
    """Add the adapters to ``model`` with PEFT (random non-zero A and B) and save them.

    Adapter ``spec.name`` is saved to ``folder / spec.name``. Returns the PEFT model,
    in eval mode; it wraps ``model`` in place.
    """
    from peft import LoraConfig, get_peft_model

    def config(spec: AdapterSpec) -> LoraConfig:
        return LoraConfig(
            r=spec.rank,
            lora_alpha=spec.lora_alpha,
            use_rslora=spec.use_rslora,
            target_modules=list(spec.target_modules),
            init_lora_weights=False,  # random B too, so every adapter changes the output
        )

    devices = [] if model.device.type == "cpu" else [model.device]
    with _quiet_libraries(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config(specs[0]), adapter_name=specs[0].name)
        for spec in specs[1:]:
            peft_model.add_adapter(spec.name, config(spec))
        peft_model.save_pretrained(folder)
    return peft_model.eval()


def make_requests(
    count: int, specs: Sequence[AdapterSpec], max_prompt: int, vocab: int, gen: torch.Generator
) -> list[Request]:
    """A mixed batch in random order: adapter ids cycle ``0, id_1, ..., id_N`` and are shuffled."""
    cycle = [0, *(s.adapter_id for s in specs)]
    ids = [cycle[i % len(cycle)] for i in range(count)]
    ids = [ids[i] for i in torch.randperm(count, generator=gen).tolist()]
    lengths = torch.randint(1, max_prompt + 1, (count,), generator=gen).tolist()
    return [
        Request(torch.randint(1, vocab, (n,), generator=gen).tolist(), lora_id)
        for lora_id, n in zip(ids, lengths)
    ]


# -- PEFT as the reference ----------------------------------------------------------------


def peft_names(requests: Sequence[Request], specs: Sequence[AdapterSpec]) -> list[str]:
    """Each request's PEFT adapter name; ``"__base__"`` (PEFT's name for none) for id 0."""
    name_of = {s.adapter_id: s.name for s in specs}
    return [name_of.get(r.adapter_id, "__base__") for r in requests]


@torch.no_grad()
def peft_logits(
    peft_model,
    requests: Sequence[Request],
    generations: Sequence[Generation],
    names: Sequence[str],
    chunk: int = 16,
) -> list[torch.Tensor]:
    """PEFT's logits at the positions the engine generated from, in one mixed batch.

    Each request's sequence is its prompt plus the tokens the engine generated (but
    the last), right-padded; ``peft_model(ids, attention_mask, adapter_names=names)``
    gives ``[new tokens, V]`` float32 logits per request, the rows that predicted each
    generated token. Requests go ``chunk`` at a time to bound memory.
    """
    out = []
    device = next(peft_model.parameters()).device
    for first in range(0, len(requests), chunk):
        part = range(first, min(first + chunk, len(requests)))
        seqs = [list(requests[i].prompt) + generations[i].tokens[:-1] for i in part]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)  # [b, W], right-padded
        mask = torch.zeros(len(seqs), width, dtype=torch.int64)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with _quiet_libraries():
            logits = peft_model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                adapter_names=[names[i] for i in part],
            ).logits  # [b, W, V]
        for row, i in enumerate(part):
            start = len(requests[i].prompt) - 1
            out.append(logits[row, start : start + len(generations[i].tokens)].float())
    return out


def left_padded(requests: Sequence[Request], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as a left-padded ``[B, W]`` batch and its attention mask (for ``generate``)."""
    width = max(len(r.prompt) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)
    mask = torch.zeros(len(requests), width, dtype=torch.int64)
    for row, r in enumerate(requests):
        ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def hf_generate(model, requests, new_tokens: int, **kwargs) -> list[list[int]]:
    """Greedy ``generate`` of ``new_tokens`` tokens per request (the model has no EOS token)."""
    ids, mask = left_padded(requests, next(model.parameters()).device)
    with _quiet_libraries():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )  # [B, W + new_tokens]
    return out[:, ids.shape[1] :].tolist()


def _timed(fn, device: torch.device):
    """``(result, seconds)`` of ``fn()``, with the device's queue drained on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


# -- plain text tables ------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Aligned text table: numbers right-aligned, text left-aligned, a rule under the head."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    numeric = [
        all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(row) for row in cells]


def _is_number(value: object) -> bool:
    try:
        float(str(value))
    except ValueError:
        return False
    return True


def token_runs(tokens: Sequence[int], shown: int = 6) -> str:
    """Token indices as runs of consecutive indices: ``[0, 1, 2, 6, 9, 10]`` -> ``0..2, 6, 9..10``.

    A segment holds whole requests, so its tokens come in runs, one per request; at
    most ``shown`` runs are printed.
    """
    runs: list[list[int]] = []
    for t in tokens:
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:shown])
    return text + (f", ... ({len(runs) - shown} more)" if len(runs) > shown else "")


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], limit: int = 0) -> None:
    """Print a table, indented; with ``limit``, only its first ``limit`` rows."""
    shown = rows[:limit] if limit and len(rows) > limit else rows
    for line in format_table(headers, shown):
        print("  " + line)
    if len(shown) < len(rows):
        print(f"  ... ({len(rows) - len(shown)} more rows)")


def _short(tokens: Sequence[int], shown: int = 4) -> str:
    return " ".join(str(t) for t in tokens[:shown]) + (" ..." if len(tokens) > shown else "")


# -- the demo -----------------------------------------------------------------------------


def _parser(defaults: Defaults) -> argparse.ArgumentParser:
    machine = "simulator" if SIMULATOR else "GPU"
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba demo",
        description=(
            "Serve a mixed batch of requests over several PEFT LoRA adapters through the "
            "multi-LoRA engine, check every request's logits against PEFT, and compare "
            f"throughput. Defaults are for this machine ({machine})."
        ),
    )
    add = parser.add_argument
    add("--requests", type=int, default=defaults.requests, help="requests in the batch")
    add("--adapters", type=int, default=defaults.adapters, help="PEFT adapters (= GPU slots)")
    add("--max-rank", type=int, default=defaults.max_rank, help="largest adapter rank")
    add("--hidden", type=int, default=defaults.hidden, help="model hidden size")
    add("--intermediate", type=int, default=defaults.intermediate, help="MLP width")
    add("--layers", type=int, default=defaults.layers, help="decoder layers")
    add("--heads", type=int, default=defaults.heads, help="attention heads")
    add("--kv-heads", type=int, default=defaults.kv_heads, help="key/value heads (GQA)")
    add("--vocab", type=int, default=defaults.vocab, help="vocabulary size")
    add("--max-prompt", type=int, default=defaults.max_prompt, help="most prompt tokens")
    add("--new-tokens", type=int, default=defaults.new_tokens, help="tokens to generate")
    add(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=str(defaults.dtype).replace("torch.", ""),
        help="model and adapter dtype",
    )
    add("--seed", type=int, default=0, help="seed of the model, adapters and batch")
    add("--rows", type=int, default=16, help="most rows printed per table (0 = all)")
    add("--no-progress", action="store_true", help="no progress bar")
    add(
        "--profile",
        action="store_true",
        help="instead of the demo, time the parts of the engine's decode step on the demo's "
        "batch (with adapters and without) and print where the time goes",
    )
    add("--json", metavar="PATH", help="write the measured numbers to PATH as JSON")
    add(
        "--plot",
        metavar="PATH",
        help="also time the engine with 1, 4, 16 and 64 distinct adapters in the batch (up to "
        "--adapters) and draw tokens/s against them to PATH (a PNG; needs matplotlib)",
    )
    add("--sweep", action="store_true", help="time that sweep without drawing it")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in (
        "requests",
        "adapters",
        "max_rank",
        "hidden",
        "intermediate",
        "layers",
        "heads",
        "kv_heads",
        "vocab",
        "max_prompt",
        "new_tokens",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.vocab < 2:
        parser.error("--vocab must be >= 2 (token 0 is padding)")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.rows < 0:
        parser.error("--rows must be >= 0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return 0 when every request agrees with PEFT, 1 when one does not,
    2 when PEFT or transformers is not installed."""
    parser = _parser(DEFAULTS[SIMULATOR])
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(
            f"the demo needs PEFT and transformers ({err}); install them with "
            "pip install 'punica-numba[peft]'",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="punica_numba_demo_") as folder:
        if args.profile:
            return _profile(args, Path(folder))
        return _run(args, Path(folder))


def _profile(args: argparse.Namespace, folder: Path) -> int:
    """``--profile``: the demo's setup, then :func:`punica_numba.profile.profile_decode`
    on its batch with adapters and on the same prompts without; 0 when it ran."""
    from . import profile

    gen = torch.Generator().manual_seed(args.seed)
    print(f"punica_numba decode-step profile on the {_machine()}")
    setup = build(args, folder, gen)
    engine, requests = setup.engine, setup.requests
    base_requests = [Request(r.prompt, 0) for r in requests]
    repeats = 1 if SIMULATOR else profile.GPU_REPEATS
    if not SIMULATOR:  # compile the kernels (and capture what the engine captures) first
        engine.generate(requests, 3)
        engine.generate(base_requests, 3)
    profiles = []
    for label, batch in (
        ("engine, mixed adapters", requests),
        ("engine, no adapters", base_requests),
    ):
        profiles.append(
            profile.profile_decode(engine, batch, args.new_tokens, label=label, repeats=repeats)
        )
        profile.print_profile(profiles[-1], args.rows)
    mixed, base = profiles
    print(
        f"\nLoRA's cost in the engine: {mixed.step_ms:.3f} ms/step with adapters, "
        f"{base.step_ms:.3f} without ({base.step_ms / mixed.step_ms:.2f}x the tokens/s)"
    )
    if args.json:
        profile.write_json(args.json, profiles, _config(args))
        print(f"wrote {args.json}")
    return 0


def _config(args: argparse.Namespace) -> dict:
    """The demo's arguments and machine, for a JSON file."""
    keys = ("requests", "adapters", "max_rank", "hidden", "intermediate", "layers", "heads")
    keys += ("kv_heads", "vocab", "max_prompt", "new_tokens", "dtype", "seed")
    return {"machine": _machine(), **{k: getattr(args, k) for k in keys}}


@dataclass
class DemoSetup:
    """What the demo serves: the model, its engine, PEFT's model, the adapters, the batch."""

    model: object
    engine: MultiLoRAEngine
    peft_model: object
    specs: list[AdapterSpec]
    requests: list[Request]
    names: list[str]  # each request's PEFT adapter name


def build(args: argparse.Namespace, folder: Path, gen: torch.Generator) -> DemoSetup:
    """Steps 1 to 3 of the demo: the model, the engine on it, PEFT's adapters saved to
    ``folder`` and loaded into the engine's slots in a shuffled order, and the batch."""
    device, dtype = device_of(), getattr(torch, args.dtype)
    model = tiny_llama(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_positions=args.max_prompt + args.new_tokens,
        seed=args.seed,
        dtype=dtype,
        device=device,
    )
    specs = adapter_specs(args.adapters, args.max_rank)
    requests = make_requests(args.requests, specs, args.max_prompt, args.vocab, gen)
    engine = MultiLoRAEngine(
        model,
        max_loras=args.adapters,
        max_lora_rank=args.max_rank,
        max_num_batched_tokens=sum(len(r.prompt) for r in requests),
        max_batches=len(requests),
    )
    peft_model = create_peft_adapters(model, specs, folder, args.seed)
    for k in torch.randperm(len(specs), generator=gen).tolist():
        engine.load_adapter(specs[k].adapter_id, folder / specs[k].name)
    return DemoSetup(model, engine, peft_model, specs, requests, peft_names(requests, specs))


def _machine() -> str:
    if SIMULATOR:
        return "Numba CUDA simulator (CPU; every CUDA thread is a Python thread)"
    return f"CUDA GPU ({torch.cuda.get_device_name(device_of())})"


def _run(args: argparse.Namespace, folder: Path) -> int:
    device, dtype = device_of(), getattr(torch, args.dtype)
    rows = args.rows
    gen = torch.Generator().manual_seed(args.seed)  # CPU generator: the same batch everywhere
    print(f"punica_numba demo on the {_machine()}")

    # 1.-3. The model, the engine built on it (before PEFT wraps its projections), the
    # adapters PEFT creates and saves, loaded by the engine from disk.
    setup = build(args, folder, gen)
    engine, peft_model, specs = setup.engine, setup.peft_model, setup.specs
    requests, names = setup.requests, setup.names
    base_requests = [Request(r.prompt, 0) for r in requests]
    print(
        f"Model: Llama with random weights, {args.layers} layers, hidden {args.hidden}, "
        f"MLP {args.intermediate}, {args.heads} heads / {args.kv_heads} KV heads, vocabulary "
        f"{args.vocab}, {args.dtype}"
    )
    print(f"{len(specs)} PEFT LoRA adapters saved to {folder}")
    _print_slots(engine, specs, args.max_rank, rows)
    _print_requests(engine, requests, names, rows)

    # 4. The batch through the engine; the prefill's segments are printed on the way.
    starts: dict[int, float] = {}

    def show_segments(step: int) -> None:
        _stamp(starts, step)
        if step == 0:
            _print_segments(engine, rows)

    if not SIMULATOR:  # compile the kernels and capture the decode graphs first
        engine.generate(requests, 2)
        engine.generate(base_requests, 2)
    generations, checked_seconds = _timed(
        lambda: engine.generate(
            requests,
            args.new_tokens,
            keep_logits=True,
            progress=not args.no_progress,
            on_step=show_segments,
        ),
        device,
    )
    checked_end = time.perf_counter()

    # 5. PEFT's own forward, on the same tokens, as the reference.
    checks = check_against_peft(peft_model, requests, generations, names, dtype)
    _print_checks(requests, generations, names, checks, args, rows)
    failed = [i for i, c in enumerate(checks) if not c.agrees]

    # 6. Throughput: the engine with the batch's adapters and without, PEFT's generate,
    # the plain model's.
    repeats = 1 if SIMULATOR else ENGINE_REPEATS
    if SIMULATOR:  # one run with adapters is all the simulator affords: the checked one
        steps = args.new_tokens - 1
        step_ms = 1e3 * (checked_end - starts[1]) / steps if steps else None
        mixed = EngineTiming(checked_seconds, step_ms)
        base = time_engine(engine, base_requests, args.new_tokens, repeats)
    else:
        mixed, base = time_engines_in_turn(
            engine, (requests, base_requests), args.new_tokens, repeats
        )
    if not SIMULATOR:  # warm up each path once
        hf_generate(peft_model, requests, 2, adapter_names=names)
        with peft_model.disable_adapter():
            hf_generate(peft_model, requests, 2)
    peft_tokens, peft_seconds = _timed(
        lambda: hf_generate(peft_model, requests, args.new_tokens, adapter_names=names), device
    )
    with peft_model.disable_adapter():
        _, hf_seconds = _timed(lambda: hf_generate(peft_model, requests, args.new_tokens), device)
    same = sum(g.tokens == t for g, t in zip(generations, peft_tokens))
    print(
        f"\nGreedy tokens identical to PEFT generate's for {same} of {len(requests)} requests "
        "(where logits nearly tie, rounding may flip a choice; the check above decides)."
    )
    runs = [
        Throughput("punica_numba engine", "mixed", mixed.seconds, mixed.step_ms),
        Throughput("punica_numba engine", "none", base.seconds, base.step_ms),
        Throughput("PEFT generate(adapter_names=...)", "mixed", peft_seconds),
        Throughput("transformers generate", "none", hf_seconds),
    ]
    _print_throughput(len(requests), args.new_tokens, runs, repeats)

    # 7. Throughput against the number of distinct adapters in the batch.
    sweep = []
    if args.plot or args.sweep:
        sweep = sweep_adapters(engine, requests, specs, args.new_tokens, repeats)
        _print_sweep(sweep, len(requests), args.new_tokens)
    if args.plot:
        plot_sweep(args.plot, sweep, runs, len(requests), args.new_tokens, _distinct(requests))
        print(f"\nwrote {args.plot}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(_results(args, requests, names, checks, runs, sweep), file, indent=2)
        print(f"wrote {args.json}")

    if not failed:
        print(f"\nAll {len(requests)} requests agree with PEFT.")
        return 0
    print(f"\nMISMATCH: requests {failed} differ from PEFT by more than their bound.")
    return 1


#: Timed runs of each engine path on a GPU (the median is reported); PEFT's and
#: transformers' ``generate`` run once each (PEFT's takes seconds).
ENGINE_REPEATS = 9

#: The numbers of distinct adapters in the batch that ``--plot`` / ``--sweep`` time
#: (those up to ``--adapters``).
SWEEP_ADAPTERS = (1, 4, 16, 64)


@dataclass(frozen=True)
class EngineTiming:
    """One engine path's measured time: a whole ``generate`` (seconds) and, where
    measured, a decode step (ms: from the start of decode step 1 to the end)."""

    seconds: float
    step_ms: float | None


@dataclass(frozen=True)
class Throughput:
    """One row of the throughput table: a path, its adapters, its measured times."""

    path: str
    adapters: str
    seconds: float
    step_ms: float | None = None


def time_engine(engine, requests: Sequence[Request], new_tokens: int, repeats: int):
    """The median of ``repeats`` timed ``generate`` calls (no logits kept, no bar): the
    whole call's seconds and, with 2 or more new tokens, the decode steps' ms per step.

    The decode steps start once the decode metadata is ready (``on_step(1)``; its
    ``update_metadata`` waited for the prefill) and end when the tokens are back.
    """
    return time_engines_in_turn(engine, (requests,), new_tokens, repeats)[0]


def time_engines_in_turn(
    engine, batches: Sequence[Sequence[Request]], new_tokens: int, repeats: int
) -> list[EngineTiming]:
    """:func:`time_engine` of each batch, the batches' runs taken in turn: every round
    runs each batch once, and each round starts one batch later than the last. The
    engine's time before its first decode step is mostly the host's, and a host's speed
    drifts over seconds (on the H200's host a fixed Python loop took 0.196 s at one
    moment and 0.115 s a few seconds later, in one process): batches timed one after
    the other would each see a different host, batches timed in turn see the same."""
    device = engine.device
    wholes: list[list[float]] = [[] for _ in batches]
    steps: list[list[float]] = [[] for _ in batches]
    for round_ in range(repeats):
        for i in range(len(batches)):
            b = (round_ + i) % len(batches)
            starts: dict[int, float] = {}
            _sync(device)
            begin = time.perf_counter()
            engine.generate(batches[b], new_tokens, on_step=functools.partial(_stamp, starts))
            _sync(device)
            end = time.perf_counter()
            wholes[b].append(end - begin)
            if new_tokens > 1:
                steps[b].append(1e3 * (end - starts[1]) / (new_tokens - 1))
    return [
        EngineTiming(statistics.median(w), statistics.median(s) if s else None)
        for w, s in zip(wholes, steps)
    ]


def _stamp(starts: dict[int, float], step: int) -> None:
    """``on_step``: the host time at which each step starts."""
    starts.setdefault(step, time.perf_counter())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _distinct(requests: Sequence[Request]) -> int:
    """Distinct adapters (other than none) in a batch."""
    return len({r.adapter_id for r in requests if r.adapter_id})


@dataclass(frozen=True)
class SweepPoint:
    """The engine on the batch's prompts with ``distinct`` adapters among its requests."""

    distinct: int
    seconds: float
    step_ms: float | None


def sweep_adapters(engine, requests, specs, new_tokens: int, repeats: int) -> list[SweepPoint]:
    """Time the engine on the batch's prompts, every request with an adapter, the
    adapters cycling over the first D of ``specs``, for each D of :data:`SWEEP_ADAPTERS`
    up to ``len(specs)``."""
    points = []
    for distinct in (d for d in SWEEP_ADAPTERS if d <= len(specs)):
        batch = [Request(r.prompt, specs[i % distinct].adapter_id) for i, r in enumerate(requests)]
        if not SIMULATOR:  # its graph is captured in this warm-up
            engine.generate(batch, 2)
        timing = time_engine(engine, batch, new_tokens, repeats)
        points.append(SweepPoint(_distinct(batch), timing.seconds, timing.step_ms))
    return points


def plot_sweep(path, sweep, runs, requests: int, new_tokens: int, batch_distinct: int) -> None:
    """Tokens/s against the distinct adapters in the batch, with the paths without
    adapters as lines and PEFT's mixed batch as a point, to ``path`` (Agg backend)."""
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(f"--plot needs matplotlib ({err}): pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = requests * new_tokens
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(
        [p.distinct for p in sweep],
        [total / p.seconds for p in sweep],
        "o-",
        color="C0",
        label="punica_numba engine, every request with an adapter",
    )
    looks = {  # (path, adapters) -> how it is drawn
        ("punica_numba engine", "mixed"): dict(marker="*", ms=12, color="C0"),
        ("punica_numba engine", "none"): dict(ls="--", color="C0"),
        ("PEFT generate(adapter_names=...)", "mixed"): dict(marker="s", color="C3"),
        ("transformers generate", "none"): dict(ls="-.", color="C2"),
    }
    for run in runs:
        look = looks.get((run.path, run.adapters), {})
        if run.adapters == "none":
            ax.axhline(total / run.seconds, label=f"{run.path}, no adapters", **look)
        else:
            label = f"{run.path}, the demo's batch (some requests without)"
            ax.plot([batch_distinct], [total / run.seconds], ls="none", label=label, **look)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({p.distinct for p in sweep} | {batch_distinct})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("distinct adapters in the batch")
    ax.set_ylabel("tokens/s (whole generate)")
    ax.set_title(f"{requests} requests x {new_tokens} new tokens, {_machine()}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _results(args, requests, names, checks, runs, sweep) -> dict:
    """Every number the demo measured, for ``--json``."""
    total = len(requests) * args.new_tokens
    mixed, base = runs[0], runs[1]
    lora = {"tokens_per_s_with_over_without": base.seconds / mixed.seconds}
    if mixed.step_ms is not None and base.step_ms is not None:
        lora["decode_step_share"] = 1 - base.step_ms / mixed.step_ms
    return {
        "config": _config(args),
        "agreement": {
            "all_agree": all(c.agrees for c in checks),
            "requests": [
                {"request": i, "adapter_id": r.adapter_id, "peft_name": n, **asdict(c)}
                | {"bound": c.bound, "agrees": c.agrees}
                for i, (r, n, c) in enumerate(zip(requests, names, checks))
            ],
        },
        "throughput": [
            {**asdict(run), "tokens": total, "tokens_per_s": total / run.seconds} for run in runs
        ],
        "lora": lora,
        "sweep": [{**asdict(p), "tokens": total, "tokens_per_s": total / p.seconds} for p in sweep],
    }


def check_against_peft(
    peft_model,
    requests: Sequence[Request],
    generations: Sequence[Generation],
    names: Sequence[str],
    dtype: torch.dtype,
) -> list[Agreement]:
    """Each request's engine logits against PEFT's mixed-batch forward on the same tokens.

    PEFT runs in the engine's dtype and, when that is not float32, once more on a
    float32 copy of the same weights (the "exact" logits; see :func:`agreement`).
    """
    same_dtype = peft_logits(peft_model, requests, generations, names)
    if dtype == torch.float32:
        exact = same_dtype
    else:
        exact_model = copy.deepcopy(peft_model).to(torch.float32)
        exact = peft_logits(exact_model, requests, generations, names)
        del exact_model
    return [agreement(g.logits, p, e) for g, p, e in zip(generations, same_dtype, exact)]


def _print_slots(engine: MultiLoRAEngine, specs: Sequence[AdapterSpec], rank: int, rows: int):
    by_id = {s.adapter_id: s for s in specs}
    print(f"\nGPU slots (max_lora_rank {rank}; scaling folded into B)")
    table = []
    for slot, lora_id in enumerate(engine.lora_index_to_id):
        s = by_id[lora_id]
        rule = "alpha/sqrt(r)" if s.use_rslora else "alpha/r"
        targets = "all" if s.target_modules == LORA_MODULES else ",".join(s.target_modules)
        targets = targets.replace("_proj", "")
        table.append(
            (slot, lora_id, s.name, s.rank, s.lora_alpha, f"{s.scaling:g} ({rule})", targets)
        )
    headers = ["slot", "adapter id", "PEFT name", "rank", "alpha", "scaling", "targets"]
    _print_table(headers, table, rows)


def _print_requests(engine: MultiLoRAEngine, requests, names, rows: int) -> None:
    slot_of = {lora_id: slot for slot, lora_id in enumerate(engine.lora_index_to_id)}
    print(f"\nRequests ({len(requests)}; adapter id 0 = none)")
    table = [
        (i, r.adapter_id or "0 (none)", names[i], slot_of.get(r.adapter_id, -1), len(r.prompt))
        for i, r in enumerate(requests)
    ]
    _print_table(["request", "adapter id", "PEFT name", "slot", "prompt tokens"], table, rows)


def _print_segments(engine: MultiLoRAEngine, rows: int) -> None:
    meta = engine.punica.token_mapping_meta
    print(f"\nPrefill: token -> LoRA segments ({meta.num_tokens} tokens, sorted by slot)")
    table = [
        ("-1 (no LoRA)" if s.slot == -1 else s.slot, s.start, s.count, token_runs(s.tokens))
        for s in meta.segments()
    ]
    _print_table(["slot", "start", "count", "token indices"], table, rows)


def _print_checks(requests, generations, names, checks, args, rows: int) -> None:
    print(
        f"\nPer request: the engine's logits at the {args.new_tokens} generated positions vs. "
        "PEFT's mixed-batch forward\n  (adapter_names=[...]) on the same tokens. engine err = "
        "max |engine - PEFT in float32|;"
    )
    if args.dtype == "float32":
        print(
            "  PEFT err is 0 (PEFT in float32 is the reference itself). Agrees when engine err "
            f"<= bound =\n  {REL_FLOOR:g} x max |logit|."
        )
    else:
        print(
            f"  PEFT err = the same for PEFT's own forward in {args.dtype}. Agrees when engine "
            f"err <= bound =\n  {NOISE_FACTOR:g} x PEFT err + {REL_FLOOR:g} x max |logit|."
        )
    table = [
        (
            i,
            r.adapter_id,
            names[i],
            _short(g.tokens),
            f"{c.engine_err:.2e}",
            f"{c.peft_err:.2e}",
            f"{c.bound:.2e}",
            "agrees" if c.agrees else "DIFFERS",
        )
        for i, (r, g, c) in enumerate(zip(requests, generations, checks))
    ]
    headers = ["request", "adapter id", "PEFT name", "new tokens"]
    headers += ["engine err", "PEFT err", "bound", "result"]
    _print_table(headers, table, rows)
    failed = [i for i, c in enumerate(checks) if not c.agrees]
    if failed and rows and len(table) > rows:
        print(f"  requests that differ: {failed}")


def _print_throughput(requests: int, new_tokens: int, runs: Sequence[Throughput], repeats: int):
    """The throughput table; the first run is the one the others are compared to."""
    total = requests * new_tokens
    print(f"\nThroughput: {requests} requests x {new_tokens} new tokens = {total} tokens")
    first = runs[0].seconds
    table = [
        (
            run.path,
            run.adapters,
            f"{run.seconds:.4f}",
            f"{total / run.seconds:.1f}",
            "" if run.step_ms is None else f"{run.step_ms:.3f}",
            f"{run.seconds / first:.2f}",
        )
        for run in runs
    ]
    headers = ["path", "adapters", "seconds", "tokens/s", "decode ms/step", "time vs. engine"]
    _print_table(headers, table)
    if repeats > 1:
        print(f"  (engine rows: the median of {repeats} runs; the others: one run each)")
    mixed, base = runs[0], runs[1]
    if mixed.step_ms is not None and base.step_ms is not None:
        print(
            f"  LoRA's share of the engine's decode step: "
            f"{100 * (1 - base.step_ms / mixed.step_ms):.1f}% "
            f"({mixed.step_ms:.3f} ms with the batch's adapters, {base.step_ms:.3f} without)"
        )
    print(
        f"  The engine with the batch's adapters serves {base.seconds / mixed.seconds:.2f}x the "
        "tokens/s it serves without them"
    )
    if SIMULATOR:
        print(
            "  (on the simulator every CUDA thread is a Python thread: the engine's numbers "
            "say nothing about a GPU; its row with adapters is the checked run, logits kept)"
        )


def _print_sweep(sweep: Sequence[SweepPoint], requests: int, new_tokens: int) -> None:
    total = requests * new_tokens
    print("\nThe engine against the distinct adapters in the batch (every request has one)")
    table = [
        (
            p.distinct,
            f"{p.seconds:.4f}",
            f"{total / p.seconds:.1f}",
            "" if p.step_ms is None else f"{p.step_ms:.3f}",
        )
        for p in sweep
    ]
    _print_table(["distinct adapters", "seconds", "tokens/s", "decode ms/step"], table)
