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
   :class:`~punica_numba.engine.MultiLoRAEngine`: one prefill step, then decode
   steps, every LoRA layer of the whole batch in one wrapper call. The prefill's
   token -> LoRA segments are printed.
5. **Check.** PEFT's own mixed-batch forward (``adapter_names=[...]``,
   ``"__base__"`` for none) on each request's tokens gives the logits the engine
   must reproduce; the demo prints each request's largest error.
6. **Throughput.** The same batch through PEFT's mixed-batch ``generate``, through
   the plain model (no adapters), and through the engine with no adapters.

Run it with ``python -m punica_numba demo`` (or ``make demo``). The default sizes
are tiny on Numba's CUDA simulator (where every CUDA thread is a Python thread, so
the throughput there says nothing about a GPU) and realistic on a GPU. Exit code 0
means every request agreed with PEFT, 1 that one did not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
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
        return _run(args, Path(folder))


def _run(args: argparse.Namespace, folder: Path) -> int:
    device, dtype = device_of(), getattr(torch, args.dtype)
    rows = args.rows
    gen = torch.Generator().manual_seed(args.seed)  # CPU generator: the same batch everywhere
    if SIMULATOR:
        machine = "Numba CUDA simulator (CPU; every CUDA thread is a Python thread)"
    else:
        machine = f"CUDA GPU ({torch.cuda.get_device_name(device)})"
    print(f"punica_numba demo on the {machine}")

    # 1. The model, and the engine built on it (before PEFT wraps its projections).
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
    print(
        f"Model: Llama with random weights, {args.layers} layers, hidden {args.hidden}, "
        f"MLP {args.intermediate}, {args.heads} heads / {args.kv_heads} KV heads, vocabulary "
        f"{args.vocab}, {args.dtype}"
    )
    specs = adapter_specs(args.adapters, args.max_rank)
    requests = make_requests(args.requests, specs, args.max_prompt, args.vocab, gen)
    names = peft_names(requests, specs)
    engine = MultiLoRAEngine(
        model,
        max_loras=args.adapters,
        max_lora_rank=args.max_rank,
        max_num_batched_tokens=sum(len(r.prompt) for r in requests),
        max_batches=len(requests),
    )

    # 2. PEFT creates the adapters and saves them.
    peft_model = create_peft_adapters(model, specs, folder, args.seed)
    print(f"{len(specs)} PEFT LoRA adapters saved to {folder}")

    # 3. The engine loads them from disk, into slots in a shuffled order.
    for k in torch.randperm(len(specs), generator=gen).tolist():
        engine.load_adapter(specs[k].adapter_id, folder / specs[k].name)
    _print_slots(engine, specs, args.max_rank, rows)
    _print_requests(engine, requests, names, rows)

    # 4. The batch through the engine; the prefill's segments are printed on the way.
    def show_segments(step: int) -> None:
        if step == 0:
            _print_segments(engine, rows)

    if not SIMULATOR:  # compile the kernels before anything is timed
        engine.generate(requests, 2)
    generations, engine_seconds = _timed(
        lambda: engine.generate(
            requests,
            args.new_tokens,
            keep_logits=True,
            progress=not args.no_progress,
            on_step=show_segments,
        ),
        device,
    )

    # 5. PEFT's own forward, on the same tokens, as the reference.
    checks = check_against_peft(peft_model, requests, generations, names, dtype)
    _print_checks(requests, generations, names, checks, args, rows)
    failed = [i for i, c in enumerate(checks) if not c.agrees]

    # 6. Throughput: the same batch through PEFT generate, the plain model, the engine.
    base_requests = [Request(r.prompt, 0) for r in requests]
    if not SIMULATOR:  # warm up each path once
        hf_generate(peft_model, requests, 2, adapter_names=names)
        with peft_model.disable_adapter():
            hf_generate(peft_model, requests, 2)
    peft_tokens, peft_seconds = _timed(
        lambda: hf_generate(peft_model, requests, args.new_tokens, adapter_names=names), device
    )
    with peft_model.disable_adapter():
        _, hf_seconds = _timed(lambda: hf_generate(peft_model, requests, args.new_tokens), device)
    _, base_seconds = _timed(
        lambda: engine.generate(base_requests, args.new_tokens, progress=False), device
    )
    same = sum(g.tokens == t for g, t in zip(generations, peft_tokens))
    print(
        f"\nGreedy tokens identical to PEFT generate's for {same} of {len(requests)} requests "
        "(where logits nearly tie, rounding may flip a choice; the check above decides)."
    )
    _print_throughput(
        len(requests),
        args.new_tokens,
        [
            ("punica_numba engine", "mixed", engine_seconds),
            ("PEFT generate(adapter_names=...)", "mixed", peft_seconds),
            ("transformers generate", "none", hf_seconds),
            ("punica_numba engine", "none", base_seconds),
        ],
    )

    if not failed:
        print(f"\nAll {len(requests)} requests agree with PEFT.")
        return 0
    print(f"\nMISMATCH: requests {failed} differ from PEFT by more than their bound.")
    return 1


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


def _print_throughput(requests: int, new_tokens: int, runs) -> None:
    """``runs``: (path, adapters, seconds); the first is the one the others are compared to."""
    total = requests * new_tokens
    print(f"\nThroughput: {requests} requests x {new_tokens} new tokens = {total} tokens")
    first = runs[0][2]
    table = [
        (path, adapters, f"{seconds:.2f}", f"{total / seconds:.1f}", f"{seconds / first:.2f}")
        for path, adapters, seconds in runs
    ]
    _print_table(["path", "adapters", "seconds", "tokens/s", "time vs. engine"], table)
    if SIMULATOR:
        print(
            "  (on the simulator every CUDA thread is a Python thread: the engine's numbers "
            "say nothing about a GPU)"
        )
