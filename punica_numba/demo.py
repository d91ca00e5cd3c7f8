"""The multi-tenant demo: one batch, many adapters, every token checked.

A serving engine batches requests from many users at once, and each request may
ask for its own LoRA adapter (or none). This demo walks one such batch through
the whole path a token's adapter takes, printing each step:

1. **Requests.** A mixed batch: each request has an adapter id (``0`` = no
   adapter) and a prompt of a few tokens. The adapters are loaded into GPU
   slots in a shuffled order (``lora_index_to_id``), so an id is not its slot.
2. **Mapping.** A :class:`~punica_numba.mapping.LoRAMapping` (one id per token,
   one per request) goes through :func:`~punica_numba.mapping.convert_mapping`,
   which turns ids into slots (``-1`` = no LoRA).
3. **Segments.** :class:`~punica_numba.meta.LoRAKernelMeta` sorts the tokens by
   slot and cuts them into one segment per slot in use; the table shows which
   tokens each segment holds.
4. **Kernels vs. reference.** The LoRA output ``x @ A^T @ B^T`` of every token is
   computed twice: by the dense float64 reference
   (:func:`punica_numba.reference.add_lora_linear`) and by the kernels
   (:func:`~punica_numba.ops.lora_shrink` into an fp32 buffer, then
   :func:`~punica_numba.ops.lora_expand` added into ``y``). For each request the
   demo prints the size of its LoRA delta and the largest difference, and at the
   end whether every element agrees within a bound relative to its magnitude.

The adapters here are random matrices (bf16 on a GPU, fp32 on the simulator).
Later versions of the demo will load real PEFT adapters instead.

Run it with ``python -m punica_numba demo`` (or ``make demo``); the default
sizes are tiny on Numba's CUDA simulator and realistic on a GPU. Exit code 0
means every request agreed with the reference, 1 that one did not.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import ops, reference
from ._cuda import SIMULATOR, device_of
from .mapping import LoRAMapping, convert_mapping
from .meta import LoRAKernelMeta

__all__ = ["main", "Request", "Defaults", "DEFAULTS"]


@dataclass(frozen=True)
class Defaults:
    """Default sizes of the demo batch on one kind of machine."""

    requests: int
    hidden: int
    rank: int
    loras: int
    max_tokens: int  # a request's prompt has 1 .. max_tokens tokens
    dtype: torch.dtype  # of x, the LoRA weights and y


#: The simulator runs each CUDA thread as a Python thread: keep it tiny there.
DEFAULTS = {
    True: Defaults(requests=6, hidden=32, rank=4, loras=4, max_tokens=4, dtype=torch.float32),
    False: Defaults(
        requests=64, hidden=2048, rank=16, loras=16, max_tokens=32, dtype=torch.bfloat16
    ),
}

#: Relative tolerance per output dtype: |kernel - reference| <= RTOL * magnitude,
#: where magnitude is the reference computed on absolute values. fp32 accumulates
#: H + r products with unit roundoff 2**-24 (well under 1e-5 for the sizes here);
#: bf16 rounds the stored output to 2**-8 (well under 1e-2).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}

#: Adapter ids are user-visible and need not be small; these make ids and slots
#: look different in the tables.
FIRST_ADAPTER_ID = 101

#: convert_mapping also builds the embedding indices, which need a vocabulary size;
#: the demo does not use them, so any value does.
VOCAB_SIZE = 32000


@dataclass(frozen=True)
class Request:
    """One request of the batch: its adapter (0 = none) and the tokens of its prompt."""

    index: int
    adapter_id: int
    first_token: int  # index of its first token in the batch
    num_tokens: int

    @property
    def tokens(self) -> range:
        return range(self.first_token, self.first_token + self.num_tokens)


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


# -- the batch ----------------------------------------------------------------------------


def make_requests(
    num_requests: int, adapter_ids: Sequence[int], max_tokens: int, gen: torch.Generator
) -> list[Request]:
    """A mixed batch in random order.

    The adapter ids cycle through ``0, id_1, ..., id_L`` (so one request in L + 1 has
    no adapter, and every adapter is used when there are enough requests), then are
    shuffled; each prompt has 1 to ``max_tokens`` tokens.
    """
    cycle = [0, *adapter_ids]
    ids = [cycle[i % len(cycle)] for i in range(num_requests)]
    ids = [ids[i] for i in torch.randperm(num_requests, generator=gen).tolist()]
    lengths = torch.randint(1, max_tokens + 1, (num_requests,), generator=gen).tolist()
    requests, first = [], 0
    for i, (lora_id, n) in enumerate(zip(ids, lengths)):
        requests.append(Request(i, lora_id, first, n))
        first += n
    return requests


def random_weights(num_slots: int, rows: int, cols: int, dtype, device, gen) -> torch.Tensor:
    """``[L, rows, cols]`` Gaussian weights scaled by 1/sqrt(cols), so outputs stay O(1)."""
    w = torch.randn(num_slots, rows, cols, generator=gen, dtype=torch.float64)
    return (w / cols**0.5).to(dtype=dtype, device=device).contiguous()


# -- the demo -----------------------------------------------------------------------------


def _parser(defaults: Defaults) -> argparse.ArgumentParser:
    machine = "simulator" if SIMULATOR else "GPU"
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba demo",
        description=(
            "Run a mixed multi-LoRA batch through the shrink and expand kernels and check "
            "every request against the float64 reference. "
            f"Defaults are for this machine ({machine})."
        ),
    )
    parser.add_argument(
        "--requests", type=int, default=defaults.requests, help="requests in the batch"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batch and weights")
    parser.add_argument(
        "--hidden", type=int, default=defaults.hidden, help="hidden size H (= output width)"
    )
    parser.add_argument("--rank", type=int, default=defaults.rank, help="LoRA rank r")
    parser.add_argument(
        "--loras", type=int, default=defaults.loras, help="adapters, one per GPU slot"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=defaults.max_tokens, help="most prompt tokens per request"
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, lowest in (
        ("requests", 1),
        ("hidden", 1),
        ("rank", 1),
        ("loras", 1),
        ("max_tokens", 1),
    ):
        if getattr(args, name) < lowest:
            parser.error(
                f"--{name.replace('_', '-')} must be >= {lowest}, got {getattr(args, name)}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return 0 when the kernels agree with the reference everywhere, else 1."""
    defaults = DEFAULTS[SIMULATOR]
    parser = _parser(defaults)
    args = parser.parse_args(argv)
    _check_args(parser, args)

    device, dtype = device_of(), defaults.dtype
    rtol = RTOL[dtype]
    gen = torch.Generator().manual_seed(args.seed)  # CPU generator: the same batch everywhere
    if SIMULATOR:
        machine = "Numba CUDA simulator (CPU; every CUDA thread is a Python thread)"
    else:
        machine = f"CUDA GPU ({torch.cuda.get_device_name(device)})"
    print(f"punica_numba demo on the {machine}")
    print(
        f"{args.requests} requests, {args.loras} adapters of rank {args.rank}, "
        f"hidden size {args.hidden}, {str(dtype).replace('torch.', '')} weights, seed {args.seed}"
    )

    # 1. Requests, and the adapters loaded into GPU slots (in a shuffled order).
    adapter_ids = list(range(FIRST_ADAPTER_ID, FIRST_ADAPTER_ID + args.loras))
    order = torch.randperm(args.loras, generator=gen).tolist()
    lora_index_to_id = [adapter_ids[i] for i in order]  # slot -> adapter id
    slot_of_id = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id)}
    requests = make_requests(args.requests, adapter_ids, args.max_tokens, gen)
    num_tokens = sum(r.num_tokens for r in requests)

    print(f"\nGPU slots (lora_index_to_id): {lora_index_to_id}")
    print("\nRequests")
    rows = [
        (
            r.index,
            r.adapter_id if r.adapter_id else "0 (none)",
            slot_of_id.get(r.adapter_id, -1),
            r.num_tokens,
            token_runs(r.tokens),
        )
        for r in requests
    ]
    for line in format_table(["request", "adapter id", "slot", "tokens", "token indices"], rows):
        print("  " + line)

    # 2. Ids -> slots.
    mapping = LoRAMapping(
        index_mapping=[r.adapter_id for r in requests for _ in r.tokens],  # [T]
        prompt_mapping=[r.adapter_id for r in requests],  # [P]: one sampled row per request
        is_prefill=True,
    )
    indices = convert_mapping(
        mapping,
        lora_index_to_id,
        max_loras=args.loras + 1,  # vLLM passes the slot count plus one (a padding block)
        vocab_size=VOCAB_SIZE,
        extra_vocab_size=0,
        device=device,
    )
    slots = indices.base_indices  # [T] int64, -1 = no LoRA

    # 3. Sort and segment.
    meta = LoRAKernelMeta.make(max_loras=args.loras, max_num_tokens=num_tokens, device=device)
    meta.prepare_tensors(slots)
    print(f"\nToken -> LoRA segments ({num_tokens} tokens, sorted by slot)")
    rows = [
        ("-1 (no LoRA)" if s.slot == -1 else s.slot, s.start, s.count, token_runs(s.tokens))
        for s in meta.segments()
    ]
    for line in format_table(["slot", "start", "count", "token indices"], rows):
        print("  " + line)

    # 4. The LoRA output, computed by the reference and by the kernels.
    hidden, rank, width = args.hidden, args.rank, args.hidden  # output width N = H
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype=dtype, device=device)  # [T, H]
    lora_a = random_weights(args.loras, rank, hidden, dtype, device, gen)  # [L, r, H]
    lora_b = random_weights(args.loras, width, rank, dtype, device, gen)  # [L, N, r]
    y0 = torch.zeros(num_tokens, width, dtype=torch.float64, device=device)  # [T, N]
    want = reference.add_lora_linear(
        y0, x, [lora_a], [lora_b], None, 1.0, [width], slots
    )  # [T, N] fp64
    magnitude = reference.add_lora_linear(
        y0, x.abs(), [lora_a.abs()], [lora_b.abs()], None, 1.0, [width], slots
    )  # [T, N] fp64

    buffer = torch.zeros(1, num_tokens, rank, dtype=torch.float32, device=device)  # [1, T, r]
    y = torch.zeros(num_tokens, width, dtype=dtype, device=device)  # [T, N]
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Numba warns that a small grid under-uses a GPU; this demo's grids are small.
        # The message starts with a terminal colour code, hence the leading ".*".
        warnings.filterwarnings("ignore", message=".*Grid size .* low occupancy")
        ops.lora_shrink(x, [lora_a], buffer, *meta.meta_args(num_tokens), 1.0)
        ops.lora_expand(
            buffer, [lora_b], y, *meta.meta_args(num_tokens), offset_start=0, add_inputs=True
        )
    if not SIMULATOR:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start  # the first launches: JIT compilation included

    err = (y.to(torch.float64) - want).abs()  # [T, N]
    ok = err <= rtol * magnitude  # [T, N]; rows without a LoRA must be exactly 0
    print(
        f"\nLoRA output per request: kernels (shrink + expand, {seconds:.2f} s with JIT "
        f"compilation) vs. float64 reference"
    )
    print(
        "  |delta| = norm of the request's LoRA output rows; magnitude = the reference on "
        f"absolute values;\n  a request agrees when every element is within {rtol:g} x magnitude"
    )
    rows, all_agree = [], True
    for r in requests:
        tokens = slice(r.first_token, r.first_token + r.num_tokens)
        agrees = bool(ok[tokens].all())
        all_agree &= agrees
        rel = (err[tokens] / magnitude[tokens].clamp_min(1e-300)).max().item()
        rows.append(
            (
                r.index,
                r.adapter_id,
                slot_of_id.get(r.adapter_id, -1),
                f"{want[tokens].norm().item():.4f}",
                f"{err[tokens].max().item():.2e}",
                f"{rel:.1e}",
                "agrees" if agrees else "DIFFERS",
            )
        )
    headers = [
        "request",
        "adapter id",
        "slot",
        "|delta|",
        "max |kernel - ref|",
        "max err / magnitude",
        "result",
    ]
    for line in format_table(headers, rows):
        print("  " + line)

    if all_agree:
        print(
            f"\nAll {len(requests)} requests agree with the reference "
            f"(within {rtol:g} x magnitude)."
        )
        return 0
    bad = [r.index for r, row in zip(requests, rows) if row[-1] != "agrees"]
    print(
        f"\nMISMATCH: requests {bad} differ from the reference by more than {rtol:g} x magnitude."
    )
    return 1
