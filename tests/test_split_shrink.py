"""The split-K shrink (``kernel="split"``, :mod:`punica_numba.kernels.shrink_split`).

K is cut into ``splits`` chunks, a block each, and the last block of each (tile, slice,
rank group) adds the chunks' sums in order. Checked here:

1. against the float64 reference, over drawn problems, hidden sizes, chunk counts, tiles,
   ranks, slices and dtypes, added into nonzero buffers or stored (``accumulate``);
2. the same bits run after run and under configurations of one arithmetic key, and every
   counter back at 0 after a call (so that the next launch and a graph replay work);
3. the workspace: cached per device, grown only when a call needs more; a capture on a
   stream without one takes counters made zero before it (no fill in the graph);
4. the heuristic: on the GPU it leaves the split to the tuner (the H200's table had the
   row shrink faster at every down projection measured), and never takes it at K=4096;
5. on the GPU: a CUDA graph of it replays right;
6. the tensor-core shrink split the same way (``kernel="mma"`` with ``splits`` > 1,
   :mod:`punica_numba.kernels.shrink_mma_split`): against the reference, its bits
   under one key, its counters, and a CUDA graph of it on the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import launch, lora_shrink, reference
from punica_numba.kernels import shrink_split
from punica_numba.launch import LaunchConfig, choose_launch_config, force_launch_config
from punica_numba.ops import prepare_shrink
from punica_numba.ops.checks import check_shrink as check_shrink_arguments
from punica_numba.ops.launching import shrink_launch

from .op_cases import Problem, ShrinkCase, check_shrink, shrink_cases
from .strategies import DEVICE, LARGE, Limits

#: Drawn sizes: on the simulator a launch of up to 8 tiles x 3 slices x 3 rank groups x 3
#: chunks of 16 threads (a few thousand Python threads); on the GPU real hidden sizes.
LIMITS = (
    Limits(tokens=64, hidden=16384, rank=64, loras=8, width=0)
    if LARGE
    else Limits(tokens=8, hidden=48, rank=6, loras=3, width=0)
)
THREADS = (64, 128) if not launch.SIMULATOR else (8, 16)
MAX_SPLITS = 8 if LARGE else 3


def _table() -> dict:
    return launch._SIMULATOR_CONFIGS if launch.SIMULATOR else launch._GPU_CONFIGS


def _split_configs() -> list[LaunchConfig]:
    return [c for c in launch.launch_configs("shrink") if c.kernel == "split"]


@contextlib.contextmanager
def forced(config: LaunchConfig, op: str = "shrink"):
    """Within it, every call of ``op`` runs ``config`` where the call allows it (added to this
    machine's table for the while, so that ``force_launch_config`` takes it)."""
    table = _table()
    configs = table[op] if config in table[op] else (*table[op], config)
    with mock.patch.dict(table, {op: configs}), force_launch_config(op, config):
        yield


def split_config(threads: int, tile_m: int, tile_n: int, splits: int) -> LaunchConfig:
    """A split shrink the heuristic never picks (forced only)."""
    return LaunchConfig(
        "split", threads, tile_m, tile_n, splits=splits, from_hidden=1 << 40, to_tiles=0
    )


@st.composite
def split_configs(draw) -> LaunchConfig:
    threads = draw(st.sampled_from(THREADS), label="threads")
    tile_m = draw(st.sampled_from((1, 2, 4) if LARGE else (1, 2)), label="tile_m")
    tile_n = draw(st.sampled_from((2, 4)), label="tile_n")
    splits = draw(st.integers(1, MAX_SPLITS), label="splits")
    return split_config(threads, tile_m, tile_n, splits)


def stored_shrink(*args) -> None:
    """``lora_shrink``'s signature, launched with ``accumulate=False`` (as the wrapper
    does into a buffer it made for the call): the products stored, not added."""
    call = check_shrink_arguments(args[0], args[1], args[2], tuple(args[3:9]), None, args[9])
    if not call.idle:
        shrink_launch(call.inputs, call.weights, call.output, call.metadata, call.scaling, False)()


def counters_at_zero() -> bool:
    cached = shrink_split.cached_split_workspace(DEVICE)
    return cached is not None and not bool(cached[1].any())


# -- 1. against the reference ---------------------------------------------------------------


@given(shrink_cases(LIMITS), split_configs(), st.booleans())
def test_split_shrink_matches_reference(case, config, accumulate):
    """Forced, the split shrink is right at every drawn size (K shorter than the chunks
    included: some chunks then hold no word), added into a nonzero buffer or stored."""
    with forced(config):
        if accumulate:
            check_shrink(lora_shrink, case)
        else:
            check_shrink(stored_shrink, case, stores=True)
    assert counters_at_zero() or not any(s != -1 for s in case.problem.slots)


def test_more_slices_than_one_launch_covers():
    """Four slices take two launches, which use the workspace one after the other."""
    problem = Problem(slots=[1, 0, -1, 1, 1], prepared=5, num_loras=2, seed=21)
    case = ShrinkCase(problem, 20, 3, 4, 0, torch.bfloat16, torch.float32, 0.5, False)
    with forced(split_config(THREADS[-1], 2, 4, 3)):
        check_shrink(lora_shrink, case)
    assert counters_at_zero()


# -- 2. the same bits ------------------------------------------------------------------------


def _run(config: LaunchConfig, case: ShrinkCase) -> torch.Tensor:
    """The output of one checked run of ``case`` under ``config``."""
    outputs = []

    def shrink(*args):
        lora_shrink(*args)
        outputs.append(args[2].clone())

    with forced(config):
        check_shrink(shrink, case)
    return outputs[0]


def _assert_the_same_bits(first, twin, case) -> None:
    """``first`` run twice and ``twin`` once on ``case``: every arrival counter back at zero
    after them, and the three outputs the same bits."""
    runs = [_run(first, case), _run(first, case), _run(twin, case)]
    assert counters_at_zero()
    for got in runs[1:]:
        differ = got != runs[0]
        assert not bool(differ.any()), f"different bits at {torch.nonzero(differ)[0].tolist()}"


def test_the_same_bits_run_after_run_and_under_one_arithmetic_key():
    """No float atomics: the chunks' sums are added in order by whichever block comes last,
    so repeated runs give the same bits, and so do tiles and rank groups of other sizes
    under the same threads and chunks (one arithmetic key); after each call every counter
    is back at 0."""
    problem = Problem(slots=[0, 1, 1, -1, 0, 1, 1], prepared=7, num_loras=2, seed=3)
    case = ShrinkCase(problem, 45, 5, 2, 0, torch.float32, torch.float32, 0.5, False)
    threads = THREADS[-1]
    first = split_config(threads, 2, 4, 3)
    twin = split_config(threads, 1, 2, 3)
    assert first.arithmetic("shrink") == twin.arithmetic("shrink")
    assert first.arithmetic("shrink") != split_config(threads, 2, 4, 2).arithmetic("shrink")
    _assert_the_same_bits(first, twin, case)


def test_the_tables_split_configurations_share_their_key():
    """A machine's split configurations add the same sums (the GPU's two do: tiles of 1
    and of 4 tokens, 8 chunks each), and none shares a key with a row shrink."""
    for simulator in (True, False):
        with mock.patch.object(launch, "SIMULATOR", simulator):
            splits = _split_configs()
            others = [c for c in launch.launch_configs("shrink") if c.kernel != "split"]
        assert splits, simulator
        assert len({c.arithmetic("shrink") for c in splits}) == 1
        assert not {c.arithmetic("shrink") for c in splits} & {
            c.arithmetic("shrink") for c in others
        }
        assert all(launch.config_name(c).endswith(f"_k{c.splits}") for c in splits)


# -- 3. the workspace ------------------------------------------------------------------------


def test_the_workspace_is_cached_and_only_grows():
    """One pair of buffers per device, made zero, kept while calls fit it, grown by powers
    of two when one does not; the counters of a grown pair are zero too."""
    saved = dict(shrink_split._WORKSPACES)
    shrink_split.clear_split_workspaces()
    try:
        first = shrink_split.split_workspace(DEVICE, 8, 3, 32, 16, 40, 4)
        partials, counters = shrink_split.cached_split_workspace(DEVICE)
        assert partials.numel() >= 8 * 3 * 32 * 16 and counters.numel() >= 40 * 3 * 4
        assert not bool(counters.any()) and partials.dtype == torch.float32
        assert shrink_split.split_workspace(DEVICE, 2, 1, 4, 4, 2, 1) is first  # smaller
        grown = shrink_split.split_workspace(DEVICE, 8, 3, 1000, 64, 40, 4)
        assert grown is not first
        bigger, counters = shrink_split.cached_split_workspace(DEVICE)
        assert bigger.numel() >= 8 * 3 * 1000 * 64 and bigger.numel() & (bigger.numel() - 1) == 0
        assert counters.numel() >= 40 * 3 * 4 and not bool(counters.any())
        assert shrink_split.split_workspace(DEVICE, 8, 3, 32, 16, 40, 4) is grown
        with pytest.raises(ValueError, match="at most 3 slices"):
            shrink_split.split_workspace_sizes(2, 4, 1, 1, 1, 1)
    finally:
        shrink_split._WORKSPACES.clear()
        shrink_split._WORKSPACES.update(saved)


def test_a_workspace_outgrown_is_kept_for_the_graphs_that_hold_it():
    """Growing the cache drops its old pair from the cache, not from memory: a CUDA graph
    captured with the old pair may still replay."""
    saved = dict(shrink_split._WORKSPACES)
    shrink_split.clear_split_workspaces()
    try:
        shrink_split.split_workspace(DEVICE, 2, 1, 4, 4, 2, 1)
        old = shrink_split.cached_split_workspace(DEVICE)[0]
        shrink_split.split_workspace(DEVICE, 8, 3, 4000, 64, 40, 4)
        assert shrink_split.cached_split_workspace(DEVICE)[0] is not old
        assert any(kept[0] is old for kept in shrink_split._KEPT)
    finally:
        shrink_split._WORKSPACES.clear()
        shrink_split._WORKSPACES.update(saved)


def test_a_capture_on_a_stream_without_a_workspace_takes_the_spare_counters():
    """An eager call leaves a spare set of zero counters on its device; a graph capture on a
    stream with no workspace takes them (no fill in the graph) and caches the pair for its
    stream; a second such capture, with no spare left, makes counters of its own, for that
    launch alone. (The streams and the capture are mocked: this runs on the simulator too.)"""
    saved = dict(shrink_split._WORKSPACES), dict(shrink_split._SPARE_COUNTERS)
    shrink_split.clear_split_workspaces()
    device = torch.device(DEVICE)
    stream = [None]
    key = mock.patch.object(shrink_split, "_stream_key", lambda d: (device, stream[0]))
    try:
        with key:
            eager = shrink_split.split_workspace(DEVICE, 8, 3, 32, 16, 40, 4)
            spare = shrink_split._SPARE_COUNTERS[device]
            counters = shrink_split._WORKSPACES[(device, None)][1]
            assert spare is not counters and spare.numel() >= counters.numel()
            assert not bool(spare.any())
            stream[0] = "capture"
            with mock.patch.object(shrink_split, "_capturing", lambda: True):
                captured = shrink_split.split_workspace(DEVICE, 8, 3, 32, 16, 40, 4)
                assert captured is not eager
                assert shrink_split._WORKSPACES[(device, "capture")][1] is spare
                assert device not in shrink_split._SPARE_COUNTERS  # taken
                assert shrink_split.split_workspace(DEVICE, 2, 1, 4, 4, 2, 1) is captured
                stream[0] = "another capture"
                own = shrink_split.split_workspace(DEVICE, 2, 1, 4, 4, 2, 1)
                assert own is not captured and (device, "another capture") not in (
                    shrink_split._WORKSPACES
                )
            stream[0] = None
            assert shrink_split.split_workspace(DEVICE, 2, 1, 4, 4, 2, 1) is eager
    finally:
        shrink_split.clear_split_workspaces()
        shrink_split._WORKSPACES.update(saved[0])
        shrink_split._SPARE_COUNTERS.update(saved[1])


def test_a_prepared_launch_takes_its_workspace_when_it_runs():
    """Made ready, a split launch has taken no workspace yet; each run takes the one of
    the stream it runs on (so one made ready on one stream and run on another, a
    warm-up before a graph capture on a side stream, never shares the first's counters)."""
    config = split_config(THREADS[0], 1, 2, 2)
    meta = Problem(slots=[0, 0], prepared=2, num_loras=1, seed=0).meta()
    x = torch.randn(2, 8, device=DEVICE).to(torch.bfloat16)
    a = torch.randn(1, 2, 8, device=DEVICE).to(torch.bfloat16)
    out = torch.zeros(1, 2, 2, device=DEVICE)
    taken = mock.Mock(wraps=shrink_split.split_workspace)
    with forced(config), mock.patch("punica_numba.ops.launching.split_workspace", taken):
        launch_ = prepare_shrink(x, [a], out, *meta.meta_args(2), 1.0)
        assert launch_.config == config and taken.call_count == 0
        launch_()
        launch_()
    assert taken.call_count == 2
    want = reference.lora_shrink(x, [a], torch.zeros_like(out), torch.tensor([0, 0]), 2.0)
    assert torch.allclose(out.double().cpu(), want.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_each_stream_has_a_workspace_of_its_own():
    """Split shrinks side by side on two streams never share counters."""
    on_default = shrink_split.split_workspace("cuda", 2, 1, 4, 4, 2, 1)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        on_other = shrink_split.split_workspace("cuda", 2, 1, 4, 4, 2, 1)
        assert shrink_split.split_workspace("cuda", 2, 1, 4, 4, 2, 1) is on_other
    assert on_other is not on_default
    assert shrink_split.split_workspace("cuda", 2, 1, 4, 4, 2, 1) is on_default


# -- 4. the heuristic --------------------------------------------------------------------------


def _pick(T: int, loras: int, K: int, rank: int = 16, slices: int = 1) -> LaunchConfig:
    """The GPU heuristic's shrink for T tokens over ``loras`` LoRAs at hidden size K (the
    tuned tables left out: no dtype)."""
    with mock.patch.object(launch, "SIMULATOR", False):
        return choose_launch_config("shrink", T, loras, rank, True, slices, K=K, N=rank)


def _gpu_splits() -> list[LaunchConfig]:
    return [c for c in launch._GPU_CONFIGS["shrink"] if c.kernel == "split"]


@pytest.mark.parametrize("K", [11008, 14336])
@pytest.mark.parametrize("rank", [16, 32])
def test_the_heuristic_leaves_the_split_to_the_tuner(K, rank):
    """On the GPU the split configurations are timed by the tuner (they are among the
    shrink's configurations) but never the heuristic's pick: the H200's tuned table had
    the row shrink faster at every down projection measured. Where their thresholds
    would take them (T=32 over 8 LoRAs: tiles of 4; a token a slot: tiles of 1), the
    rows keep the call; each is still forced when asked."""
    splits = _gpu_splits()
    assert {c.tile_m for c in splits} == {1, 4} and all(c.tuned_only for c in splits)
    for T, loras in ((32, 8), (1, 1), (16, 16), (32, 32)):
        assert _pick(T, loras, K, rank).kernel == "rows", (T, loras)
    with mock.patch.object(launch, "SIMULATOR", False):
        for config in splits:
            with force_launch_config("shrink", config):
                assert choose_launch_config("shrink", 32, 8, rank, True, K=K, N=rank) == config


@pytest.mark.parametrize("T, loras", [(1, 1), (16, 16), (32, 8), (64, 8), (256, 256), (256, 16)])
def test_the_heuristic_keeps_the_rows_at_decode_shapes(T, loras):
    """At K=4096 (where the row shrink was measured best) the split is never picked, nor
    without a K; at a long K, not where the tiles are many (the row shrink's blocks fill
    the GPU) or the tokens per slot many."""
    assert _pick(T, loras, 4096).kernel != "split"
    with mock.patch.object(launch, "SIMULATOR", False):
        assert choose_launch_config("shrink", T, loras, 16, True).kernel != "split"
    assert _pick(256, 256, 14336).kernel != "split"  # 256 tiles
    assert _pick(256, 16, 14336).kernel != "split"  # 16 tokens a slot


def test_the_op_takes_the_split_where_the_simulator_table_says():
    """Through the op (no forcing), the simulator's table picks its split where K is long
    and the tokens few, and the call is right."""
    if not launch.SIMULATOR:
        pytest.skip("the simulator's table")
    problem = Problem(slots=[0, 2, 1, -1], prepared=4, num_loras=3, seed=8)
    case = ShrinkCase(problem, 40, 5, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
    chosen = []

    def shrink(*args):
        launch_ = prepare_shrink(*args)
        chosen.append(launch_.config)
        launch_()

    check_shrink(shrink, case)
    assert chosen[0].kernel == "split", chosen
    short = dataclasses.replace(case, hidden=16)
    check_shrink(shrink, short)
    assert chosen[1].kernel != "split", chosen


# -- 5. on the GPU ------------------------------------------------------------------------------


def _down_projection(T: int, K: int, r: int, seed: int, loras: int = 8) -> tuple:
    """``(gen, x, a, slots, meta, out)`` on the GPU: ``T`` bf16 tokens of width ``K``, a
    token in turn on each of ``loras`` slots, their A of rank ``r``, the metadata and a zero
    fp32 output (the generator goes on drawing)."""
    from punica_numba.meta import LoRAKernelMeta

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16)
    a = (torch.randn(loras, r, K, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    slots = torch.arange(T, device="cuda") % loras
    meta = LoRAKernelMeta.make(loras, T, "cuda")
    meta.prepare_tensors(slots)
    return gen, x, a, slots, meta, torch.zeros(1, T, r, device="cuda")


def _assert_replays_right(graph, gen, x, a, slots, meta, out) -> None:
    """Three times: new inputs drawn into ``x``, the graph of a shrink of ``x`` into ``out``
    (scaling 0.5) replayed, the same bits as an eager call made now, and the float64
    reference's values."""
    T = x.shape[0]
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16))
        out.zero_()
        graph.replay()
        got = out.clone()
        out.zero_()
        lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)
        assert torch.equal(got, out), seed
        want = reference.lora_shrink(x, [a], torch.zeros_like(out), slots, 0.5)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "mma"])
