"""Device buffers written from the host: a host twin per buffer, sent in one batch.

The metadata of a step (slots, sorted tokens, segments, tile tables) is small, and the
host already holds what it is made from: the ``LoRAMapping``'s lists. Computing it on
the GPU means a torch operation for every line of the computation (214 of them for one
``LoRAKernelMeta`` with adapters in use, views among them; each launch a few microseconds
of the host's time) and reading numbers back to check them (a device sync each).
Computing it on the host and copying the result costs one asynchronous copy per buffer
and no sync.

:class:`HostStaging` pairs each device buffer with a *twin* on the host (page-locked
where the buffers are on a GPU, so the copy is asynchronous): the host writes the twins,
then :meth:`HostStaging.send` queues one ``copy_`` per buffer on the current stream.
Work queued earlier on the stream still reads the old contents; work queued later reads
the new. Before the host writes the twins again it waits (:meth:`HostStaging.wait`) for
the copies it queued last time, so a twin is never rewritten while its copy is still
in flight; that is the only wait, and it is on work queued before the last send.

Where the buffers are on the CPU (the simulator), a buffer may be its own twin, and
sending copies nothing for it; separate twins on the CPU run the copying path without a
GPU (the tests do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["HostStaging", "pinned_for", "separate_twins", "twin_of"]


def separate_twins(device: torch.device) -> bool:
    """Whether buffers on ``device`` get twins of their own: where they are not on the
    CPU. On the CPU (the simulator) a buffer is written in place, as its own twin."""
    return torch.device(device).type != "cpu"


def pinned_for(device: torch.device) -> bool:
    """Whether host twins of buffers on ``device`` are page-locked (a GPU's are, so that
    their copies are asynchronous)."""
    return torch.device(device).type == "cuda"


def twin_of(buffer: torch.Tensor) -> torch.Tensor:
    """A host tensor of ``buffer``'s shape and dtype, holding a copy of its contents."""
    twin = torch.empty(
        buffer.shape, dtype=buffer.dtype, device="cpu", pin_memory=pinned_for(buffer.device)
    )
    return twin.copy_(buffer)


class HostStaging:
    """Device tensors and their host twins; ``send`` copies every twin to its tensor.

    Args:
        pairs: ``(buffer, twin)``: a contiguous tensor on the device and a CPU tensor of
            its shape and dtype (:func:`twin_of`); the buffer is written only through
            its twin. A buffer may be its own twin (nothing is copied for it).

    Semantics:
        host(buffer_i) -> twin_i
        wait():  block until the copies of the last send() are done
        send():  buffer_i.copy_(twin_i) for every pair of two tensors, asynchronously,
                 in order, on the current stream
    """

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        for buffer, twin in pairs:
            if not buffer.is_contiguous() or not twin.is_contiguous():
                raise ValueError("every staged buffer and twin must be contiguous")
            if (buffer.shape, buffer.dtype) != (twin.shape, twin.dtype):
                raise ValueError(
                    f"a twin must have its buffer's shape and dtype: {tuple(buffer.shape)} "
                    f"{buffer.dtype} against {tuple(twin.shape)} {twin.dtype}"
                )
            if twin.device.type != "cpu":
                raise ValueError(f"a twin must be on the CPU, got {twin.device}")
        self._twins = {id(buffer): twin for buffer, twin in pairs}
        self._copies = [(buffer, twin) for buffer, twin in pairs if buffer is not twin]
        self._done = None  # a CUDA event recorded after the last send's copies

    def host(self, buffer: torch.Tensor) -> torch.Tensor:
        """The host twin of ``buffer`` (one of this staging's buffers)."""
        try:
            return self._twins[id(buffer)]
        except KeyError:
            raise ValueError("that tensor is not one of this staging's buffers") from None

    def wait(self) -> None:
        """Wait until the copies of the last :meth:`send` are done, so the twins may be
        written again (no wait where nothing was sent, or nothing to a GPU)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def send(self) -> None:
        """Queue a copy of every twin into its buffer on the current stream."""
        for buffer, twin in self._copies:
            buffer.copy_(twin, non_blocking=True)
        if any(buffer.device.type == "cuda" for buffer, _ in self._copies):
            self._done = torch.cuda.Event()
            self._done.record()
