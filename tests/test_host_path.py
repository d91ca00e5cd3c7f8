"""The host path of a layer call: checks made once, remembered safely, and raw launch parameters.

A layer call in eager mode spends its time on the host, in Python: checking the
arguments, and packing the kernels' raw parameters. The wrapper checks each argument
once, remembers what it learned of each LoRA weight tensor (vLLM hands the same ones
to every call), and the launcher packs tensors the way Numba's calling convention
lays them out. These tests pin down that the shortcuts are safe:

1. a remembered weight is checked again as soon as it is not the same tensor, with
   the same memory read the same way, and forgotten when it is freed;
2. the wrapper does not check through the public ops a second time, and a weight it
   remembers is still rejected after it was changed in place;
3. the raw parameters follow Numba's convention (checked against numpy's own view of
   the memory), and the launcher's GPU path packs and converts them, here with the
   driver stubbed out;
4. a layer call's recorded launches are replayed only while a fresh call would make
   exactly the same ones, and a record is kept only when every pointer in it stays
   valid.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from numba import cuda
from numba.cuda import types as nt

import punica_numba
from punica_numba import _checks, _cuda, demo, launch
from punica_numba import engine as engine_module
from punica_numba import wrapper as wrapper_module
from punica_numba._checks import check_stack
from punica_numba._cuda import LaunchRecord, array_params, key_and_params, pack_tensors
from punica_numba.launch import choose_launch_config, force_launch_config, launch_configs
from punica_numba.mapping import LoRAMapping
from punica_numba.ops import api, checks, launching, operands
from punica_numba.wrapper import PunicaWrapperNumba

from .strategies import DEVICE

T, H, R, L, N = 5, 12, 4, 3, 7

# -- 1. what check_stack remembers ----------------------------------------------------------


def _weight(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype=dtype, device=DEVICE)


def test_the_same_tensor_is_checked_once():
    w = _weight(L, 1, R, H)
    first = check_stack("w", w)
    assert check_stack("w", w) is first
    assert first.view.shape == (L, R, H) and (first.num_loras, first.rows, first.cols) == (L, R, H)
    assert first.view.data_ptr() == w.data_ptr()


@pytest.mark.parametrize(
    "change",
    ["new data of another shape", "resized", "a view of another shape"],
)
def test_a_tensor_changed_in_place_is_checked_again(change):
    w = _weight(L, 1, R, H)
    check_stack("w", w)
    if change == "new data of another shape":
        w.data = _weight(L, 1, R + 1, H)
    elif change == "resized":
        w.resize_(L - 1, 1, R, H)
    else:  # the same memory read another way: same data pointer, same version
        w.data = w.data.view(L, 1, H, R)
    stack = check_stack("w", w)
    assert stack.view.shape == w.shape[:1] + w.shape[2:]
    assert stack.view.data_ptr() == w.data_ptr()


def test_a_tensor_made_invalid_in_place_is_rejected():
    w = _weight(L, 1, R, H)
    check_stack("w", w)
    w.transpose_(2, 3)  # [L, 1, H, R], not contiguous
    with pytest.raises(ValueError, match=r"w\[0\] must be contiguous"):
        check_stack("w", w, 0)


def test_a_rejected_tensor_is_not_remembered():
    w = _weight(L, 2, R, H)
    with pytest.raises(ValueError, match="w"):
        check_stack("w", w)
    assert id(w) not in _checks._KNOWN_STACKS


def test_a_freed_tensor_is_forgotten_with_its_memory():
    w = _weight(L, 1, R, H)
    key = id(w)
    view = weakref.ref(check_stack("w", w).view)
    assert key in _checks._KNOWN_STACKS
    del w
    gc.collect()
    assert key not in _checks._KNOWN_STACKS
    assert view() is None  # nothing keeps the freed weight's memory alive


def test_a_new_tensor_at_a_reused_id_is_checked_afresh():
    """Free tensors until a new one of another shape gets an id that was remembered."""
    seen = {}
    for _ in range(200):
        w = _weight(L, 1, R, H)
        check_stack("w", w)
        seen[id(w)] = True
        del w
        other = _weight(L, 1, R + 2, H + 1)
        if id(other) in seen:
            assert check_stack("other", other).view.shape == (L, R + 2, H + 1)
            return
    pytest.skip("no id was reused in 200 tries")


# -- 2. the wrapper checks once, and re-checks changed weights ------------------------------


def _wrapper() -> PunicaWrapperNumba:
    wrapper = PunicaWrapperNumba(T + 3, 4, DEVICE, max_loras=L)
    slots = [11 + s if s >= 0 else 0 for s in (0, 2, -1, 1, 2)]
    wrapper.update_metadata(LoRAMapping(slots, slots), [11, 12, 13], L + 1, 32, 0)
    return wrapper


def _linear_args():
    y = _weight(T, N)
    x = _weight(T, H)
    a = (_weight(L, 1, R, H),)
    b = (_weight(L, 1, N, R),)
    return y, x, a, b


def test_add_lora_linear_does_not_go_through_the_checking_ops(monkeypatch):
    """The public ops check everything; the wrapper has checked already and calls only
    their launch halves."""

    def refuse(*args, **kwargs):
        raise AssertionError("the wrapper called a checking op")

    for name in ("prepare_shrink", "prepare_expand"):
        monkeypatch.setattr(api, name, refuse)
    for name in ("check_shrink", "check_expand", "_check_metadata", "check_weights"):
        monkeypatch.setattr(checks, name, refuse)
    wrapper = _wrapper()
    y, x, a, b = _linear_args()
    y0 = y.clone()
    wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,))
    assert not torch.equal(y, y0)


def test_a_second_call_does_not_check_the_weights_again(monkeypatch):
    wrapper = _wrapper()
    y, x, a, b = _linear_args()
    wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,))
    checked = []
    real = _checks.check_weight
    monkeypatch.setattr(_checks, "check_weight", lambda *a, **k: checked.append(a) or real(*a, **k))
    wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,))
    assert checked == []


@pytest.mark.parametrize("change", ["A transposed in place", "B given new, wider data"])
def test_a_remembered_weight_changed_in_place_is_rejected(change):
    wrapper = _wrapper()
    y, x, a, b = _linear_args()
    wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,))  # remembers a and b
    if change == "A transposed in place":
        a[0].transpose_(-1, -2)
        error, name = ValueError, r"lora_a_stacked\[0\]"
    else:
        b[0].data = _weight(L, 1, N + 1, R)
        error, name = ValueError, r"lora_b_stacked\[0\]"
    y0 = y.clone()
    with pytest.raises(error, match=name):
        wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,))
    assert torch.equal(y, y0)


# -- 3. raw launch parameters ----------------------------------------------------------------


def _numpy_params(t: torch.Tensor) -> tuple:
    """Numba's array parameters, read off numpy's view of the same memory."""
    view = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return (0, 0, view.size, view.itemsize, view.ctypes.data, *view.shape, *view.strides)


CPU_TENSORS = {
    "2-D fp32": lambda: torch.randn(3, 5),
    "3-D bf16": lambda: torch.randn(2, 3, 4).to(torch.bfloat16),
    "1-D int32 slice": lambda: torch.arange(10, dtype=torch.int32)[2:7],
    "transposed": lambda: torch.randn(4, 6).t(),
    "every other column": lambda: torch.randn(4, 6, dtype=torch.float16)[:, ::2],
    "int64 words": lambda: torch.randn(3, 8).to(torch.bfloat16).view(torch.int64),
}


@pytest.mark.parametrize("name", CPU_TENSORS)
def test_array_params_follow_numbas_convention(name):
    t = CPU_TENSORS[name]()
    assert array_params(t) == _numpy_params(t)


def test_the_overload_key_tells_layouts_dtypes_and_scalars_apart():
    c = torch.randn(4, 6)
    keys = {
        key_and_params((t,))[0]
        for t in (c, c.t(), c[:, ::2], c.double(), c.unsqueeze(0), c.to(torch.bfloat16))
    }
    assert len(keys) == 6
    assert key_and_params((c, 1, np.float32(1), True))[0][1:] == (int, np.float32, bool)


def test_a_repeated_tensor_packs_like_a_new_one():
    a, b = torch.randn(2, 3), torch.randn(5)
    args = (a, a, a, b, 7, a, np.float32(0.5), False)
    key, raw = key_and_params(args)
    want = []
    for arg in args:
        want += _numpy_params(arg) if isinstance(arg, torch.Tensor) else (arg,)
    assert raw == want
    assert key == tuple(key_and_params((arg,))[0][0] for arg in args)


class _FakeKernel:
    """What the launcher reads of a compiled overload."""

    def __init__(self, argument_types):
        self.argument_types = argument_types
        cufunc = type("CuFunc", (), {"kernel": "the cuda.core kernel"})()
        self._codelibrary = type("Library", (), {"get_cufunc": lambda self: cufunc})()


class _FakeDispatcher:
    """A Numba dispatcher that 'compiles' one overload and records its launches."""

    def __init__(self, argument_types):
        kernel = _FakeKernel(argument_types)
        self.overloads = collections.defaultdict(lambda: kernel)  # every typing: the one
        self.launches = []

    def __getitem__(self, config):
        return lambda *args: self.launches.append((config, args))

    def typeof_pyval(self, value):
        return type(value)


def test_the_gpu_path_packs_raw_parameters(monkeypatch):
    """The launcher's GPU path with the driver stubbed: the first launch goes through the
    dispatcher, later ones pass raw parameters, scalars as the kernel's C types."""
    sent = []
    monkeypatch.setattr(_cuda, "SIMULATOR", False)
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: False, raising=False)
    monkeypatch.setattr(_cuda, "launch_stream", lambda: 0)
    monkeypatch.setattr(_cuda, "_core_stream", lambda: "stream", raising=False)
    monkeypatch.setattr(_cuda, "_core_launch_config", lambda g, b, shared=0: (g, b), raising=False)
    monkeypatch.setattr(_cuda, "_core_launch", lambda *a: sent.append(a), raising=False)

    x, w, table = torch.randn(4, 8), torch.randn(3, 2, 8), torch.zeros(2, 5, dtype=torch.int32)
    types = (
        nt.Array(nt.float32, 2, "C"),
        nt.Array(nt.float32, 3, "C"),
        nt.Array(nt.float32, 3, "C"),
        nt.int32,
        nt.Array(nt.int32, 2, "C"),
        nt.float32,
        nt.boolean,
        nt.int64,
    )
    dispatcher = _FakeDispatcher(types)
    launcher = _cuda.KernelLauncher(dispatcher)
    args = (x, w, w, 3, table, np.float32(0.25), True, 2**40)

    launcher((2, 1, 1), 32, args)  # compiles: through the dispatcher
    assert len(dispatcher.launches) == 1 and sent == []
    launcher((2, 1, 1), 32, args)
    ((stream, config, kernel, *raw),) = sent
    assert (stream, config, kernel) == ("stream", ((2, 1, 1), 32), "the cuda.core kernel")

    want, scalars = [], []  # scalars: their places among the raw parameters
    for arg in args:
        if isinstance(arg, torch.Tensor):
            want += _numpy_params(arg)
        else:
            scalars.append(len(want))
            want.append(arg)
    assert len(raw) == len(want)
    for i, (got, expected) in enumerate(zip(raw, want)):
        if i in scalars:
            assert getattr(got, "value", got) == expected
        else:
            assert type(got) is int and got == expected
    converted = [type(raw[i]) for i in scalars]
    assert converted == [ctypes.c_int32, ctypes.c_float, bool, ctypes.c_int64]


