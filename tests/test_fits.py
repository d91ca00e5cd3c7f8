"""Every configuration of the GPU's table launches, and is right, at every rank it can get.

A kernel's registers grow with what is compiled into it (the tensor-core shrink holds a
fragment per 8 ranks; the tensor-core expand one per 16), and a block whose threads
need more than the SM's 65,536 registers does not launch: CUDA reports "out of
resources" and the call fails. The heuristic keeps such configurations below their
``to_rank``; this test forces each configuration (``force_launch_config``) at each
rank of a ladder up to that bound (up to ``ops.MMA_MAX_RANK`` for the tensor cores,
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

from .op_cases import (
    Problem,
    ShrinkCase,
    check_expand,
    check_shrink,
    rows_at_8_bytes,
    serving_expand_case,
)

pytestmark = pytest.mark.gpu

#: Every rank at which the compiled tensor-core kernels change (a multiple of 8 up to 64),
#: and one past them for the FFMA kernels.
RANKS = (8, 16, 24, 32, 40, 48, 56, 64, 128)


def _ranks(config) -> list[int]:
    top = config.to_rank or RANKS[-1]
    if config.kernel == "mma":
        top = min(top, ops.MMA_MAX_RANK)
    return [rank for rank in RANKS if rank <= top]


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


@ALIGNMENTS
@pytest.mark.parametrize("config", _params("expand"))
def test_every_expand_configuration_launches_at_its_ranks(config, aligned):
    expand = _forced("expand", config, ops.prepare_expand, aligned)
    for rank in _ranks(config):
        case = serving_expand_case(_problem(), rank, [512, 128])
        check_expand(expand, case)
