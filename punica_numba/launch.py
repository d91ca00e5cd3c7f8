"""Launch configurations and the heuristic that picks one per call.

A configuration fixes what is compiled into a kernel (threads per block, the token
tile ``tile_m``, the rank group ``tile_n``) and how its grid is shaped. Every
configuration computes every problem correctly; they differ only in speed. The
arithmetic order of one output element depends only on ``threads`` (which
partial sums exist and how the tree adds them), so configurations that share
``threads`` give bit-identical results.

The heuristic reads only host-side facts (the activation's row count and what
``LoRAKernelMeta`` learned while it prepared the mapping), never the device, so
choosing costs no sync and a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ._cuda import SIMULATOR

__all__ = [
    "LaunchConfig",
    "choose_launch_config",
    "config_name",
    "force_launch_config",
    "launch_configs",
]

OPS = ("shrink", "expand")


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel is launched. ``threads``, ``tile_m`` and ``tile_n`` are compiled in."""

    threads: int  # threads per block (a power of two)
    tile_m: int  # tokens of one slot per block
    tile_n: int  # ranks per group (shrink only; expand ignores it)
    spread: bool  # spread rank / column groups over grid.z (True) or loop inside the block


#: The simulator runs every thread as a Python thread: small blocks, and loops inside
#: the block instead of more blocks. Same arithmetic per element as threads=16 implies.
_SIMULATOR_CONFIGS = (
    LaunchConfig(threads=16, tile_m=4, tile_n=4, spread=False),
    LaunchConfig(threads=16, tile_m=1, tile_n=4, spread=False),
)
_GPU_CONFIGS = (
    LaunchConfig(threads=256, tile_m=1, tile_n=4, spread=True),  # decode: a token per slot
    LaunchConfig(threads=128, tile_m=1, tile_n=4, spread=True),
    LaunchConfig(threads=128, tile_m=4, tile_n=4, spread=True),
    LaunchConfig(threads=128, tile_m=16, tile_n=2, spread=True),  # prefill: many per slot
)

_forced: dict[str, LaunchConfig] = {}


def launch_configs(op: str) -> tuple[LaunchConfig, ...]:
    """Every configuration the heuristic can pick for ``op`` on this machine."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return _SIMULATOR_CONFIGS if SIMULATOR else _GPU_CONFIGS


def choose_launch_config(op: str, num_tokens: int, active_slots: int | None) -> LaunchConfig:
    """Pick a configuration from the tokens per active slot (host-side facts only).

    ``active_slots`` is None when the metadata was not built by ``LoRAKernelMeta``;
    the middle configuration is taken then.
    """
    configs = launch_configs(op)
    if op in _forced:
        return _forced[op]
    if active_slots is None or active_slots == 0:
        return configs[0]
    per_slot = num_tokens / active_slots
    small, *_, large = sorted(configs, key=lambda c: c.tile_m)  # stable: the first of a size
    if per_slot < 2:
        return small
    if per_slot >= 4 * large.tile_m:
        return large
    return min(configs, key=lambda c: abs(c.tile_m - per_slot))


def config_name(config: LaunchConfig) -> str:
    """A short label, e.g. ``t256_m1_n4``."""
    return f"t{config.threads}_m{config.tile_m}_n{config.tile_n}"


@contextlib.contextmanager
def force_launch_config(op: str, config: LaunchConfig):
    """Within the block, every ``op`` launch uses ``config`` (for tests and benchmarks)."""
    if config not in launch_configs(op):
        raise ValueError(f"{config} is not one of the configurations of {op!r}")
    previous = _forced.get(op)
    _forced[op] = config
    try:
        yield
    finally:
        if previous is None:
            _forced.pop(op, None)
        else:
            _forced[op] = previous
