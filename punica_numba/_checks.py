"""Argument checks shared by the ops and the wrapper.

Every public entry point checks its arguments *before* it launches anything, so a
rejected call changes nothing. Messages name the argument and say what was
expected and what arrived. Wrong types and dtypes raise ``TypeError``; wrong
shapes, sizes, devices and values raise ``ValueError``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ._cuda import SIMULATOR

__all__ = [
    "check_device",
    "check_int",
    "check_real",
    "check_same_device",
    "check_sequence",
    "check_tensor",
    "check_weight",
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


def check_weight(name: str, w, *, dtypes=None) -> torch.Tensor:
    """A stacked LoRA weight ``[L, N, K]`` or vLLM's ``[L, 1, N, K]``, contiguous; returned
    as an ``[L, N, K]`` view."""
    check_tensor(name, w, ndim=(3, 4), dtypes=dtypes, contiguous=True)
    if w.ndim == 4:
        if w.shape[1] != 1:
            raise ValueError(f"{name} must be [L, N, K] or [L, 1, N, K], got {tuple(w.shape)}")
        return w[:, 0]
    return w


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
    if isinstance(seq, torch.Tensor) or not isinstance(seq, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple, got {type(seq).__name__}")
    if len(seq) < min_len:
        raise ValueError(f"{name} must hold at least {min_len} item(s), got {len(seq)}")
    return seq


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """An int (not a bool), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_same_device(named_tensors: dict[str, torch.Tensor]) -> None:
    """All tensors on one device (cuda:0 and cuda:1 differ)."""
    devices = {name: t.device for name, t in named_tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}")
