"""Hypothesis strategies shared by the property tests: dims first, then the mode, then data.

A test draws its dimensions (tokens, hidden size, rank, slots, slices) within the
limits of the current machine and profile, then how tokens are assigned to
slots, then the values. Values come from a seeded generator, so that a failing
example prints a seed and replays exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from punica_numba._cuda import SIMULATOR, device_of

from .conftest import PROFILE

LARGE = PROFILE == "gpu" and not SIMULATOR

#: The parts a heavy property test is cut into at the gpu profile's sizes. pytest-xdist
#: runs a test's examples on one worker, so one test of 300 large examples set the time of
#: its whole file (the tensor-core expand's took 192 s of test_ops' 308 on an H200 with 15
#: workers); in parts, each drawing its share of the examples, the workers share it.
SHARDS = 4 if LARGE else 1


def in_shards(examples: int | None = None):
    """Run a ``@given`` test whose first parameter is ``shard`` as :data:`SHARDS` pytest
    items, each drawing ``examples / SHARDS`` (rounded up) of the ``examples`` in all (by
    default the profile's ``max_examples``)."""
    total = settings.default.max_examples if examples is None else examples
    share = settings(max_examples=-(-total // SHARDS))
    return lambda test: pytest.mark.parametrize("shard", range(SHARDS))(share(test))


@dataclass(frozen=True)
class Limits:
    tokens: int
    hidden: int
    rank: int
    loras: int
    width: int  # output width of one expand slice


#: The most a kernel test draws. The simulator's tiny shapes keep a launch to a few
#: hundred Python threads; the gpu profile reaches the sizes of real layers: a down
#: projection's K (14336), a gate_up slice's width (14336) and every rank the tensor cores
#: take (256).
KERNEL_LIMITS = (
    Limits(tokens=4096, hidden=14336, rank=256, loras=64, width=14336)
    if LARGE
    else Limits(tokens=20, hidden=40, rank=6, loras=4, width=24)
)

#: The metadata and mapping tests launch no kernel, so they draw larger everywhere.
META_LIMITS = Limits(tokens=300, hidden=0, rank=0, loras=16, width=0)

MODES = ("identical", "distinct", "uniform", "zipf", "none")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICE = device_of()


def assign_slots(mode: str, num_tokens: int, num_loras: int, seed: int) -> list[int]:
    """Token slots (-1 = no LoRA) for one assignment mode.

    identical: every token on one slot; distinct: as many different slots as
    possible (every token its own when T <= L); uniform: slots and -1 drawn
    uniformly; zipf: a few popular slots and a long tail, some -1; none: all -1.
    """
    rng = np.random.default_rng(seed)
    if mode == "none":
        slots = np.full(num_tokens, -1)
    elif mode == "identical":
        slots = np.full(num_tokens, rng.integers(0, num_loras))
    elif mode == "distinct":
        slots = rng.permutation(np.arange(num_tokens) % num_loras)
    elif mode == "uniform":
        slots = rng.integers(-1, num_loras, num_tokens)
    elif mode == "zipf":
        slots = np.minimum(rng.zipf(1.5, num_tokens) - 1, num_loras - 1)
        slots[rng.random(num_tokens) < 0.1] = -1
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return [int(s) for s in slots]


@st.composite
def slot_lists(draw, num_tokens: int, num_loras: int) -> list[int]:
    """The assignment mode, then the values, for dims already drawn."""
    mode = draw(st.sampled_from(MODES), label="mode")
    seed = draw(st.integers(0, 2**32 - 1), label="slot seed")
    return assign_slots(mode, num_tokens, num_loras, seed)


def random_tensor(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Normal values, rounded to ``dtype``, made on the kernels' device from a seed
    (on the GPU, generating there keeps the large gpu-profile examples fast)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    values = torch.randn(*shape, generator=gen, dtype=torch.float32, device=DEVICE)
    return (values * scale).to(dtype=dtype)