def _launched_in_a_record_and_after(**attributes):
    """A fake kernel with ``attributes`` (``cluster``, ``shared_bytes``) launched twice on grid
    ``(3, 2, 4)`` in a record, then once on ``(3, 2, 8)``: its dispatcher and the record."""
    x = torch.randn(4, 8)
    dispatcher = _FakeDispatcher((nt.Array(nt.float32, 2, "C"), nt.int32))
    dispatcher.compile = lambda types: dispatcher.overloads[types]
    for name, value in attributes.items():
        setattr(dispatcher, name, value)
    launcher = _cuda.KernelLauncher(dispatcher)
    with _cuda.LaunchRecord((x,)) as record:
        for _ in range(2):
            launcher((3, 2, 4), 64, (x, 5))
    launcher((3, 2, 8), 64, (x, 5))
    return dispatcher, record


def test_a_kernel_of_clusters_is_compiled_not_launched_by_numba(monkeypatch):
    """A kernel launched in clusters (``jit_kernel(..., cluster=n)``): Numba's launch makes
    none, so its first launch only compiles through the dispatcher, and every launch goes
    to the driver as a ready launch of that cluster's shape, recorded as one; the driver's
    configuration of a grid and block is made once (an eager launch makes no other)."""
    driven, configs = [], []
    monkeypatch.setattr(_cuda, "SIMULATOR", False)
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: False, raising=False)
    monkeypatch.setattr(_cuda, "_function_of", lambda kernel: kernel, raising=False)
    monkeypatch.setattr(_cuda, "_current_stream_handle", lambda: 7, raising=False)
    monkeypatch.setattr(
        _cuda, "_driver_launch", lambda stream, ready: driven.append((stream, ready)), raising=False
    )
    monkeypatch.setattr(
        _cuda, "_launch_ex_config", lambda ready: configs.append(ready.grid) or ready.grid,
        raising=False,
    )  # fmt: skip
    dispatcher, record = _launched_in_a_record_and_after(cluster=4)
    assert dispatcher.launches == []  # (compiled, never launched the ordinary way)
    assert [stream for stream, _ in driven] == [7, 7, 7]
    assert configs == [(3, 2, 4), (3, 2, 8)]  # one a grid and block
    for _, ready in driven:
        assert (ready.block, ready.cluster) == (64, 4)
        assert ready.driver_config == ready.grid  # (the stub's configuration: the grid)
    assert [ready.cluster for ready in record.launches] == [4, 4]


