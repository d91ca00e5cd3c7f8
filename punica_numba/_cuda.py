"""The single import point for Numba CUDA.

Everything in punica_numba that touches Numba goes through this module, so that a
later change of backend stays local. It does five things:

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
4. **Launches cheaply, and again.** :class:`KernelLauncher` passes a kernel's raw
   parameters straight to the driver, and a :class:`LaunchRecord` notes a call's
   launches, for a caller to replay when it makes the very same call again (as one
   CUDA graph, outside someone else's capture). On Hopper and newer every launch is a
   *dependent launch* (:func:`dependent_launch`): the GPU may start a kernel while the
   one before it on the stream is still finishing.
5. **Mends the simulator** (:mod:`._simulator`): a block's barrier without Numba's
   poller, threads kept from block to block, one ``cuda.shared.array`` a line of a kernel
   for every thread of a block, and a device function's module swapped to the launch's
   ``cuda`` once a launch.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "SIMULATOR",
    "cuda",
    "jit_kernel",
    "kernel_array",
    "launch_stream",
    "device_of",
    "KERNEL_DTYPES",
    "KernelLauncher",
    "FirstLaunchInCaptureError",
    "LaunchRecord",
    "ReadyLaunch",
    "dependent_launch",
    "eager_stream",
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
from numba.cuda import types as _numba_types  # noqa: E402
from numba.cuda.core import config as _numba_cuda_config  # noqa: E402

#: True when kernels run on Numba's CUDA simulator rather than a GPU.
SIMULATOR: bool = bool(_numba_cuda_config.ENABLE_CUDASIM)

if SIMULATOR:
    from . import _simulator

    _simulator.mend()


#: Registers of one SM, and the most one thread can have.
SM_REGISTERS, THREAD_REGISTERS = 65536, 255


def jit_kernel(
    threads: int, max_registers: int | None = None, cluster: int = 1, shared_bytes: int = 0
):
    """``@cuda.jit`` for a kernel always launched with ``threads`` threads per block.

    A block whose threads could need more registers than an SM has (more than 256
    threads of up to 255 registers) is compiled with ``launch_bounds=threads`` (CUDA's
    ``__launch_bounds__``): the compiler then keeps each thread to ``65536 / threads``
    registers, and the block always launches. Without it ptxas may give a thread more,
    and the launch fails ("out of resources"): the 16-warp tensor-core shrink took 138
    registers at r=16 where its rows start 8 bytes past a multiple of 16 (72 with
    16-byte loads). Smaller blocks always fit, and keep the compiler's own choice (the
    bound changes it: it spends registers up to the bound). The simulator has no
    registers.

    ``max_registers``: a ceiling that binds only where the compiler goes over it. Each
    compiled kernel that has more registers a thread is compiled again with the ceiling
    (Numba's ``max_registers``, ptxas's ``-maxrregcount``), and :class:`KernelLauncher`
    launches that one instead (:class:`RegisterCeiling`). Not a ceiling on every
    compilation, because ptxas spends registers up to one: with 128, the tensor-core
    expand at r=16 went from 78 registers to 102, and was slower.

    ``cluster``: the kernel is always launched in thread block clusters of this many blocks
    along grid.z (:mod:`.kernels.cluster`; compute capability 9.0), which
    :class:`KernelLauncher` asks the driver for at every launch (``cuLaunchKernelEx``).

    ``shared_bytes``: the kernel's dynamic shared memory (``cuda.shared.array(0, ...)``),
    the same at every launch. Past the driver's default of 48 KB a kernel must be allowed
    more before it launches: :class:`KernelLauncher` compiles it (not Numba's launch, which
    would ask for them under the default), raises the kernel's
    ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` to ``shared_bytes`` once, and launches it with them.
    """
    if SIMULATOR:

        def simulated(function):
            kernel = cuda.jit(function)
            kernel.shared_bytes = shared_bytes
            return kernel

        return simulated
    options = {} if threads * THREAD_REGISTERS <= SM_REGISTERS else {"launch_bounds": threads}

    def jit(function):
        kernel = cuda.jit(**options)(function)
        if max_registers is not None:
            kernel.register_ceiling = RegisterCeiling(
                max_registers, cuda.jit(**options, max_registers=max_registers)(function)
            )
        kernel.cluster = cluster
        kernel.shared_bytes = shared_bytes
        return kernel

    return jit


class FirstLaunchInCaptureError(RuntimeError):
    """A kernel's first launch with some argument types came inside a CUDA graph capture.

    That launch compiles the kernel and loads it onto the GPU, work that a stream capture
    cannot hold: it invalidates the capture, which then fails in the driver's words, far
    from the cause (a warm-up that took another path than the captured call, say, and so
    launched other kernels). So the launcher refuses before compiling or launching
    anything, naming the kernel: run the same call once outside the capture (a warm-up),
    then capture it.
    """

    def __init__(self, dispatcher):
        function = getattr(dispatcher, "py_func", None)
        self.kernel = getattr(function, "__qualname__", None) or repr(dispatcher)
        super().__init__(
            f"the kernel {self.kernel} is launched for the first time with these argument "
            "types inside a CUDA graph capture; its first launch compiles it, which a "
            "capture cannot hold. Make the same call once before capturing (a warm-up), "
            "then capture it"
        )


class RegisterCeiling(NamedTuple):
    """A kernel's most registers a thread (see :func:`jit_kernel`), and its twin compiled
    with that ceiling, for the overloads that went over it."""

    registers: int
    capped: object  # the twin Numba dispatcher


#: torch dtypes the kernels read and write.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def device_of() -> torch.device:
    """The torch device whose tensors the kernels take: ``cuda`` or, on the simulator, ``cpu``."""
    return torch.device("cpu") if SIMULATOR else torch.device("cuda", torch.cuda.current_device())


#: Set to ``0`` to launch every kernel the ordinary way (:func:`dependent_launch`).
DEPENDENT_LAUNCH_VARIABLE = "PUNICA_NUMBA_DEPENDENT_LAUNCH"


@functools.cache
def dependent_launch() -> bool:
    """Whether kernels are launched as *programmatic dependent launches* (CUDA's PDL).

    On a stream, a kernel normally starts only when the one before it has finished, and
    the GPU spends a while between them: the last block drains, the next grid is set up,
    and its blocks are placed (on the H200 a dependent launch took the one-token expand
    in a CUDA graph from 2.22 to 1.70 µs a call; docs/benchmarks). A dependent
    launch lets the next kernel be launched as the blocks of the one before end, before
    that kernel has finished: each of our kernels first waits until the kernels before it
    have finished and their writes are visible (``griddepcontrol.wait``), before it
    touches memory (:mod:`.kernels.dependent_launch`). What overlaps is the launch and the
    start of the blocks, never the work on memory, so the results cannot depend on what
    ran before. (The tensor-core expand that asks ahead reads a little before its wait:
    it asks L2 for lines, and loads its weights and its tile-table row, which no kernel
    that can still be running then writes: :mod:`.kernels.expand_mma`, "B before the
    wait".)

    True on a GPU of compute capability 9.0 or newer whose cuda.core can ask for it,
    unless the environment sets ``PUNICA_NUMBA_DEPENDENT_LAUNCH=0``. The answer is made
    once per process: the kernels' code and their launches must agree.
    """
    # (Numba's own flag, not SIMULATOR, which tests of the GPU path switch off on the CPU.)
    if _numba_cuda_config.ENABLE_CUDASIM or os.environ.get(DEPENDENT_LAUNCH_VARIABLE) == "0":
        return False
    if cuda.get_current_device().compute_capability < (9, 0):
        return False  # griddepcontrol needs sm_90
    try:
        _CoreLaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except TypeError:  # a cuda.core too old to ask for it
        return False
    return True


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


def _layout(t: torch.Tensor) -> str:
    """Numba's array layout for a tensor: C, F or A (any strides)."""
    if t.is_contiguous():
        return "C"
    if t.dim() > 1 and t.permute(*reversed(range(t.dim()))).is_contiguous():
        return "F"
    return "A"


class KernelLauncher:
    """Launch a ``@cuda.jit`` kernel with torch tensors, paying Numba's dispatch only once.

    A launch through Numba's dispatcher types every argument and converts every
    tensor through DLPack on every call (about 50–140 µs of host time for a kernel
    like ours, ../shared/NUMBA.md §4). Here the first launch of each combination of
    argument types goes through the dispatcher, which compiles the kernel; later
    launches pass the kernel's raw parameters straight to ``cuda.core.launch``
    (a few µs). The raw parameters follow Numba's calling convention for arrays
    (:func:`array_params`), and scalars are passed as the C type the kernel was
    compiled for.

    On the simulator there is nothing to save: every launch goes through the
    dispatcher with numpy views.

    A first launch inside a CUDA graph capture is refused before anything is compiled
    or launched (:class:`FirstLaunchInCaptureError`): compiling would invalidate the
    capture.

    Arguments are torch tensors (bf16 ones are passed as their int16 bits), Python
    ints, ``numpy.float32`` values and bools.
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        # overload key -> (cuda.core kernel, ((raw index, C type), ...) of the scalars)
        self._compiled: dict[tuple, tuple] = {}
        #: overload key -> the Numba kernel its launches run (to inspect: registers).
        self.kernels: dict[tuple, object] = {}
        self._configs: dict[tuple, object] = {}
        #: blocks along grid.z of each cluster of a launch (:func:`jit_kernel`); 1: none
        self.cluster = getattr(dispatcher, "cluster", 1)
        #: dynamic shared memory of each launch, bytes (:func:`jit_kernel`)
        self.shared_bytes = getattr(dispatcher, "shared_bytes", 0)
        # Numba's own launch makes no clusters, and gives a kernel no more than 48 KB of
        # shared memory: such a kernel is compiled before its first launch, not by it.
        self._compiled_first = self.cluster > 1 or self.shared_bytes > 0

    def __call__(self, grid: tuple, block: int, args: tuple) -> None:
        if SIMULATOR:
            _not_replayable()  # the simulator takes numpy views, not raw parameters
            launch = self.dispatcher[grid, block, 0, self.shared_bytes]
            launch(*[_as_arg(a) for a in _unpacked(args)])
            return
        key, raw = key_and_params(args)
        entry = self._compiled.get(key)
        if entry is None and _stream_capturing():
            raise FirstLaunchInCaptureError(self.dispatcher)
        if entry is None and self._compiled_first:
            entry = self._compile(key, args, launched=False)
        elif entry is None:  # first launch of these types: Numba compiles and launches it
            self._compile_and_launch(key, grid, block, args)
            return
        cu_kernel, scalars = entry
        for index, c_type in scalars:
            raw[index] = c_type(raw[index])
        if self.cluster > 1:  # through the driver, which takes the cluster's shape
            ready = ReadyLaunch(grid, block, cu_kernel, raw, self.cluster, self.shared_bytes)
            config = self._configs.get((grid, block))  # (made once a grid and block)
            if config is None:
                config = self._configs[(grid, block)] = _launch_ex_config(ready)
            ready.driver_config = config
            _driver_launch(_current_stream_handle(), ready)
            if _recording.record is not None:
                _recording.record.add(
                    grid, block, cu_kernel, raw, args, self.cluster, self.shared_bytes
                )
            return
        config = self._configs.get((grid, block))
        if config is None:
            config = _core_launch_config(grid, block, self.shared_bytes)
            self._configs[(grid, block)] = config
        _core_launch(_core_stream(), config, cu_kernel, *raw)
        if _recording.record is not None:
            _recording.record.add(grid, block, cu_kernel, raw, args, 1, self.shared_bytes)

    def _compile_and_launch(self, key: tuple, grid: tuple, block: int, args: tuple) -> None:
        """Launch through Numba's dispatcher (which compiles), and remember the compiled
        kernel with where its scalars sit among the raw parameters, and their C types.
        A kernel over its register ceiling (:func:`jit_kernel`) is remembered by its
        capped twin: later launches run that one (the same code, so the same results)."""
        _not_replayable()  # Numba's launch is not one a record can repeat
        numba_args = [_as_arg(a) for a in _unpacked(args)]
        self.dispatcher[grid, block, launch_stream()](*numba_args)
        self._compile(key, args, launched=True)

    def _compile(self, key: tuple, args: tuple, launched: bool) -> tuple:
        """The kernel for the types of ``args``: the overload Numba compiled for the launch
        it just made (``launched``), else compiled now; remembered under ``key``, as
        :meth:`_compile_and_launch` says."""
        _not_replayable()  # (the first launch of a kernel is not a record's)
        args = _unpacked(args)
        types = tuple(self.dispatcher.typeof_pyval(_as_arg(a)) for a in args)
        kernel = self.dispatcher.overloads[types] if launched else self.dispatcher.compile(types)
        ceiling = getattr(self.dispatcher, "register_ceiling", None)
        if ceiling is not None and kernel.regs_per_thread > ceiling.registers:
            kernel = ceiling.capped.compile(types)  # the same code, fewer registers
        self.kernels[key] = kernel
        if self.shared_bytes > 0:
            _allow_shared_bytes(kernel, self.shared_bytes)
        scalars, index = [], 0
        for ty, a in zip(kernel.argument_types, args):
            if isinstance(a, torch.Tensor):
                index += 5 + 2 * a.dim()  # see array_params
            else:
                scalars.append((index, _c_type(ty)))
                index += 1
        entry = self._compiled[key] = (kernel._codelibrary.get_cufunc().kernel, tuple(scalars))
        return entry


def array_params(t: torch.Tensor) -> tuple:
    """A tensor as the raw parameters of a Numba array argument:
    ``meminfo, parent, nitems, itemsize, data, *shape, *strides_in_bytes`` (``_prepare_args``)."""
    itemsize = t.element_size()
    return (0, 0, t.numel(), itemsize, t.data_ptr(), *t.shape, *[s * itemsize for s in t.stride()])


class PackedTensors(NamedTuple):
    """Tensor arguments described once, for launches that pass the same tensors again and
    again (a ``LoRAKernelMeta``'s buffers): the launcher splices ``key`` and ``params``
    in where the tensors would go, instead of describing each tensor on every launch.
    Only for tensors whose data pointer, shape and strides never change."""

    tensors: tuple
    key: tuple
    params: tuple


def pack_tensors(tensors) -> PackedTensors:
    """Describe ``tensors`` (consecutive kernel arguments) once."""
    _not_replayable()  # new to the launches: not yet known to stay where they are
    key, raw = key_and_params(tensors)
    return PackedTensors(tuple(tensors), key, tuple(raw))


def _unpacked(args) -> list:
    """The launch's arguments with every :class:`PackedTensors` replaced by its tensors."""
    flat = []
    for a in args:
        if type(a) is PackedTensors:
            flat += a.tensors
        else:
            flat.append(a)
    return flat


def key_and_params(args) -> tuple[tuple, list]:
    """One pass over a launch's arguments: the key of its compiled overload (dtype, ndim
    and layout of each tensor, type of each scalar), and its raw parameters with each
    scalar still as given (the launcher converts them to the kernel's C types).

    A tensor that repeats the tensor argument before it (the padding of unused slice
    slots) is described once.
    """
    key, raw = [], []
    last = params = None
    for a in args:
        if a is last:
            key.append(key[-1])
            raw += params
        elif type(a) is PackedTensors:
            key += a.key
            raw += a.params
            last = None
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.dim(), "C" if a.is_contiguous() else _layout(a)))
            params = array_params(a)
            raw += params
            last = a
        else:
            key.append(type(a))
            raw.append(a)
            last = None  # only a tensor right after itself is a repeat
    return tuple(key), raw


# -- recording a call's launches, to replay them -------------------------------------------


class LaunchRecord:
    """The launches of one call, raw parameters and all, to be made again as they are.

    ``with LaunchRecord(tensors) as record:`` notes every launch made in the block (they
    are made as usual). A caller that later makes the very same call (the same kernels
    on the same memory with the same scalars: it keys the record on everything its
    launches depend on) can :meth:`replay` it: the host then skips choosing
    configurations and describing arguments, and only calls the driver, on torch's
    current stream, with every parameter laid out in memory once (:class:`ReadyLaunch`):
    once for all the launches (a CUDA graph of them), outside a stream capture.

    Like a CUDA graph, a record holds raw device pointers, so it may only be replayed
    (``replayable``) when each of them stays valid: a tensor passed as it is must share
    its memory with one of the caller's ``tensors`` (whose addresses the caller's key
    holds), and any other must come from a description made before this call
    (:func:`pack_tensors`: weights and metadata buffers, which never move; the record
    keeps them alive). A launch that compiled, described a tensor for the first time,
    or ran on the simulator makes the record not replayable. One record at a time per
    thread.

    A replayable record can also be made with the caller's tensors somewhere else
    (:meth:`replay_at`): each raw parameter that is one of their data pointers is
    noted (``moving``), so a call whose activations moved, but are read the same way,
    needs no new description either.
    """

    def __init__(self, tensors):
        self.pointers = [t.data_ptr() for t in tensors]
        self.launches: list[ReadyLaunch] = []
        self.described: list[PackedTensors] = []  # keeps the memory they describe alive
        self.replayable = True
        self.graph = None  # the launches as one CUDA graph, made at the first replay
        #: (launch, raw index, caller tensor) of each parameter that is a caller's data
        #: pointer; None when some pointer could not be told apart (shared, or null).
        self.moving: list[tuple[int, int, int]] | None = []
        if 0 in self.pointers or len(set(self.pointers)) < len(self.pointers):
            self.moving = None

    def __enter__(self) -> LaunchRecord:
        if _recording.record is not None:
            raise RuntimeError("launches are being recorded already")
        _recording.record = self
        return self

    def __exit__(self, *exception) -> None:
        _recording.record = None

    def add(
        self,
        grid: tuple,
        block: int,
        kernel,
        raw: list,
        args,
        cluster: int = 1,
        shared_bytes: int = 0,
    ) -> None:
        """Note one launch of the cuda.core ``kernel`` with the raw parameters ``raw``, and
        whether each tensor in it is safe to point at again."""
        for a in args:
            if type(a) is PackedTensors:
                self.described.append(a)
                if self.moving is not None and not self._apart(a.params):
                    self.moving = None  # a described tensor at a caller's address
            elif isinstance(a, torch.Tensor) and a.data_ptr() not in self.pointers:
                self.replayable = False  # e.g. a temporary made for this call only
        if self.moving is not None:
            # (scalars are C objects by now: every plain int is a field of an array)
            where = {p: k for k, p in enumerate(self.pointers)}
            self.moving += [
                (len(self.launches), i, where[v])
                for i, v in enumerate(raw)
                if type(v) is int and v in where
            ]
        self.launches.append(ReadyLaunch(grid, block, kernel, raw, cluster, shared_bytes))

    def _apart(self, params: tuple) -> bool:
        return not any(type(v) is int and v in self.pointers for v in params)

    def replay_at(self, tensors) -> None:
        """Make the recorded launches again with the caller's tensors now ``tensors``
        (in the order they were given; the same shapes, strides and dtypes, which the
        caller's key holds, and the same alignment), on torch's current stream.

        Each launch goes by itself (inside a capture or not), with the moved pointers
        written into its parameters for that launch only (the driver copies them at the
        launch); the record stays as it was, for :meth:`replay` and for the next move.
        """
        if not self.replayable or self.moving is None:
            raise RuntimeError("this record cannot be made at other addresses")
        pointers = [t.data_ptr() for t in tensors]
        stream = _current_stream_handle()
        fields = [(self.launches[n].values[i], k) for n, i, k in self.moving]
        for field, k in fields:
            field.value = pointers[k]
        try:
            for launch in self.launches:
                _driver_launch(stream, launch)
        finally:
            for field, k in fields:
                field.value = self.pointers[k]

    def replay(self, capturing: bool | None = None) -> None:
        """Make the recorded launches again, on torch's current stream; ``capturing``
        is whether that stream is being captured, where the caller has just read it
        (None: read it here; a read is 0.3-0.7 µs on the H200's host).

        Outside a stream capture they go as one CUDA graph, made from them the first
        time: one driver call (``cuGraphLaunch``) for them all, where each launch is a
        ``cuLaunchKernel`` of its own (at 7185bf9, on the H200's host, in bursts that
        the GPU did not hold up: 2.8-4.9 µs of host time for the graph of a shrink and
        an expand, 12.0-14.9 µs for the two launches; ``h200_v23_candidates.json``).
        Inside one (a caller capturing its own graph) they are launched one by one, so
        that the caller's graph holds them as kernels of its own.
        """
        if capturing is None:
            capturing = _stream_capturing()
        if not capturing:
            if self.graph is None:
                self.graph = _graph_of(self.launches)
            _graph_launch(self.graph)
            return
        stream = _current_stream_handle()
        for launch in self.launches:
            _driver_launch(stream, launch)


class ReadyLaunch:
    """One launch with its parameters laid out in memory once, as the driver takes them:
    ``params`` is the address of an array of pointers, one to each parameter's value.

    ``cuda.core.launch`` converts every parameter on every launch, and Numba passes an
    array as ``5 + 2 * ndim`` of them (:func:`array_params`): a shrink of three weight
    stacks has 71. Made ready once, a launch is one driver call (``cuLaunchKernel``, or
    ``cuLaunchKernelEx`` for a dependent launch, whose configuration is made at its
    first use: :func:`dependent_launch`).
    """

    def __init__(
        self, grid: tuple, block: int, kernel, raw: list, cluster: int = 1, shared_bytes: int = 0
    ):
        self.grid = (*grid, 1, 1)[:3]
        self.block = block
        self.cluster = cluster  # blocks along z of each thread block cluster (1: none)
        self.shared_bytes = shared_bytes  # dynamic shared memory of each block
        self.kernel = kernel  # (it keeps its module, and so the code, loaded)
        self.function = _function_of(kernel)
        # Each value as the C object the kernel takes: the scalars already are (the
        # launcher converted them), a bool is the kernel's one-byte boolean, and every
        # other int is one of an array's 8-byte fields (pointer, size, shape, stride).
        self.values = tuple(_C_FIELD[type(v)](v) if type(v) in _C_FIELD else v for v in raw)
        self.pointers = (ctypes.c_void_p * len(raw))(*map(ctypes.addressof, self.values))
        self.params = ctypes.addressof(self.pointers)
        self.driver_config = None  # cuLaunchKernelEx's configuration, once made


_C_FIELD = {bool: ctypes.c_bool, int: ctypes.c_int64}


class _Recording(threading.local):
    record: LaunchRecord | None = None  # the record being made on this thread, if any


_recording = _Recording()


def eager_stream():
    """The handle of torch's current stream where launches run as they are made: None on
    the simulator and inside a stream capture (a caller capturing a graph of its own)."""
    if SIMULATOR or _stream_capturing():
        return None
    return _current_stream_handle()


def _not_replayable() -> None:
    """Mark the record being made, if any, as one that must not be replayed."""
    if _recording.record is not None:
        _recording.record.replayable = False


def _as_arg(a):
    return kernel_array(a) if isinstance(a, torch.Tensor) else a


_CTYPES_INT = {
    name: getattr(ctypes, f"c_{name}")
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
}


def _c_type(ty):
    """How a scalar of Numba type ``ty`` is passed: a ctypes integer, c_float or bool."""
    if isinstance(ty, _numba_types.Integer):
        return _CTYPES_INT[str(ty)]
    if ty == _numba_types.float32:
        return ctypes.c_float
    return bool


if not SIMULATOR:
    from cuda.bindings.driver import (
        CUlaunchAttribute,
        CUlaunchAttributeID,
        CUlaunchConfig,
        CUresult,
        CUstreamCaptureMode,
    )
    from cuda.bindings.driver import cuGraphDestroy as _cu_graph_destroy
    from cuda.bindings.driver import cuGraphExecDestroy as _cu_graph_exec_destroy
    from cuda.bindings.driver import cuGraphInstantiate as _cu_graph_instantiate
    from cuda.bindings.driver import cuGraphLaunch as _cu_graph_launch
    from cuda.bindings.driver import cuLaunchKernel as _cu_launch_kernel
    from cuda.bindings.driver import cuLaunchKernelEx as _cu_launch_kernel_ex
    from cuda.bindings.driver import cuStreamBeginCapture as _cu_begin_capture
    from cuda.bindings.driver import cuStreamEndCapture as _cu_end_capture
    from cuda.core import LaunchConfig as _CoreLaunchConfig
    from cuda.core import launch as _core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream

    _CORE_STREAMS: dict[int, object] = {}
    _CUDA_SUCCESS = CUresult.CUDA_SUCCESS
    _THREAD_LOCAL_CAPTURE = CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL

    def _core_launch_config(grid, block, shared_bytes: int = 0):
        """cuda.core's configuration of a launch: its grid, block and dynamic shared memory,
        as a dependent launch where :func:`dependent_launch` says so."""
        if dependent_launch():
            return _CoreLaunchConfig(
                grid=grid,
                block=block,
                shmem_size=shared_bytes,
                programmatic_stream_serialization=True,
            )
        return _CoreLaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)

    # torch.cuda.current_stream() builds a Stream object through several Python calls,
    # a few µs on a slow host for every launch. torch's compiler reads the raw handle
    # straight from the C++ side; so does the launcher, when this torch has it.
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _current_device = getattr(torch._C, "_cuda_getDevice", None)

    if _raw_stream is not None and _current_device is not None:

        def _current_stream_handle() -> int:
            """The ``cudaStream_t`` of torch's current stream on the current device."""
            return _raw_stream(_current_device())

    else:

        def _current_stream_handle() -> int:
            """The ``cudaStream_t`` of torch's current stream (older torch)."""
            return torch.cuda.current_stream().cuda_stream

    def _function_of(kernel) -> int:
        """The driver's handle of a cuda.core kernel (a ``CUkernel``, which the driver
        launches as a function in the current context)."""
        return int(kernel.handle)

    def _driver_launch(stream: int, launch: ReadyLaunch) -> None:
        """Launch a :class:`ReadyLaunch` on the stream whose handle is ``stream``: as a
        dependent launch where :func:`dependent_launch` says so, in clusters where the
        launch has them."""
        if launch.cluster > 1 or dependent_launch():
            config = launch.driver_config
            if config is None:
                config = launch.driver_config = _launch_ex_config(launch)
            config.hStream = stream
            (result,) = _cu_launch_kernel_ex(config, launch.function, launch.params, 0)
            if result != _CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernelEx failed: {result!r}")
            return
        (result,) = _cu_launch_kernel(
            launch.function,
            *launch.grid,
            launch.block,
            1,
            1,
            launch.shared_bytes,
            stream,
            launch.params,
            0,
        )
        if result != _CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {result!r}")

    def _allow_shared_bytes(kernel, shared_bytes: int) -> None:
        """Let the compiled ``kernel`` (a Numba overload) launch with ``shared_bytes`` of
        dynamic shared memory, past the driver's default of 48 KB (on the kernel, for its
        device; once, when it is compiled)."""
        from numba.cuda.cudadrv.driver import binding, driver

        function = kernel._codelibrary.get_cufunc()
        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)

    def _launch_ex_config(launch: ReadyLaunch):
        """``cuLaunchKernelEx``'s configuration of ``launch``: its grid, block and dynamic
        shared memory, the attribute that makes it a dependent launch (where
        :func:`dependent_launch` says so) and the shape of its clusters (where it has
        them: ``(1, 1, cluster)`` blocks); the stream is set at each launch."""
        attributes = []
        if dependent_launch():
            serialization = CUlaunchAttribute()
            serialization.id = (
                CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            )
            serialization.value.programmaticStreamSerializationAllowed = 1
            attributes.append(serialization)
        if launch.cluster > 1:
            shape = CUlaunchAttribute()
            shape.id = CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dims = shape.value.clusterDim
            dims.x, dims.y, dims.z = 1, 1, launch.cluster
            shape.value.clusterDim = dims
            attributes.append(shape)
        config = CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = launch.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = launch.block, 1, 1
        config.sharedMemBytes = launch.shared_bytes
        config.attrs = attributes
        config.numAttrs = len(attributes)
        return config

    _stream_capturing = getattr(
        torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
    )

    def _driver(call, *args):
        """``call(*args)`` of cuda-bindings, its error code checked; what it gives back."""
        result, *out = call(*args)
        if result != _CUDA_SUCCESS:
            raise RuntimeError(f"{call.__name__} failed: {result!r}")
        return out[0] if out else None

    class _Graph:
        """Launches captured once as a CUDA graph, run by one driver call.

        The capture is made on a side stream of its own (a capture runs nothing), in the
        mode that minds this thread only; nothing is allocated in it. The driver's own
        calls are used rather than ``torch.cuda.CUDAGraph``, whose replay also updates
        torch's random-number generators.
        """

        def __init__(self, launches: list[ReadyLaunch]):
            side = torch.cuda.Stream()
            handle = side.cuda_stream
            _driver(_cu_begin_capture, handle, _THREAD_LOCAL_CAPTURE)
            try:
                for launch in launches:
                    _driver_launch(handle, launch)
            finally:
                self.graph = _driver(_cu_end_capture, handle)
            self.executable = _driver(_cu_graph_instantiate, self.graph, 0)

        def launch(self, stream: int) -> None:
            _driver(_cu_graph_launch, self.executable, stream)

        def __del__(self):
            # (a graph still running is freed when it ends; at exit the driver may be gone)
            try:
                _cu_graph_exec_destroy(self.executable)
                _cu_graph_destroy(self.graph)
            except Exception:
                pass

    def _graph_of(launches: list[ReadyLaunch]) -> _Graph:
        """The ``launches``, in order, as one CUDA graph."""
        return _Graph(launches)

    def _graph_launch(graph: _Graph) -> None:
        """Run a graph of :func:`_graph_of` on torch's current stream."""
        graph.launch(_current_stream_handle())

    def _core_stream():
        """torch's current stream as a cuda.core stream (created once per torch stream)."""
        handle = _current_stream_handle()
        stream = _CORE_STREAMS.get(handle)
        if stream is None:
            stream = _CORE_STREAMS[handle] = _to_core_stream(launch_stream())
        return stream
