"""tests/gpu_memory.py: a worker's cache past its limit goes back to the GPU, else nothing; each
test's peak of torch's GPU memory is noted, and the largest listed."""

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


def test_each_tests_peak_is_noted_and_the_count_started_afresh(monkeypatch):
    peaks, resets = iter([5 << 30, 1 << 20]), []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(gpu_memory, "PEAKS", {})
    gpu_memory.note_peak("tests/a.py::big")
    gpu_memory.note_peak("tests/a.py::small")
    assert gpu_memory.PEAKS == {"tests/a.py::big": 5 << 30, "tests/a.py::small": 1 << 20}
    assert resets == [1, 1]


def test_no_cuda_context_no_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(gpu_memory, "PEAKS", {})
    gpu_memory.note_peak("tests/a.py::t")
    assert gpu_memory.PEAKS == {}


def test_the_largest_peaks_come_first():
    peaks = {"t::small": 1 << 30, "t::big": 45 << 30, "t::mid": 3 << 29}
    assert gpu_memory.largest_peaks(peaks, count=2) == [
        "  45.00 GiB  t::big",
        "   1.50 GiB  t::mid",
    ]
