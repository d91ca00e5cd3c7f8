"""Every configuration of the GPU's table launches, and is right, at every rank it can get.

A kernel's registers grow with what is compiled into it (the tensor-core shrink holds a
fragment per 8 ranks; the tensor-core expand one per 16), and a block whose threads
need more than the SM's 65,536 registers does not launch: CUDA reports "out of
resources" and the call fails. The heuristic keeps such configurations below their
``to_rank``; this test forces each configuration (``force_launch_config``) at each
rank of a ladder up to that bound (up to ``ops.operands.MMA_MAX_RANK`` for the tensor cores,
which take no more), with rows at multiples of 16 bytes and at 8 bytes past (the 16-
and 8-byte loads are compiled apart, and their registers differ), and checks that it
ran and that its result is right. (v9's table let the 16-warp, 32-token tensor-core
shrink reach r=32, where ptxas gave it 132-140 registers a thread; and its 16-warp
shrink of every rank took 138 at r=16 with rows at 8 bytes. Blocks of more than 256
threads are now compiled with launch bounds, ``_cuda.jit_kernel``.)
"""

from __future__ import annotations

import pytest
import torch

from punica_numba import ops
from punica_numba.launch import config_name, force_launch_config, launch_configs
from punica_numba.ops import launching, operands

from .op_cases import (
    Problem,
    ShrinkCase,
    check_expand,
    check_shrink,
    record_mma_expand_builds,
    rows_at_8_bytes,
    serving_expand_case,
)

pytestmark = pytest.mark.gpu

#: Every rank at which the compiled tensor-core kernels change within one 64-rank chunk (a
#: multiple of 8 up to 64), then ranks of two and four chunks (the expand walks the rank
#: in chunks of 64 past it; the shrink's blocks hold one rank group), which the FFMA
#: kernels take too.
RANKS = (8, 16, 24, 32, 40, 48, 56, 64, 128, 256)


def _ranks(config, op: str = "shrink") -> list[int]:
    top = config.to_rank or RANKS[-1]
    if config.kernel == "mma":
        top = min(top, operands.MMA_MAX_RANK)
    # (a staged expand takes ranks of whole chunks of 32: kernels.expand_mma_staged)
    step = 32 if op == "expand" and config.staged else 1
    return [rank for rank in RANKS if rank <= top and rank % step == 0]


def _problem() -> Problem:
    """32 tokens, 16 on each of two slots in mixed order: full 16-token tiles."""
    slots = [0, 1] * 16
    return Problem(slots=slots, prepared=len(slots), num_loras=2, seed=17)


def _forced(op: str, config, prepare, aligned: bool):
    """An op that runs under ``config`` (its weights, and a shrink's x, in rows at 16 bytes
    or 8 past: the kernels' 16- and 8-byte loads, compiled apart) and asserts that
    ``config`` is what ran."""

    def run(x, weights, *args, **kwargs):
        if not aligned:
            weights = [rows_at_8_bytes(w) for w in weights]
            x = rows_at_8_bytes(x) if op == "shrink" else x
        with force_launch_config(op, config):
            launch = prepare(x, weights, *args, **kwargs)
        assert launch.config == config, (config_name(launch.config), config_name(config))
        launch()
        torch.cuda.synchronize()

    return run


def _params(op: str):
    return [pytest.param(c, id=config_name(c)) for c in launch_configs(op)]


ALIGNMENTS = pytest.mark.parametrize(
    "aligned", [True, False], ids=["rows-at-16-bytes", "rows-at-8-bytes"]
)


@ALIGNMENTS
@pytest.mark.parametrize("config", _params("shrink"))
def test_every_shrink_configuration_launches_at_its_ranks(config, aligned):
    shrink = _forced("shrink", config, ops.prepare_shrink, aligned)
    for rank in _ranks(config):
        case = ShrinkCase(_problem(), 512, rank, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
        check_shrink(shrink, case)


def _expand_params():
    """Each expand configuration with rows at 16 bytes and at 8 past; a staged one with rows
    at 16 only (at 8 it gives way to another: test_staged_expand.py)."""
    return [
        pytest.param(c, aligned, id=f"{config_name(c)}-rows-at-{16 if aligned else 8}-bytes")
        for c in launch_configs("expand")
        for aligned in (True, False)
        if aligned or not c.staged
    ]


@pytest.mark.parametrize("config, aligned", _expand_params())
def test_every_expand_configuration_launches_at_its_ranks(config, aligned):
    expand = _forced("expand", config, ops.prepare_expand, aligned)
    for rank in _ranks(config, "expand"):
        case = serving_expand_case(_problem(), rank, [512, 128])
        check_expand(expand, case)


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize(
    "config",
    [c for c in launch_configs("expand") if c.kernel == "mma" and not c.staged],
    ids=config_name,
)
def test_tensor_core_expand_keeps_to_its_register_ceiling(config, rank, monkeypatch):
    """A tensor-core expand that ptxas compiles with more registers a thread than
    ``expand_mma.MAX_REGISTERS`` runs as its twin compiled with that ceiling (on the H200
    the 16-byte-word kernel took 132 at r=64); one under it runs as compiled. A build of
    one pass that holds more words of B early than ``EARLY_B_WORDS`` has no ceiling
    (r=64 with 64 columns a warp: 144 registers locally since v25) and runs as compiled.
    The first launch of a fresh launcher runs Numba's own compilation, the later ones the
    kernel kept: the same code, so the same bits."""
    from punica_numba import lora_expand
    from punica_numba.kernels.expand_mma import EARLY_B_WORDS, MAX_REGISTERS
    from punica_numba.meta import LoRAKernelMeta

    builds = record_mma_expand_builds(monkeypatch)
    launching.launcher_of.cache_clear()  # a fresh launcher: its first launch compiles
    problem = _problem()
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor(problem.slots, device="cuda")
    meta = LoRAKernelMeta.make(problem.num_loras, len(slots), "cuda")
    meta.prepare_tensors(slots)
    x = torch.randn(1, len(slots), rank, generator=gen).cuda()
    weights = [torch.randn(problem.num_loras, 512, rank, generator=gen).to("cuda", torch.bfloat16)]
    old = torch.randn(len(slots), 512, generator=gen).to("cuda", torch.bfloat16)
    results = []
    for _ in range(3):
        out = old.clone()
        with force_launch_config("expand", config):
            lora_expand(x, weights, out, *meta.meta_args(len(slots)), add_inputs=True)
        results.append(out)
    built = [kernel for _, kernel in builds]
    assert len({id(k) for k in built}) == 1, built
    launcher = launching.launcher_of(built[0])
    [kept] = launcher.kernels.values()  # the kernel its launches run
    compiled = built[0].overloads[tuple(kept.argument_types)]  # Numba's own compilation
    b_words = -(-rank // 16) * config.tile_n // (8 * config.threads // 32)  # a lane's, early
    if config.passes == 1 and b_words > EARLY_B_WORDS:  # one pass (width 512): no ceiling
        assert kept is compiled, (compiled.regs_per_thread, kept.regs_per_thread)
    elif compiled.regs_per_thread > MAX_REGISTERS:
        assert kept.regs_per_thread <= MAX_REGISTERS, kept.regs_per_thread
        assert kept is not compiled
    else:
        assert kept is compiled, (compiled.regs_per_thread, kept.regs_per_thread)
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])