def test_a_cuda_graph_of_the_split_replays_right(kernel):
    """Captured after a warm-up call on the capture's stream (so the capture allocates
    nothing), the split shrink of a down projection (row or tensor-core) replays right
    with new inputs, replay after replay, the same bits as an eager call, and leaves
    every counter at 0."""
    T, K, r = 32, 14336, 16
    gen, x, a, slots, meta, out = _down_projection(T, K, r, seed=4)
    if kernel == "split":
        config = next(c for c in _gpu_splits() if c.tile_m == 4)  # (tiles of 4 tokens a slot)
    else:
        config = next(
            c for c in launch._GPU_CONFIGS["shrink"] if c.splits > 1 and c.kernel == kernel
        )
    with force_launch_config("shrink", config):
        launch_ = prepare_shrink(x, [a], out, *meta.meta_args(T), 0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch_()  # warm-up: compiles, and makes the stream's workspace
        cached = shrink_split.cached_split_workspace("cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), force_launch_config("shrink", config):
        lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)
    with torch.cuda.stream(stream):
        assert shrink_split.cached_split_workspace("cuda")[0] is cached[0]  # nothing new
    with force_launch_config("shrink", config):
        _assert_replays_right(graph, gen, x, a, slots, meta, out)
    torch.cuda.synchronize()
    assert counters_at_zero()


@pytest.mark.gpu
def test_a_graph_captured_on_a_fresh_stream_holds_no_fill_of_its_counters():
    """Warmed up on the default stream and captured on a fresh one (as ``bench`` and vLLM
    do), the split shrink's capture takes counters already zero before any replay (the
    spare): they read 0 before the first replay, the graph replays right, and leaves them
    at 0."""
    T = 32
    _, x, a, slots, meta, out = _down_projection(T, 4096, 16, seed=5)
    config = next(c for c in _gpu_splits() if c.tile_m == 4)
    with force_launch_config("shrink", config):
        lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)  # warm-up, default stream
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)
    with torch.cuda.stream(stream):
        taken = shrink_split.cached_split_workspace("cuda")
    assert taken is not None and not bool(taken[1].any())  # zero before any replay
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = reference.lora_shrink(x, [a], torch.zeros_like(out), slots, 0.5)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    assert not bool(taken[1].any())