def test_a_kernel_of_dynamic_shared_memory_is_allowed_it_once(monkeypatch):
    """A kernel of dynamic shared memory (``jit_kernel(..., shared_bytes=n)``): Numba's launch
    would ask for it under the driver's default ceiling of 48 KB, so its first launch only
    compiles; the compiled kernel is allowed ``n`` bytes once, and every launch asks for
    them, on the ordinary path (cuda.core's configuration, made once a grid and block) and
    in a record."""
    sent, allowed, configs = [], [], []
    monkeypatch.setattr(_cuda, "SIMULATOR", False)
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: False, raising=False)
    monkeypatch.setattr(_cuda, "_core_stream", lambda: "stream", raising=False)
    monkeypatch.setattr(
        _cuda, "_core_launch_config", lambda *a: configs.append(a) or a, raising=False
    )
    monkeypatch.setattr(_cuda, "_core_launch", lambda *a: sent.append(a), raising=False)
    monkeypatch.setattr(_cuda, "_function_of", lambda kernel: kernel, raising=False)
    monkeypatch.setattr(
        _cuda, "_allow_shared_bytes", lambda kernel, n: allowed.append((kernel, n)),
        raising=False,
    )  # fmt: skip
    dispatcher, record = _launched_in_a_record_and_after(shared_bytes=100_000)
    assert dispatcher.launches == []  # (compiled, never launched the ordinary way)
    (overload,) = set(dispatcher.overloads.values())
    assert allowed == [(overload, 100_000)]  # once, for the one compiled kernel
    assert configs == [((3, 2, 4), 64, 100_000), ((3, 2, 8), 64, 100_000)]
    assert [config for _, config, *_ in sent] == [configs[0], configs[0], configs[1]]
    assert [(r.shared_bytes, r.cluster) for r in record.launches] == [(100_000, 1)] * 2


@pytest.mark.parametrize(
    "attributes",
    [{}, {"cluster": 4}, {"shared_bytes": 100_000}],
    ids=["ordinary", "in clusters", "of dynamic shared memory"],
)
def test_a_first_launch_inside_a_capture_is_refused_before_anything_runs(monkeypatch, attributes):
    """A kernel's first launch with some argument types compiles it, which a CUDA graph
    capture cannot hold: inside one the launcher raises ``FirstLaunchInCaptureError``,
    naming the kernel, before it compiles, launches or remembers anything. After that
    launch outside a capture (a warm-up), the same types launch inside one, on every path."""
    sent = _stub_driver(monkeypatch)
    capturing = True
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: capturing, raising=False)
    monkeypatch.setattr(_cuda, "_launch_ex_config", lambda ready: ready.grid, raising=False)
    monkeypatch.setattr(_cuda, "_allow_shared_bytes", lambda kernel, n: None, raising=False)
    x = torch.randn(4, 8)
    dispatcher = _FakeDispatcher((nt.Array(nt.float32, 2, "C"), nt.int32))
    dispatcher.py_func = _a_kernel_of_a_name_to_find
    compiled = []
    dispatcher.compile = lambda types: compiled.append(types) or dispatcher.overloads[types]
    for name, value in attributes.items():
        setattr(dispatcher, name, value)
    launcher = _cuda.KernelLauncher(dispatcher)
    with pytest.raises(punica_numba.FirstLaunchInCaptureError, match="_a_kernel_of_a_name_to"):
        launcher((3, 2, 4), 64, (x, 5))
    assert (compiled, dispatcher.launches, sent, launcher.kernels) == ([], [], [], {})
    capturing = False
    launcher((3, 2, 4), 64, (x, 5))  # the warm-up: compiles (and launches)
    capturing = True
    launcher((3, 2, 4), 64, (x, 5))  # captured
    assert len(dispatcher.launches) + len(sent) == 2


def _a_kernel_of_a_name_to_find():
    """(A kernel's Python function, for a message to name.)"""


def _a_fill_never_launched():
    """A kernel of this test's own, so that no other test in the process launched it first:
    ``out[:] = value`` (waiting first, as every kernel launched dependently must)."""
    from punica_numba.kernels.dependent_launch import prologue

    begin = prologue()

    @_cuda.jit_kernel(32)
    def fill_for_the_capture_test(out, value):
        begin()
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = value

    return _cuda.KernelLauncher(fill_for_the_capture_test)


