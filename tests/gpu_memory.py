"""Memory that one pytest-xdist worker's test left in torch's cache, handed back to the GPU.

The suite's workers share one GPU. torch's caching allocator keeps what a test freed for
that process's next allocations, so a worker that once ran a large test (``test_ops``'
offsets past 2**31 elements holds several GiB) keeps its peak for the rest of the run,
memory no other worker can have. At f6946f9, 6 workers on an 80 GB H100, one of them
holding 22 GB, failed another worker's wrapper test out of memory. After each test on a
GPU, ``tests/conftest.py`` hands back a worker's cached bytes past :data:`CACHED_BYTES_KEPT`.

It also notes each test's peak of bytes in torch's tensors (:func:`note_peak`), and the run's
summary lists the largest (:func:`largest_peaks`): how many workers one GPU holds, and which
test to look at when one runs out of memory beside the others (at 323e302, eight workers on
an 80 GB H100, another worker held 45 GB when one failed so).
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


#: A test's peak of bytes allocated in torch's tensors on the GPU, by node id (this process's).
PEAKS: dict[str, int] = {}


def note_peak(nodeid: str) -> None:
    """Note the peak of torch's allocated bytes since the last note as ``nodeid``'s, and start
    the next test's count afresh; nothing where this process has no CUDA context."""
    if not torch.cuda.is_initialized():
        return
    PEAKS[nodeid] = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()


def largest_peaks(peaks: dict[str, int], count: int = 15) -> list[str]:
    """The ``count`` largest peaks as lines, largest first: ``GiB  node id``."""
    ranked = sorted(peaks.items(), key=lambda item: (-item[1], item[0]))[:count]
    return [f"{peak / (1 << 30):7.2f} GiB  {nodeid}" for nodeid, peak in ranked]
