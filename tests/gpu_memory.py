"""Memory that one pytest-xdist worker's test left in torch's cache, handed back to the GPU.

The suite's workers share one GPU. torch's caching allocator keeps what a test freed for
that process's next allocations, so a worker that once ran a large test (``test_ops``'
offsets past 2**31 elements holds several GiB) keeps its peak for the rest of the run,
memory no other worker can have. At f6946f9, 6 workers on an 80 GB H100, one of them
holding 22 GB, failed another worker's wrapper test out of memory. After each test on a
GPU, ``tests/conftest.py`` hands back a worker's cached bytes past :data:`CACHED_BYTES_KEPT`.
"""

from __future__ import annotations

import torch

#: Cached (reserved, not allocated) bytes a worker keeps between tests: enough for the
#: ordinary tests' tensors to be reused without asking the driver again.
CACHED_BYTES_KEPT = 2 << 30


def release_cached_memory(kept: int = CACHED_BYTES_KEPT) -> bool:
    """Empty torch's CUDA cache where it holds more than ``kept`` bytes that no tensor
    uses; whether it did."""
    if not torch.cuda.is_initialized():
        return False  # (nothing cached; and no CUDA context made just to ask)
    if torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= kept:
        return False
    torch.cuda.empty_cache()
    return True