@pytest.mark.gpu
def test_a_first_launch_inside_a_real_capture_is_refused_and_the_capture_stays_usable():
    """On a GPU: inside ``torch.cuda.graph`` a kernel's first launch raises
    ``FirstLaunchInCaptureError`` (not the driver's error of an invalidated capture), the
    capture ends cleanly, holding what was captured before it (an engine's other kernels:
    here one of torch's, so that the graph is not empty, which torch warns of), and after
    one launch outside (a warm-up) the same call is captured and its graph replays it."""
    launcher = _a_fill_never_launched()
    out, before = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
    refused = torch.cuda.CUDAGraph()
    with pytest.raises(punica_numba.FirstLaunchInCaptureError, match="fill_for_the_capture"):
        with torch.cuda.graph(refused):
            before.fill_(7.0)
            launcher((2, 1, 1), 32, (out, np.float32(1.0)))
    torch.cuda.synchronize()
    assert not bool(out.any()) and not bool(before.any())  # nothing ran
    refused.replay()  # the capture ended cleanly: what it holds replays, and only that
    torch.cuda.synchronize()
    assert bool((before == 7).all()) and not bool(out.any())
    launcher((2, 1, 1), 32, (out, np.float32(2.0)))  # the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher((2, 1, 1), 32, (out, np.float32(3.0)))
    torch.cuda.synchronize()
    assert bool((out == 2).all())  # (a capture runs nothing)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 3).all())


@pytest.mark.gpu
def test_the_launcher_sees_torchs_current_stream():
    """The launcher reads torch's current stream through a fast path; it must be the
    stream torch itself reports, also inside a ``torch.cuda.stream`` context."""
    assert _cuda._current_stream_handle() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _cuda._current_stream_handle() == side.cuda_stream
    assert _cuda._current_stream_handle() == torch.cuda.current_stream().cuda_stream


# -- 4. recorded launches, replayed -----------------------------------------------------------


def _stub_driver(monkeypatch) -> list:
    """The launcher's GPU path on any machine: return the list that the stubbed driver
    appends each launch to, as ``(config, kernel, raw parameters)``. A replayed launch
    (:class:`~punica_numba._cuda.ReadyLaunch`) is read back from the memory its
    parameter pointers point at, as the driver would read it."""
    sent = []
    monkeypatch.setattr(_cuda, "SIMULATOR", False)
    monkeypatch.setattr(_cuda, "launch_stream", lambda: 0)
    monkeypatch.setattr(_cuda, "_core_stream", lambda: "stream", raising=False)
    monkeypatch.setattr(_cuda, "_current_stream_handle", lambda: "stream", raising=False)
    monkeypatch.setattr(_cuda, "_core_launch_config", lambda g, b, shared=0: (g, b), raising=False)
    monkeypatch.setattr(_cuda, "_function_of", lambda kernel: kernel, raising=False)
    monkeypatch.setattr(
        _cuda,
        "_core_launch",
        lambda stream, config, kernel, *raw: sent.append((config, kernel, raw)),
        raising=False,
    )

    def driver_launch(stream, ready):
        assert stream == "stream"
        pointers = (ctypes.c_void_p * len(ready.values)).from_address(ready.params)
        # (read now, as the driver copies them at the launch)
        raw = tuple(type(v).from_address(p).value for v, p in zip(ready.values, pointers))
        sent.append(((ready.grid, ready.block), ready.function, raw))

    monkeypatch.setattr(_cuda, "_driver_launch", driver_launch, raising=False)
    # A record replays as one CUDA graph outside a stream capture: here a graph is the
    # launches it was made of, each sent as the driver would run it.
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: False, raising=False)
    monkeypatch.setattr(_cuda, "_graph_of", tuple, raising=False)

    def graph_launch(graph):
        for ready in graph:
            driver_launch("stream", ready)

    monkeypatch.setattr(_cuda, "_graph_launch", graph_launch, raising=False)
    return sent


_NUMBA_TYPES = {int: nt.int64, np.float32: nt.float32, bool: nt.boolean}


def _note_scalars(self, key, grid, block, args):
    """``KernelLauncher._compile_and_launch`` without Numba: 'compiles' the dispatcher
    into itself, noting where the scalars sit as the real one does, then launches."""
    _cuda._not_replayable()
    scalars, index = [], 0
    for a in _cuda._unpacked(args):
        if isinstance(a, torch.Tensor):
            index += 5 + 2 * a.dim()
        else:
            scalars.append((index, _cuda._c_type(_NUMBA_TYPES[type(a)])))
            index += 1
    self._compiled[key] = (self.dispatcher, tuple(scalars))
    self(grid, block, args)


@pytest.fixture
def gpu_path(monkeypatch):
    """The ops and the wrapper on their GPU path, with the driver stubbed out (nothing is
    computed; the sent launches are yielded). Make the wrapper inside the test: its
    metadata keeps tile tables for the GPU's configurations."""
    sent = _stub_driver(monkeypatch)
    for module in (operands, launching, launch):
        monkeypatch.setattr(module, "SIMULATOR", False)
    monkeypatch.setattr(_cuda.KernelLauncher, "_compile_and_launch", _note_scalars)
    launching.launcher_of.cache_clear()  # launchers that never compiled for real are not kept
    yield sent
    launching.launcher_of.cache_clear()


RT, RH, RR, RN = 16, 16, 4, 8  # tokens (enough for the heuristic to change its mind), H, r, N
SPREAD = [t % 3 for t in range(RT)]  # tokens on every slot: row kernels, a token per block


def _replay_setup(slices: int) -> dict:
    """A wrapper and an add_lora_linear call for it, as a dict a test may change."""
    wrapper = PunicaWrapperNumba(RT, 4, DEVICE, max_loras=L)
    _map(wrapper, SPREAD)
    call = dict(
        y=_weight(RT, RN * slices),
        x=_weight(RT, RH),
        lora_a_stacked=tuple(_weight(L, 1, RR, RH) for _ in range(slices)),
        lora_b_stacked=tuple(_weight(L, 1, RN, RR) for _ in range(slices)),
        lora_bias_stacked=None,
        scale=0.5,
        output_slices=(RN,) * slices,
        buffer=_weight(slices, RT, RR),  # given, so that its address is the test's to choose
    )
    return dict(wrapper=wrapper, call=call)


def _map(wrapper: PunicaWrapperNumba, slots) -> None:
    ids = [11 + s if s >= 0 else 0 for s in slots]
    wrapper.update_metadata(LoRAMapping(ids, ids), [11, 12, 13], L + 1, 32, 0)


