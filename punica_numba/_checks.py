"""Argument checks shared by the ops and the wrapper.

Every public entry point checks its arguments *before* it launches anything, so a
rejected call changes nothing. Messages name the argument and say what was
expected and what arrived. Wrong types and dtypes raise ``TypeError``; wrong
shapes, sizes, devices and values raise ``ValueError``.
"""

from __future__ import annotations

import functools
import numbers
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._cuda import KERNEL_DTYPES, SIMULATOR

__all__ = [
    "Stack",
    "check_bool",
    "check_device",
    "check_int",
    "check_kernel_tensor",
    "check_real",
    "check_same_device",
    "check_sequence",
    "check_stack",
    "check_tensor",
    "check_weight",
    "is_int",
    "is_real",
    "memory_layout",
]


def _dtype_names(dtypes) -> str:
    return " / ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | tuple[int, ...] | None = None,
    dtypes=None,
    contiguous: bool = False,
    on_kernel_device: bool = True,
) -> torch.Tensor:
    """Check one tensor argument; return it unchanged."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.ndim not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}"
        )
    if on_kernel_device and not (t.is_cpu if SIMULATOR else t.is_cuda):
        want = "cpu" if SIMULATOR else "cuda"
        raise ValueError(f"{name} must be on {want} (where the kernels run), got {t.device}")
    return t


def check_kernel_tensor(name: str, t, device: torch.device) -> torch.Tensor:
    """A tensor of a dtype the kernels take, on ``device`` exactly (the caller's kernel
    device, e.g. ``cuda:0``); return it unchanged. The cheap check of the hot path."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be {_dtype_names(KERNEL_DTYPES)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but the kernels run on {device} here")
    return t


def check_weight(name: str, w, *, dtypes=None) -> torch.Tensor:
    """A stacked LoRA weight ``[L, N, K]`` or vLLM's ``[L, 1, N, K]``, contiguous; returned
    as an ``[L, N, K]`` view."""
    check_tensor(name, w, ndim=(3, 4), dtypes=dtypes, contiguous=True)
    if w.ndim == 4:
        if w.shape[1] != 1:
            raise ValueError(f"{name} must be [L, N, K] or [L, 1, N, K], got {tuple(w.shape)}")
        return w[:, 0]
    return w


class Stack(NamedTuple):
    """A checked stacked LoRA weight: its ``[L, N, K]`` view and the facts read off it."""

    view: torch.Tensor  # [L, N, K], contiguous
    num_loras: int  # L
    rows: int  # N: output rows per slot (the rank for LoRA-A, the width for LoRA-B)
    cols: int  # K: the reduced dimension (hidden size for LoRA-A, the rank for LoRA-B)
    dtype: torch.dtype
    device: torch.device
    # What the ops work out once about passing it to a kernel (ops.operands.weight_forms), and the
    # wrapper's record of the last call it led (wrapper._shrink_then_expand).
    launch: dict


class _Known(NamedTuple):
    """What :func:`check_stack` remembers of one weight tensor."""

    tensor: weakref.ref  # the tensor itself, weakly: the entry goes when it does
    layout: tuple  # (data_ptr, shape, strides, dtype, device) when it was checked
    stack: Stack


#: id(weight tensor) -> what was learned when it was checked. A serving engine hands the
#: same weight tensors to every call, so their checks and views are made once.
_KNOWN_STACKS: dict[int, _Known] = {}


def memory_layout(t: torch.Tensor) -> tuple:
    """Everything a tensor's checks, views and raw kernel parameters depend on: equal means
    the same memory, read the same way."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def check_stack(name: str, w, index: int | None = None) -> Stack:
    """A stacked LoRA weight ``[L, N, K]`` or vLLM's ``[L, 1, N, K]``: contiguous, of a
    kernel dtype, on the kernels' device; returned as a :class:`Stack`.

    ``index`` makes the name ``name[index]`` (built only for a message). The answer is
    remembered per tensor and reused while the tensor lives and its data pointer, shape,
    strides, dtype and device stay as they were checked; anything else is checked again.
    """
    known = _KNOWN_STACKS.get(id(w))
    # (a live entry keeps the old memory alive, so no new tensor can reuse its address)
    if known is not None and known.tensor() is w and known.layout == memory_layout(w):
        return known.stack
    view = check_weight(name if index is None else f"{name}[{index}]", w, dtypes=KERNEL_DTYPES)
    num_loras, rows, cols = view.shape
    # detach(): a view of ``w`` made by indexing refers to ``w`` itself, which would keep
    # it alive through this entry, so that the entry could never be dropped.
    stack = Stack(view.detach(), num_loras, rows, cols, w.dtype, w.device, {})
    key = id(w)
    _KNOWN_STACKS[key] = _Known(
        weakref.ref(w, functools.partial(_forget, key)), memory_layout(w), stack
    )
    return stack


def _forget(key: int, ref: weakref.ref) -> None:
    """A remembered weight was freed: drop its entry (and the view that holds its memory)."""
    known = _KNOWN_STACKS.get(key)
    if known is not None and known.tensor is ref:
        del _KNOWN_STACKS[key]


def check_device(name: str, device, *, kernels: bool = True) -> torch.device:
    """A device torch knows; with ``kernels``, one the kernels run on (cuda, or the CPU
    on the simulator)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{name} must be a torch device, got {device!r}") from error
    if kernels and device.type != ("cpu" if SIMULATOR else "cuda"):
        want = "cpu (the simulator)" if SIMULATOR else "cuda"
        raise ValueError(f"{name} must be {want}, where the kernels run, got {device}")
    if device.type == "meta":
        raise ValueError(f"{name} must hold real data, got the meta device")
    return device


def check_sequence(name: str, seq, *, min_len: int = 1) -> Sequence:
    """A list or tuple of at least ``min_len`` items (a lone tensor is not a sequence here)."""
    if type(seq) in (list, tuple) and len(seq) >= min_len:
        return seq  # the common case, without the slower checks below
    if isinstance(seq, torch.Tensor) or not isinstance(seq, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple, got {type(seq).__name__}")
    if len(seq) < min_len:
        raise ValueError(f"{name} must hold at least {min_len} item(s), got {len(seq)}")
    return seq


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """An int (not a bool), at least ``minimum``."""
    if type(value) is int and (minimum is None or value >= minimum):
        return value  # the common case, without the slower ABC check below
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """A bool (not an int, not a one-element tensor)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_real(name: str, value) -> float:
    """A real number (not a bool), as a float."""
    if type(value) is float:
        return value  # the common case, without the slower ABC check below
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def is_int(value) -> bool:
    """An int of any kind (numpy's too), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number of any kind, but not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_same_device(named_tensors: dict[str, torch.Tensor]) -> None:
    """All tensors on one device (cuda:0 and cuda:1 differ)."""
    devices = {name: t.device for name, t in named_tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}")