# -- 6. the tensor-core split ---------------------------------------------------------------

#: Drawn tensor-core split shrinks: warps, rank groups (0: every rank) and chunks of K.
MMA_THREADS = (64,) if launch.SIMULATOR else (128, 256, 512)
MMA_MAX_SPLITS = 3 if launch.SIMULATOR else 16


def mma_split_config(threads: int, tile_n: int, splits: int) -> LaunchConfig:
    """A tensor-core split shrink the heuristic never picks (forced only)."""
    return LaunchConfig("mma", threads, 16, tile_n, splits=splits, tuned_only=True)


def _run_mma(config: LaunchConfig, case: ShrinkCase, accumulate: bool) -> list:
    """Check ``case`` under ``config`` through the launch the op makes; the configurations
    its launches ran (a call the tensor cores cannot take would fall back)."""
    ran = []

    def shrink(*args):
        call = check_shrink_arguments(args[0], args[1], args[2], tuple(args[3:9]), None, args[9])
        if not call.idle:
            launch_ = shrink_launch(
                call.inputs, call.weights, call.output, call.metadata, call.scaling, accumulate
            )
            ran.append(launch_.config)
            launch_()

    with forced(config):
        check_shrink(shrink, case, stores=not accumulate)
    return ran


@given(
    shrink_cases(LIMITS),
    st.integers(1, LIMITS.hidden // 8),
    st.sampled_from(MMA_THREADS),
    st.sampled_from((0, 8, 16)),
    st.integers(1, MMA_MAX_SPLITS),
    st.sampled_from((torch.bfloat16, torch.float16)),
    st.booleans(),
)
def test_tensor_core_split_matches_reference(
    case, words, threads, tile_n, splits, dtype, accumulate
):
    """Forced, the tensor-core shrink with K in ``splits`` chunks is right at every drawn
    size (a hidden size the tensor cores take: a multiple of 8; chunks past the row's end
    included), added into a nonzero buffer or stored, and leaves every counter at 0."""
    case = dataclasses.replace(case, hidden=8 * words, dtype=dtype, four_d=False)
    config = mma_split_config(threads, tile_n, splits)
    ran = _run_mma(config, case, accumulate)
    assert all(c == config for c in ran), ran
    assert splits == 1 or counters_at_zero() or not ran


def test_tensor_core_split_bits_under_one_key():
    """Repeated runs, and rank groups of another size under the same warps and chunks,
    give the same bits; another chunk count is another key, and so is the unsplit
    kernel's."""
    problem = Problem(slots=[0, 1, 1, -1, 0, 1, 1], prepared=7, num_loras=2, seed=5)
    case = ShrinkCase(problem, 72, 12, 2, 0, torch.bfloat16, torch.float32, 0.5, False)
    threads = MMA_THREADS[0]
    first, twin = mma_split_config(threads, 8, 3), mma_split_config(threads, 16, 3)
    assert first.arithmetic("shrink") == twin.arithmetic("shrink")
    assert first.arithmetic("shrink") != mma_split_config(threads, 8, 2).arithmetic("shrink")
    unsplit = mma_split_config(threads, 8, 1)
    assert first.arithmetic("shrink") != unsplit.arithmetic("shrink") == ("mma", threads)
    assert launch.config_name(first).endswith("_k3") and not launch.config_name(unsplit).endswith(
        "_k1"
    )
    _assert_the_same_bits(first, twin, case)


def test_tensor_core_split_takes_the_workspace_of_its_launch():
    """Four slices take two launches of the tensor-core split, one after the other on the
    stream's workspace, and the products are right."""
    problem = Problem(slots=[1, 0, -1, 1, 1], prepared=5, num_loras=2, seed=22)
    case = ShrinkCase(problem, 48, 5, 4, 0, torch.bfloat16, torch.float32, -0.25, False)
    config = mma_split_config(MMA_THREADS[0], 8, 2)
    assert _run_mma(config, case, True) == [config]
    assert counters_at_zero()


@pytest.mark.parametrize(
    "K, rank, T, loras, splits",
    [
        (14336, 16, 128, 8, 8),  # 8 tiles x 2 rank groups: 8 chunks
        (28672, 32, 128, 1, 4),  # 8 tiles x 4 rank groups: 4 chunks
        (9728, 64, 32, 1, 8),  # 2 tiles x 8 rank groups: 8 chunks
        (14336, 128, 32, 1, 4),  # 2 tiles x 16 rank groups: 4 chunks
        (14336, 16, 8, 8, 1),  # a token a slot: the rows
        (4096, 16, 128, 8, 1),  # a short K
        (14336, 16, 512, 8, 1),  # 32 tiles: blocks enough unsplit
        (14336, 64, 128, 8, 1),  # 8 tiles x 8 rank groups
        (14336, 32, 32, 1, 1),  # 1024 rows of products
    ],
)
def test_the_heuristic_splits_the_tensor_core_shrink_where_blocks_are_few(
    K, rank, T, loras, splits
):
    """On the GPU the heuristic splits K on the tensor cores (v33) where the unsplit blocks
    would be few (tiles x 8-rank groups at most 32), the slots hold 16 tokens or more and
    K is long; elsewhere it keeps what it had."""
    picked = _pick(T, loras, K, rank)
    assert picked.splits == splits, picked
    if splits > 1:
        assert picked.kernel == "mma" and not picked.tuned_only


# -- 7. the runs of K in one cluster --------------------------------------------------------


def cluster_config(threads: int, tile_n: int, splits: int) -> LaunchConfig:
    """The tensor-core split whose runs add up in one thread block cluster (forced only)."""
    return LaunchConfig("mma", threads, 16, tile_n, splits=splits, cluster=True, tuned_only=True)


def test_a_cluster_takes_2_to_8_runs_of_an_unstaged_tensor_core_split():
    """It adds the same sums in the same order as its twin of counters (one key), and its
    name says so."""
    config = cluster_config(256, 8, 4)
    twin = mma_split_config(256, 8, 4)
    assert config.arithmetic("shrink") == twin.arithmetic("shrink") == ("mma", 256, 4)
    assert launch.config_name(config) == "mma_t256_m16_n8_k4_cl"
    for fields in (
        dict(splits=1),
        dict(splits=9),
        dict(splits=4, staged=True, tile_n=128, threads=128),
        dict(splits=1, joint=True),
    ):
        with pytest.raises(ValueError, match="cluster"):
            LaunchConfig(
                "mma", **{"threads": 256, "tile_m": 16, "tile_n": 8, **fields}, cluster=True
            )
    with pytest.raises(ValueError, match="cluster"):
        LaunchConfig("split", 128, 4, 4, splits=4, cluster=True)


@pytest.mark.skipif(not launch.SIMULATOR, reason="the simulator's refusal")
def test_the_simulator_builds_no_cluster():
    """Its blocks run one after another: none could wait for another."""
    from punica_numba.kernels import build_cluster_mma_shrink_kernel

    with pytest.raises(ValueError, match="simulator"):
        build_cluster_mma_shrink_kernel(torch.bfloat16, torch.float32, 64, 1, 1, 4)


@pytest.mark.gpu
@settings(max_examples=min(settings.default.max_examples, 60))  # (two builds an example)
@given(
    shrink_cases(LIMITS),
    st.integers(1, LIMITS.hidden // 8),
    st.sampled_from(MMA_THREADS),
    st.sampled_from((0, 8, 16)),
    st.integers(2, 8),
    st.sampled_from((torch.bfloat16, torch.float16)),
    st.booleans(),
)
def test_a_cluster_gives_the_bits_of_its_twin_of_counters(
    case, words, threads, tile_n, splits, dtype, accumulate
):
    """Forced, the cluster's form is right at every drawn size (chunks past the row's end
    included; added into a nonzero buffer or stored), the same bits as the same blocks
    adding their runs through the workspace, and it touches no counter."""
    case = dataclasses.replace(case, hidden=8 * words, dtype=dtype, four_d=False)
    config, twin = (
        cluster_config(threads, tile_n, splits),
        mma_split_config(threads, tile_n, splits),
    )
    outputs = []

    def kept(shrink):
        def run(*args):
            shrink(*args)
            outputs.append(args[2].clone())

        return run

    for forced_config in (config, twin):
        with forced(forced_config):
            check_shrink(
                kept(lora_shrink if accumulate else stored_shrink), case, stores=not accumulate
            )
    if outputs:
        assert torch.equal(outputs[0], outputs[1])
    # (no workspace where no launch made one: a case of no token on a slot launches nothing)
    assert shrink_split.cached_split_workspace(DEVICE) is None or counters_at_zero()


@pytest.mark.gpu
def test_a_cuda_graph_of_a_cluster_replays_right():
    """Captured on a stream of its own after a warm-up on another, the cluster's form of a
    down projection takes no workspace there, and replays the bits of an eager call with
    new inputs, replay after replay."""
    T, K, r = 32, 14336, 32
    gen, x, a, slots, meta, out = _down_projection(T, K, r, seed=6)
    config = cluster_config(256, 8, 8)
    with forced(config):
        lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)  # warm-up: compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            lora_shrink(x, [a], out, *meta.meta_args(T), 0.5)
            # (a split of counters would have taken a workspace for this fresh stream)
            assert shrink_split.cached_split_workspace("cuda") is None
        _assert_replays_right(graph, gen, x, a, slots, meta, out)