def _run(state: dict) -> None:
    state["wrapper"].add_lora_linear(**state["call"])


def _sent_by(sent: list, call) -> list:
    """What ``call()`` sends, with each scalar's value for its C object."""
    sent.clear()
    call()
    return [
        (config, kernel, tuple(getattr(p, "value", p) for p in raw)) for config, kernel, raw in sent
    ]


def _forget_records(call: dict) -> None:
    """Drop what the call's weights remember, so that the next call is prepared afresh."""
    for w in (*call["lora_a_stacked"], *call["lora_b_stacked"]):
        check_stack("w", w).launch.pop("shrink_then_expand", None)


def _replace_last(name: str, shape: tuple):
    """Give the last slice of ``call[name]`` another tensor."""

    def change(state):
        old = state["call"][name]
        state["call"][name] = (*old[:-1], _weight(*shape))

    return change


def _elsewhere(t: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """A copy of ``t`` at another address, aligned as ``t`` is modulo 256 bytes (as the
    GPU's allocator aligns every tensor it hands out), or ``shift`` elements past that."""
    step = t.element_size()
    memory = torch.empty(t.numel() + 256 // step + shift, dtype=t.dtype, device=t.device)
    skip = (t.data_ptr() - memory.data_ptr()) % 256 // step + shift
    moved = memory[skip : skip + t.numel()].view(t.shape)
    moved.copy_(t)
    assert (moved.data_ptr() - t.data_ptr()) % 256 == shift * step
    return moved


def _change_b_in_place(state):
    state["call"]["lora_b_stacked"][-1].data = _weight(L, 1, RN, RR)


def _another_wrapper(state):
    state["wrapper"] = PunicaWrapperNumba(RT, 4, DEVICE, max_loras=L)
    _map(state["wrapper"], SPREAD)


def _buffer_read_another_way(state):
    buffer = state["call"]["buffer"]
    if buffer.shape[0] != 1:
        pytest.skip("only a lone slice leaves a stride free (a dimension of size 1)")
    state["call"]["buffer"] = buffer.as_strided(buffer.shape, (7, *buffer.stride()[1:]))


def _the_wrappers_own_buffer_there(state):
    """No buffer given: the wrapper's own, which the shrink stores into rather than adds
    to, at the address where the given one was."""
    buffer = state["call"]["buffer"]
    state["call"]["buffer"] = None
    return mock.patch.object(wrapper_module, "_new_buffer", lambda *shape, device, one_slot: buffer)


def _force_another_shrink(state):
    chosen = choose_launch_config("shrink", RT, 3)
    return force_launch_config("shrink", next(c for c in launch_configs("shrink") if c != chosen))


CHANGES = {
    "nothing": lambda state: None,
    "x at another address": lambda state: state["call"].update(x=_elsewhere(state["call"]["x"])),
    "y at another address": lambda state: state["call"].update(y=_elsewhere(state["call"]["y"])),
    "buffer at another address": lambda state: state["call"].update(
        buffer=_elsewhere(state["call"]["buffer"])
    ),
    # The same memory, read another way: x's layout is all fixed by the checks.
    "y read another way": lambda state: state["call"].update(
        y=state["call"]["y"].view(torch.float16)
    ),
    "buffer read another way": _buffer_read_another_way,
    "the wrapper's own buffer at the given one's address": _the_wrappers_own_buffer_there,
    "another scale": lambda state: state["call"].update(scale=0.25),
    "another A": _replace_last("lora_a_stacked", (L, 1, RR, RH)),
    "another B": _replace_last("lora_b_stacked", (L, 1, RN, RR)),
    "B given new data in place": _change_b_in_place,
    # Every token on one slot: tiles of 4 tokens (another kernel, another tile table).
    "a mapping of another shape": lambda state: _map(state["wrapper"], [1] * RT),
    "another wrapper (its own metadata)": _another_wrapper,
    "a forced configuration": _force_another_shrink,
}


@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("change", CHANGES)
def test_a_replayed_call_sends_what_a_fresh_call_sends(gpu_path, monkeypatch, change, slices):
    """After any change, the next call sends exactly what it sends once every record is
    forgotten; with no change, it replays (prepares nothing)."""
    state = _replay_setup(slices)
    for _ in range(3):  # compiles; the same call again (recorded); and again (replayed)
        _run(state)
    prepared = []
    real = wrapper_module.shrink_launch
    monkeypatch.setattr(wrapper_module, "shrink_launch", lambda *a: prepared.append(a) or real(*a))
    with CHANGES[change](state) or contextlib.nullcontext():
        again = _sent_by(gpu_path, lambda: _run(state))
        _forget_records(state["call"])
        fresh = _sent_by(gpu_path, lambda: _run(state))
    assert len(fresh) == 2  # shrink and expand
    assert again == fresh
    replayed = change == "nothing" or change in MOVES  # (a move: the record, moved)
    assert len(prepared) == (1 if replayed else 2)


#: The changes after which a call is its record with the pointers moved.
MOVES = ("x at another address", "y at another address", "buffer at another address")


@pytest.mark.parametrize("offset", [1, 4, 16])
@pytest.mark.parametrize("name", ["x", "y", "buffer"])
def test_a_call_moved_to_another_alignment_is_prepared_afresh(gpu_path, monkeypatch, name, offset):
    """A record is moved only to addresses of the same alignment (modulo 256 bytes): a
    launch may load 16 bytes at once where its rows start at a multiple of 16."""
    state = _replay_setup(1)
    for _ in range(3):  # compiles; recorded; replayed
        _run(state)
    state["call"][name] = _elsewhere(state["call"][name], shift=offset)
    prepared = []
    real = wrapper_module.shrink_launch
    monkeypatch.setattr(wrapper_module, "shrink_launch", lambda *a: prepared.append(a) or real(*a))
    again = _sent_by(gpu_path, lambda: _run(state))
    _forget_records(state["call"])
    fresh = _sent_by(gpu_path, lambda: _run(state))
    assert again == fresh and len(prepared) == 2


def test_a_moved_call_leaves_its_record_as_it_was(gpu_path, monkeypatch):
    """After calls at other addresses, the call at the recorded ones replays what it
    sent before: the moved pointers were the moved launches' only."""
    state = _replay_setup(1)
    for _ in range(3):  # compiles; recorded; replayed
        _run(state)
    before = _sent_by(gpu_path, lambda: _run(state))
    call = state["call"]
    elsewhere = {**call, "x": _elsewhere(call["x"]), "y": _elsewhere(call["y"])}
    moved = _sent_by(gpu_path, lambda: _run({**state, "call": elsewhere}))
    assert moved != before
    assert _sent_by(gpu_path, lambda: _run(state)) == before


def test_a_record_whose_pointers_cannot_be_told_apart_is_not_moved(monkeypatch):
    """Two caller tensors at one address: which one a pointer stands for is unknown."""
    sent, launcher, x, w, packed = _record_setup(monkeypatch)
    with LaunchRecord((x, x[:1])) as record:
        launcher((2, 1, 1), 32, (x, packed, 3))
    assert record.replayable and record.moving is None
    with pytest.raises(RuntimeError, match="other addresses"):
        record.replay_at((x.clone(), x.clone()))


def test_a_moved_record_points_at_the_new_tensors(monkeypatch):
    sent, launcher, x, w, packed = _record_setup(monkeypatch)
    with LaunchRecord((x,)) as record:
        launcher((2, 1, 1), 32, (x, packed, 3))
    other = _elsewhere(x)
    moved = _sent_by(sent, lambda: record.replay_at((other,)))
    fresh = _sent_by(sent, lambda: launcher((2, 1, 1), 32, (other, packed, 3)))
    assert moved == fresh and other.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("own", [False, True], ids=["given buffer", "own buffer"])
def test_a_call_recorded_again_after_a_change_is_replayed_from_then_on(gpu_path, monkeypatch, own):
    """A call at the same addresses whose scale changed misses its record and is
    recorded again (with a new buffer where the wrapper's own is used): the next call
    replays the new record and prepares nothing."""
    state, made, counting = _own_buffer_setup() if own else (_replay_setup(1), [], None)
    with counting or contextlib.nullcontext():
        for _ in range(3):  # compiles; recorded; replayed
            _run(state)
        state["call"]["scale"] = 0.25
        _run(state)  # recorded again
        prepared = []
        real = wrapper_module.shrink_launch
        monkeypatch.setattr(
            wrapper_module, "shrink_launch", lambda *a: prepared.append(a) or real(*a)
        )
        made.clear()
        again = _sent_by(gpu_path, lambda: _run(state))
    assert len(again) == 2 and prepared == [] and made == []


def test_calls_that_come_back_in_turns_are_replayed(gpu_path, monkeypatch):
    """A buffer at one of two addresses in turn (as an allocator may place it): the call is
    recorded once, then replayed at the addresses it was recorded at and moved to the
    others."""
    state = _replay_setup(1)
    buffers = [state["call"]["buffer"], state["call"]["buffer"].clone()]
    for buffer in buffers * 3:  # compiles, recorded at the second, moved to the first
        _run({**state, "call": {**state["call"], "buffer": buffer}})
    prepared = []
    real = wrapper_module.shrink_launch
    monkeypatch.setattr(wrapper_module, "shrink_launch", lambda *a: prepared.append(a) or real(*a))
    for buffer in buffers * 2:
        _run({**state, "call": {**state["call"], "buffer": buffer}})
    assert prepared == []


def _own_buffer_setup(rows: int = RT):
    """A call that gives no buffer (the wrapper's own), and a list of the own buffers
    it allocates."""
    state = _replay_setup(1)
    state["call"]["buffer"] = None
    state["call"]["x"] = _weight(rows, RH)
    state["call"]["y"] = _weight(rows, RN)
    made = []
    real = wrapper_module._new_buffer

    def counted(*shape, device, one_slot):
        made.append(real(*shape, device=device, one_slot=one_slot))
        return made[-1]

    return state, made, mock.patch.object(wrapper_module, "_new_buffer", counted)


def test_a_replayed_call_keeps_its_own_small_buffer(gpu_path):
    """A recorded call that gives no buffer keeps the one it was recorded with, and its
    replays allocate none: they send what a freshly prepared call with that buffer
    sends."""
    state, made, counting = _own_buffer_setup()
    with counting:
        for _ in range(3):  # compiles; recorded; replayed
            _run(state)
        recorded = made[-1]
        made.clear()
        again = _sent_by(gpu_path, lambda: _run(state))
        assert made == []
        _forget_records(state["call"])
        again_buffer = mock.patch.object(
            wrapper_module, "_new_buffer", lambda *shape, device, one_slot: recorded
        )
        with again_buffer:
            fresh = _sent_by(gpu_path, lambda: _run(state))
    assert len(fresh) == 2 and again == fresh


def test_a_replay_with_its_own_buffer_reads_the_capture_state_once(gpu_path, monkeypatch):
    """Whether the stream is being captured is read once per replayed call (0.3-0.7 µs
    a read on the H200's host): where the call keeps its own buffer it was read to choose
    the buffer, and the replay is told, not made to read it again."""
    state, made, counting = _own_buffer_setup()
    with counting:
        for _ in range(3):  # compiles; recorded; replayed
            _run(state)
        reads = []
        monkeypatch.setattr(_cuda, "_stream_capturing", lambda: reads.append(1) or False)
        again = _sent_by(gpu_path, lambda: _run(state))
    assert len(again) == 2 and len(reads) == 1


@pytest.mark.parametrize("where", ["in a capture", "on another stream", "too large to keep"])
def test_an_own_buffer_is_kept_only_where_it_is_safe_and_small(gpu_path, monkeypatch, where):
    """Inside someone's capture the buffer must come from the capture's memory, so each
    call allocates one; a record's buffer is not used on another stream, whose calls
    may run beside the recorded stream's; nor is one over ``KEPT_BUFFER_BYTES`` kept."""
    rows = RT
    if where == "too large to keep":
        monkeypatch.setattr(wrapper_module, "KEPT_BUFFER_BYTES", 4 * RT * RR - 1)
    state, made, counting = _own_buffer_setup(rows)
    with counting:
        for _ in range(3):  # compiles; recorded; replayed
            _run(state)
        if where == "in a capture":
            monkeypatch.setattr(_cuda, "_stream_capturing", lambda: True)
        elif where == "on another stream":
            monkeypatch.setattr(_cuda, "_current_stream_handle", lambda: "another stream")
        made.clear()
        _run(state)
    assert len(made) == 1


def test_a_weight_remembers_a_few_calls(gpu_path):
    """Calls of as many keys (here scales) and addresses: each is recorded, and the weight
    keeps the latest few by addresses and by key."""
    state = _replay_setup(1)
    calls = 3 * wrapper_module.REPLAYS_PER_WEIGHT
    xs = [_elsewhere(state["call"]["x"]) for _ in range(calls)]  # (all alive: new addresses)
    for k, x in enumerate(xs):
        _run({**state, "call": {**state["call"], "x": x, "scale": 1.0 + k}})
    launched = check_stack("w", state["call"]["lora_a_stacked"][0]).launch["shrink_then_expand"]
    assert len(launched["where"]) == len(launched["key"]) == wrapper_module.REPLAYS_PER_WEIGHT
    scales = [float.fromhex(replay.key[-3]) for replay in launched["key"].values()]
    assert scales == [1.0 + k for k in range(calls - wrapper_module.REPLAYS_PER_WEIGHT, calls)]


@pytest.mark.skipif(not _cuda.SIMULATOR, reason="the engine on the CPU, its launches stubbed")
def test_an_engines_eager_passes_prepare_each_call_once(gpu_path, monkeypatch, tmp_path):
    """The engine's eager passes allocate their activations anew, and an allocator need
    not hand out the same addresses again (the CPU's does not; the H200's did not for the
    demo's prefill): after a first pass of each kind, every LoRA call is a record made
    again, most at other addresses, and none is prepared."""
    for module in (demo, engine_module):
        monkeypatch.setattr(module, "device_of", lambda: torch.device("cpu"))
    # The CPU's allocator aligns to 64 bytes where the GPU's aligns to 512: as if on the GPU.
    monkeypatch.setattr(wrapper_module, "_ALIGNMENTS", 64)
    args = demo._parser(demo.DEFAULTS[True]).parse_args([])
    setup = demo.build(args, tmp_path, torch.Generator().manual_seed(0))
    engine, requests = setup.engine, setup.requests
    engine.use_cuda_graphs = False
    ids, lengths = [r.adapter_id for r in requests], [len(r.prompt) for r in requests]
    state = engine._state(engine._bucket(len(requests)))
    made = collections.Counter()
    real_launch, real_move = wrapper_module.shrink_launch, LaunchRecord.replay_at
    monkeypatch.setattr(
        wrapper_module, "shrink_launch", lambda *a: made.update(["prepared"]) or real_launch(*a)
    )
    monkeypatch.setattr(
        LaunchRecord, "replay_at", lambda r, t: made.update(["moved"]) or real_move(r, t)
    )

    def passes() -> None:
        engine._prepare(ids, lengths, prefill=True)
        engine._prefill(requests, state, None, None)
        engine._prepare(ids, [1] * len(requests), prefill=False)
        for _ in range(2):
            engine._decode_step(state)

    for _ in range(2):
        passes()
    made.clear()
    for _ in range(3):
        passes()
    assert made["prepared"] == 0 and made["moved"] > 0


def test_a_call_rejected_after_replays_sends_nothing(gpu_path):
    state = _replay_setup(1)
    for _ in range(3):
        _run(state)
    state["call"]["lora_b_stacked"][0].transpose_(-1, -2)
    with pytest.raises(ValueError, match=r"lora_b_stacked\[0\]"):
        _sent_by(gpu_path, lambda: _run(state))
    assert gpu_path == []


@pytest.mark.skipif(not _cuda.SIMULATOR, reason="on a GPU the second call is recorded and kept")
def test_the_simulator_keeps_no_record():
    """Simulator launches take numpy views, not raw parameters: nothing to replay."""
    wrapper = _wrapper()
    y, x, a, b = _linear_args()
    buffer = _weight(1, T, R)  # given, so that both calls have it at one address
    for _ in range(2):  # each is recorded, but not kept
        wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,), buffer=buffer)
    launched = check_stack("w", a[0]).launch["shrink_then_expand"]
    assert launched == {"where": {}, "key": {}}


