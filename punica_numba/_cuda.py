"""The single import point for Numba CUDA.

Everything in punica_numba that touches Numba goes through this module, so that a
later change of backend stays local. It does three things:

1. **Chooses the machine.** When no CUDA device is usable and Numba has not been
   imported yet, it switches on Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
   and says so once on stderr. The kernels that then run on the CPU are the very
   ones that run on the GPU: each CUDA thread becomes a Python thread.
2. **Bridges torch and Numba.** :func:`kernel_array` turns a torch tensor into a
   kernel argument: the tensor itself on the GPU (Numba reads it through DLPack),
   a zero-copy numpy view on the simulator. bfloat16 travels as an ``int16`` view
   in both cases, because the simulator has no bfloat16; the kernels convert the
   bits themselves (see :mod:`punica_numba.kernels.dtypes`).
3. **Picks the launch stream.** :func:`launch_stream` returns torch's current
   stream wrapped once in ``cuda.external_stream`` and cached, so that every
   launch is ordered with torch's work and can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

__all__ = [
    "SIMULATOR",
    "cuda",
    "kernel_array",
    "launch_stream",
    "device_of",
    "KERNEL_DTYPES",
]


def _cuda_device_usable() -> bool:
    """True when torch sees a CUDA device (torch is our tensor library anyway)."""
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # a broken driver counts as "no device"
        return False


def _choose_simulator() -> bool:
    """Switch on the simulator when there is no GPU, if it is not too late."""
    if "NUMBA_ENABLE_CUDASIM" in os.environ:
        return os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
    if _cuda_device_usable():
        return False
    if "numba.cuda" in sys.modules:
        # Numba CUDA read its configuration already; whatever it chose stands.
        from numba.cuda.core import config

        return bool(config.ENABLE_CUDASIM)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba" in sys.modules:  # numba read its environment at import: read it again
        import numba

        numba.core.config.reload_config()
    print(
        "punica_numba: no usable CUDA device, so the kernels run on Numba's CUDA "
        "simulator (NUMBA_ENABLE_CUDASIM=1); expect it to be slow.",
        file=sys.stderr,
    )
    return True


_choose_simulator()

# numba-cuda <= 0.30.4 registers an overload of np.row_stack, which numpy 2.5
# removed; every kernel compile then fails. np.vstack is what row_stack was.
if not hasattr(np, "row_stack"):  # pragma: no cover - depends on numpy version
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402  (must follow the simulator switch)
from numba.cuda.core import config as _numba_cuda_config  # noqa: E402

#: True when kernels run on Numba's CUDA simulator rather than a GPU.
SIMULATOR: bool = bool(_numba_cuda_config.ENABLE_CUDASIM)

#: The GIL switch interval (seconds) set on the simulator. Its block manager polls
#: its threads in a busy loop; with Python's default of 5 ms, each thread that
#: leaves a barrier waits out the poller's time slice. 0.3 ms made a shrink launch
#: about 5 times faster on a 2-core machine. Only the simulator changes it.
SIMULATOR_SWITCH_INTERVAL = 3e-4
if SIMULATOR:
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)

#: torch dtypes the kernels read and write.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def device_of() -> torch.device:
    """The torch device whose tensors the kernels take: ``cuda`` or, on the simulator, ``cpu``."""
    return torch.device("cpu") if SIMULATOR else torch.device("cuda", torch.cuda.current_device())


def kernel_array(t: torch.Tensor):
    """A torch tensor as a Numba kernel argument, without copying.

    Semantics:
        bf16 -> an int16 view of the same memory (the kernels convert the bits);
        fp16 / fp32 / integer tensors -> the same memory as is.
        GPU: the tensor itself (Numba reads it through DLPack).
        Simulator: a numpy view of the CPU tensor (writes land in the tensor); a
            strided tensor, which only read-only inputs may be, travels as a copy.
    """
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if SIMULATOR:
        view = t.detach().numpy()
        # The simulator copies each argument as one memory region and cannot take a
        # strided view. Only read-only inputs may be strided (every output is checked
        # contiguous first), so a contiguous copy of them loses nothing.
        return view if t.is_contiguous() else np.ascontiguousarray(view)
    return t.detach()


_STREAMS: dict[int, object] = {}


def launch_stream():
    """torch's current CUDA stream as a Numba stream, created once per torch stream.

    Numba caches launch configurations by stream identity, so a fresh wrapper on
    every launch would miss that cache; hence the dictionary. On the simulator
    streams do not exist and 0 is returned.
    """
    if SIMULATOR:
        return 0
    handle = torch.cuda.current_stream().cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = cuda.external_stream(handle)
    return stream
