"""tests/gpu_memory.py: a worker's cache past its limit goes back to the GPU, else nothing."""

from __future__ import annotations

import torch

from . import gpu_memory


def _cache(monkeypatch, reserved: int, allocated: int, initialized: bool = True) -> list:
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    return emptied


def test_a_cache_past_its_limit_is_emptied(monkeypatch):
    emptied = _cache(monkeypatch, reserved=10 << 30, allocated=1 << 30)
    assert gpu_memory.release_cached_memory(kept=2 << 30) and emptied == [1]


def test_bytes_in_use_are_not_counted_as_cached(monkeypatch):
    """9 GiB reserved of which 8 in tensors: 1 GiB cached, under the limit."""
    emptied = _cache(monkeypatch, reserved=9 << 30, allocated=8 << 30)
    assert not gpu_memory.release_cached_memory(kept=2 << 30) and emptied == []


def test_no_cuda_context_no_question(monkeypatch):
    emptied = _cache(monkeypatch, reserved=10 << 30, allocated=0, initialized=False)
    assert not gpu_memory.release_cached_memory() and emptied == []