def _record_setup(monkeypatch):
    """A launcher on the stubbed GPU path, compiled for ``(x, packed w, int)``."""
    sent = _stub_driver(monkeypatch)
    x, w = torch.randn(4, 8), torch.randn(3, 2, 8)
    types = (nt.Array(nt.float32, 2, "C"), nt.Array(nt.float32, 3, "C"), nt.int32)
    launcher = _cuda.KernelLauncher(_FakeDispatcher(types))
    packed = pack_tensors((w,))
    launcher((2, 1, 1), 32, (x, packed, 3))  # compiles
    return sent, launcher, x, w, packed


def test_a_record_replays_its_launches(monkeypatch):
    sent, launcher, x, w, packed = _record_setup(monkeypatch)
    with LaunchRecord((x,)) as record:
        fresh = _sent_by(sent, lambda: launcher((2, 1, 1), 32, (x, packed, 3)))
    assert record.replayable and record.described == [packed]
    assert _sent_by(sent, record.replay) == fresh
    assert record.graph is not None  # made at the first replay, and kept
    assert _sent_by(sent, record.replay) == fresh


def test_a_record_replayed_under_a_capture_launches_one_by_one(monkeypatch):
    """Inside someone's stream capture a record makes no graph of its own: its launches
    go to the driver one by one, into the graph being captured."""
    sent, launcher, x, w, packed = _record_setup(monkeypatch)
    with LaunchRecord((x,)) as record:
        fresh = _sent_by(sent, lambda: launcher((2, 1, 1), 32, (x, packed, 3)))
    monkeypatch.setattr(_cuda, "_stream_capturing", lambda: True)
    monkeypatch.setattr(_cuda, "_graph_of", lambda launches: pytest.fail("a graph was made"))
    assert _sent_by(sent, record.replay) == fresh
    assert record.graph is None


@pytest.mark.parametrize(
    "launch", ["a compiling launch", "a first description", "memory not the caller's"]
)
def test_a_record_that_could_point_at_stale_memory_is_not_replayable(monkeypatch, launch):
    sent, launcher, x, w, packed = _record_setup(monkeypatch)
    with LaunchRecord((x,)) as record:
        if launch == "a compiling launch":  # (another scalar type: another overload)
            launcher((2, 1, 1), 32, (x, packed, np.float32(3)))
        elif launch == "a first description":  # (a temporary, say, described now)
            launcher((2, 1, 1), 32, (x, pack_tensors((w.clone(),)), 3))
        else:
            launcher((2, 1, 1), 32, (x.clone(), packed, 3))
    assert not record.replayable


def _bf16_linear_args(slices: int) -> tuple:
    """y (zeros), x and the LoRA stacks of a bf16 ``add_lora_linear`` call on the GPU."""
    y = torch.zeros(T, N * slices, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    a = tuple(torch.randn(L, 1, R, H, device=DEVICE).to(torch.bfloat16) for _ in range(slices))
    b = tuple(torch.randn(L, 1, N, R, device=DEVICE).to(torch.bfloat16) for _ in range(slices))
    return y, x, a, b


@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 3])
def test_a_replay_with_its_own_buffer_adds_what_a_fresh_call_adds(slices):
    """On the GPU: a call that gives no buffer, replayed as a graph with the buffer its
    record keeps, adds the bits of a freshly prepared call, call after call."""
    wrapper = _wrapper()
    y, x, a, b = _bf16_linear_args(slices)
    added = []
    for _ in range(6):  # compiles, recorded, replayed (the graph made), again, again, again
        y.zero_()
        wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,) * slices)
        added.append(y.clone())
    assert added[0].abs().sum() > 0
    assert all(torch.equal(y, added[0]) for y in added)
    replays = check_stack("w", a[0]).launch["shrink_then_expand"]["where"].values()
    (replay,) = [r for r in replays if r.record is not None]
    assert replay.buffer is not None and replay.record.graph is not None


@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 3])
def test_a_replayed_call_adds_what_a_fresh_call_adds(monkeypatch, slices):
    """On the GPU, for real: once a call is replayed (its launches, from parameters laid
    out once, as one CUDA graph; inside a caller's capture one by one, into the caller's
    graph), it adds the very bits a freshly prepared call adds, and each laid-out value
    has the size the compiled kernel takes for its parameter."""
    wrapper = _wrapper()
    y, x, a, b = _bf16_linear_args(slices)
    buffer = torch.zeros(slices, T, R, device=DEVICE)  # given: at one address, in a capture too

    def add() -> None:
        y.zero_(), buffer.zero_()
        wrapper.add_lora_linear(y, x, a, b, None, 0.5, (N,) * slices, buffer=buffer)

    def added() -> torch.Tensor:
        add()
        return y.clone()

    fresh = added()  # compiles
    assert fresh.abs().sum() > 0
    driven, graphs = [], []
    real, real_graph = _cuda._driver_launch, _cuda._graph_launch
    monkeypatch.setattr(_cuda, "_driver_launch", lambda *args: driven.append(real(*args)))
    monkeypatch.setattr(_cuda, "_graph_launch", lambda g: graphs.append(real_graph(g)))
    for _ in range(4):  # recorded, replayed (the graph made), again, again
        driven.clear(), graphs.clear()
        assert torch.equal(added(), fresh)
    assert len(driven) == 0 and len(graphs) == 1  # the last call: one graph launch
    # Replayed inside a capture of the caller's own, the launches go into that graph.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add()
    assert len(driven) == 2 and len(graphs) == 1  # shrink and expand, one by one
    y.fill_(1.0)
    graph.replay()
    assert torch.equal(y, fresh)
    replays = check_stack("w", a[0]).launch["shrink_then_expand"]["where"].values()
    (replay,) = [r for r in replays if r.record is not None]
    for ready in replay.record.launches:
        sizes = [size for _offset, size in ready.kernel.arguments_info]
        assert [ctypes.sizeof(v) for v in ready.values] == sizes
    # A launch the driver refuses (an empty grid) is an error, not a silent no-op.
    empty = _cuda.ReadyLaunch((0, 1, 1), ready.block, ready.kernel, list(ready.values))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel(Ex)? failed"):
        real(_cuda._current_stream_handle(), empty)


@pytest.mark.gpu
@pytest.mark.parametrize("own", [False, True], ids=["given buffer", "own buffer"])
def test_a_moved_call_adds_what_a_fresh_call_adds(monkeypatch, own):
    """On the GPU: once a call is recorded, the same call with x, y (and the buffer) at
    new addresses each time is made from the record with its pointers moved, eagerly
    and inside a caller's capture, and adds the bits a freshly prepared call adds."""
    wrapper = _wrapper()
    y, x, a, b = _bf16_linear_args(3)

    def add(x, buffer, out=None) -> torch.Tensor:
        out = torch.zeros_like(y) if out is None else out.zero_()
        if buffer is not None:
            buffer.zero_()
        wrapper.add_lora_linear(out, x, a, b, None, 0.5, (N,) * 3, buffer=buffer)
        return out

    def new_buffer():
        return None if own else torch.zeros(3, T, R, device=DEVICE)

    buffer = new_buffer()
    fresh = add(x, buffer, y).clone()  # compiles
    assert fresh.abs().sum() > 0
    for _ in range(2):  # recorded; replayed
        assert torch.equal(add(x, buffer, y), fresh)
    moved = []
    real = _cuda.LaunchRecord.replay_at
    monkeypatch.setattr(_cuda.LaunchRecord, "replay_at", lambda r, t: moved.append(real(r, t)))
    alive = []  # (kept, so that no call gets the memory of one before)
    for _ in range(3):
        alive.append((x.clone(), new_buffer(), torch.empty_like(y)))
        assert torch.equal(add(*alive[-1]), fresh)
    assert len(moved) == 3
    inputs, buffer = x.clone(), new_buffer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add(inputs, buffer)
    # (a buffer of the wrapper's own comes from the capture's memory: another call)
    assert len(moved) == (3 if own else 4)
    out.fill_(1.0)
    graph.replay()
    assert torch.equal(out, fresh)


def test_records_do_not_nest():
    with LaunchRecord(()):
        with pytest.raises(RuntimeError, match="recorded already"):
            LaunchRecord(()).__enter__()
    assert _cuda._recording.record is None
