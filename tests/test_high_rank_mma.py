"""The tensor-core shrink and expand past rank 64 (r = 128 and 256 are common LoRA ranks).

The shrink's blocks of a rank group hold one group's registers whatever the rank, a block
per group along grid.y; its blocks of every rank stop at r=64
(``ops.operands.MMA_ONE_BLOCK_RANK``). The expand walks a rank past 64 in chunks of 64
(``kernels.expand_mma``, "Ranks past 64"). Checked here, against the float64 reference
or bit for bit:

1. every tensor-core configuration, forced, at drawn ranks of 65-256 (tiny token counts
   and hidden sizes: the simulator runs a Python thread per CUDA thread), bf16 and fp16,
   1-3 slices, added to the output or not;
2. the chunks do not change the bits: a build of chunks gives those of one chunk holding
   every rank step, and a build of r <= 64 is one chunk (its code and bits are those from
   before chunks came; the tests of test_ops.py and test_determinism.py that compare
   loads, passes and configurations at r <= 64 still hold);
3. the shrink's rank groups give the bits of one another (the key ``("mma", threads)``),
   also where the rank is not a multiple of 8, and a shrink that stores rather than adds;
4. the operands' gate and the heuristic: the tensor cores at r=128 and 256 from 16 tokens
   per slot, on both machines' tables.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import SIMULATOR, launch, ops, reference
from punica_numba._checks import check_stack
from punica_numba.kernels import build_mma_expand_kernel
from punica_numba.kernels.expand_mma import CHUNK_STEPS, rank_chunks
from punica_numba.launch import (
    LaunchConfig,
    choose_launch_config,
    config_name,
    force_launch_config,
    launch_configs,
)
from punica_numba.ops import api, launching, operands

from .op_cases import (
    ExpandCase,
    Problem,
    ShrinkCase,
    check_expand,
    check_shrink,
    record_mma_expand_builds,
    serving_expand_case,
)
from .strategies import DEVICE, assign_slots, in_shards, random_tensor
from .tolerance import assert_close

#: Each example runs a kernel of up to 16 rank steps, and draws of new ranks compile new
#: kernels (a GPU): at most 50 examples, in parts that the workers share
#: (``strategies.in_shards``). Whole, each property test below took 118-204 s of one worker
#: under the gpu profile on an H100 (0042e02), and a time limit that stops one loses it all.
FEW_IN_SHARDS = in_shards(min(settings().max_examples, 50))


def _mma_configs(op: str) -> list:
    """The tensor-core configurations of ``op``; of the expand not the staged ones, which
    take ranks of whole chunks of 32 and fp32 buffers only (test_staged_expand.py)."""
    staged_expand = op == "expand"
    return [c for c in launch_configs(op) if c.kernel == "mma" and not (staged_expand and c.staged)]


@st.composite
def _problems(draw) -> Problem:
    """16-32 tokens on one or two slots (so tiles of several tokens), up to two padded
    rows; the slots drawn in one of the modes that leave tokens with a LoRA."""
    num_tokens = draw(st.integers(16, 32), label="T")
    num_loras = draw(st.integers(1, 2), label="L")
    padding = draw(st.integers(0, 2), label="padded rows")
    mode = draw(st.sampled_from(("identical", "distinct", "uniform", "zipf")), label="mode")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    prepared = num_tokens - padding
    slots = assign_slots(mode, prepared, num_loras, seed) + [-1] * padding
    return Problem(slots, prepared, num_loras, seed)


def _forced(op: str, config, ran: list):
    """``op`` with vLLM's signature, run under ``config``; what ran goes into ``ran``."""
    prepare = ops.prepare_shrink if op == "shrink" else ops.prepare_expand

    def run(*args, **kwargs):
        with force_launch_config(op, config):
            launch_now = prepare(*args, **kwargs)
        launch_now()
        ran.append(getattr(launch_now, "config", None))  # (None: nothing to launch)

    return run


# 1. Every configuration against the reference ---------------------------------------


@st.composite
def _expand_cases(draw) -> ExpandCase:
    """An expand the tensor cores take, past r=64: a rank of whole 4-element words of B
    (68-256; not a multiple of 16 or 32 too), slices of whole 4-column words."""
    rank = 4 * draw(st.integers(17, 64), label="r / 4")
    dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)), label="dtype")
    num_slices = draw(st.integers(1, 3), label="S")
    return ExpandCase(
        problem=draw(_problems()),
        rank=rank,
        widths=[4 * draw(st.integers(1, 6), label=f"N_{s} / 4") for s in range(num_slices)],
        offset_start=4 * draw(st.integers(0, 1), label="offset_start / 4"),
        extra_columns=4 * draw(st.integers(0, 1), label="columns past the slices / 4"),
        x_dtype=draw(st.sampled_from((torch.float32, dtype)), label="buffer dtype"),
        w_dtype=dtype,
        out_dtype=dtype,
        add_inputs=draw(st.booleans(), label="add_inputs"),
        four_d=draw(st.booleans(), label="4-D weights"),
        strided_input=draw(st.booleans(), label="strided buffer"),
    )


@FEW_IN_SHARDS
@given(_expand_cases(), st.data())
def test_tensor_core_expand_past_rank_64_matches_reference(shard, case, data):
    """Each tensor-core expand that reaches the rank (drawn, then forced) runs, in chunks
    of 64 ranks, and is right: fp32 or 16-bit buffers, read whole or (strided) element
    by element, B in 16-byte words where r is a multiple of 32."""
    fits = [c for c in _mma_configs("expand") if (c.to_rank or case.rank) >= case.rank]
    config = data.draw(st.sampled_from(fits), label="configuration")
    ran = []
    check_expand(_forced("expand", config, ran), case)
    assert ran in ([config], [None]), ran  # (None: no token with a LoRA)
    assert rank_chunks(-(-case.rank // 16))[1] > 1


@st.composite
def _shrink_cases(draw) -> ShrinkCase:
    """A shrink the tensor cores take, past r=64: any rank of 65-256 (most not a multiple
    of 8), a hidden size that is a multiple of 8 (64-96)."""
    dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)), label="dtype")
    return ShrinkCase(
        problem=draw(_problems()),
        hidden=8 * draw(st.integers(8, 12), label="H / 8"),
        rank=draw(st.integers(65, 256), label="r"),
        num_slices=draw(st.integers(1, 3), label="S"),
        extra_slices=draw(st.integers(0, 1), label="extra buffer slices"),
        dtype=dtype,
        out_dtype=draw(
            st.sampled_from((torch.float32, torch.float32, dtype)), label="buffer dtype"
        ),
        scaling=draw(st.sampled_from((1.0, 0.5, -0.25, 2.0)), label="scaling"),
        four_d=draw(st.booleans(), label="4-D weights"),
    )


def _drawn_shrink_configs() -> list:
    """The tensor-core shrinks the property test draws from. On the simulator, not the
    blocks of 8 ranks: r / 8 blocks of 64 Python threads a tile and slice (seconds each),
    which ``test_every_tensor_core_shrink_past_rank_64`` runs at one rank instead."""
    return [c for c in _mma_configs("shrink") if not (SIMULATOR and 0 < c.tile_n < 64)]


@FEW_IN_SHARDS
@given(_shrink_cases(), st.data())
def test_tensor_core_shrink_past_rank_64_matches_reference(shard, case, data):
    """Each tensor-core shrink (drawn, then forced) on a rank past 64: the blocks of a
    rank group run and are right; the blocks of every rank (``tile_n == 0``) give way to
    the heuristic's pick, a configuration of rank groups (or, with too few tokens a
    slot, an FFMA one)."""
    config = data.draw(st.sampled_from(_drawn_shrink_configs()), label="configuration")
    ran = []
    check_shrink(_forced("shrink", config, ran), case)
    (what,) = ran
    if what is None:  # no token with a LoRA
        return
    if config.tile_n:
        assert what == config, what
    else:
        assert what != config and (what.kernel != "mma" or what.tile_n > 0), what


# 2. The expand's chunks -----------------------------------------------------------------

#: (rank, B's dtype, the buffer's, the chunk sizes tried after the default): r=128 in two
#: chunks (B in 16-byte words), one and four; r=100 (seven steps, not whole) in 4 + 3
#: and one; r=64 and 48, one chunk by default, against two and three.
CHUNKINGS = [
    (128, torch.bfloat16, torch.float32, (8, 2)),
    (100, torch.float16, torch.float32, (7,)),
    (64, torch.bfloat16, torch.bfloat16, (2,)),
    (48, torch.float16, torch.float16, (1,)),
]


@pytest.mark.parametrize(
    "rank, dtype, x_dtype, chunks",
    CHUNKINGS,
    ids=[f"r{r}-{str(d)[6:]}-{str(x)[6:]}-buffer" for r, d, x, _ in CHUNKINGS],
)
def test_chunks_of_the_rank_give_the_same_bits(rank, dtype, x_dtype, chunks, monkeypatch):
    """The expand built with the default chunks (:data:`CHUNK_STEPS` rank steps; one
    chunk up to r=64: the build of before), then with other chunk sizes (one chunk
    holding every rank step, or more, shorter chunks): each right, all the same bits.
    20 tokens in two tiles, a slice of 40 columns: two column groups that one block of
    the simulator's table walks, loading each chunk again for the second."""
    sizes = []  # the chunk size each build is forced to (None: the default)
    builds = record_mma_expand_builds(
        monkeypatch, lambda args: (*args, sizes[-1]) if sizes[-1] else args
    )
    problem = Problem([0] * 12 + [1] * 8, 20, 2, seed=3)
    case = serving_expand_case(problem, rank, [40], offset_start=4, dtype=dtype)
    case.x_dtype = x_dtype
    config = next(c for c in _mma_configs("expand") if (c.to_rank or rank) >= rank)
    outputs = []
    for size in (None, *chunks):
        sizes.append(size)

        def run(*args, **kwargs):
            _forced("expand", config, [])(*args, **kwargs)
            outputs.append(args[2].clone())

        check_expand(run, case)
    k_steps = -(-rank // 16)
    assert [a[4] for a, _ in builds] == [k_steps] * len(sizes)
    assert [a[15] if len(a) > 15 else None for a, _ in builds] == sizes
    assert (rank_chunks(k_steps)[1] == 1) == (rank <= 16 * CHUNK_STEPS)
    for size, out in zip(sizes[1:], outputs[1:]):
        differ = out != outputs[0]
        assert not bool(differ.any()), (size, torch.nonzero(differ)[:4].tolist())


def test_a_configurations_chunk_reaches_the_build_and_changes_no_bit(monkeypatch):
    """A tensor-core expand configuration with a ``chunk`` (the tuner's ``_c32`` ones) builds
    the expand with that many ranks held at once, and stores the bits of a configuration
    of the default chunks (the tensor-core expands add in one order whatever their tiles):
    at r=96, three chunks of 32 against two of 64 (the second shorter)."""
    config = next(c for c in _mma_configs("expand") if c.chunk)
    plain = next(c for c in _mma_configs("expand") if not c.chunk and c.threads == config.threads)
    assert config_name(config).endswith(f"_c{config.chunk}")
    builds = record_mma_expand_builds(monkeypatch)
    problem = Problem([0] * 12 + [1] * 8, 20, 2, seed=5)
    case = serving_expand_case(problem, 96, [40], offset_start=4, dtype=torch.bfloat16)
    outputs = []
    for forced in (plain, config):

        def run(*args, forced=forced, **kwargs):
            _forced("expand", forced, [])(*args, **kwargs)
            outputs.append(args[2].clone())

        check_expand(run, case)
    assert [a[15] if len(a) > 15 else None for a, _ in builds] == [None, config.chunk // 16]
    assert torch.equal(outputs[0], outputs[1])


def test_ranks_up_to_64_are_one_chunk():
    """Up to r=64 (four rank steps of 16) an expand is built as one chunk, the code it
    had before chunks came; past it in chunks of four steps, the last one shorter where
    the steps are not a multiple of four; and 16-byte loads of B, which take two steps at
    a time, refuse chunks of an odd number of steps."""
    assert CHUNK_STEPS == 4
    assert [rank_chunks(k) for k in range(1, 5)] == [(k, 1) for k in range(1, 5)]
    assert [rank_chunks(k) for k in (5, 8, 13, 16)] == [(4, 2), (4, 2), (4, 4), (4, 4)]
    with pytest.raises(ValueError, match="even number"):
        build_mma_expand_kernel(torch.float32, 32, 1, 4, 8, True, wide_b=True, chunk_steps=3)
    with pytest.raises(ValueError, match="at least one"):
        build_mma_expand_kernel(torch.float32, 32, 1, 4, 8, True, chunk_steps=0)


# 3. The shrink's rank groups ----------------------------------------------------------


def _group_twins(monkeypatch) -> list:
    """This machine's tensor-core shrinks, and (for the test only, in its table) twins of
    the first of rank groups with groups of 16 and 24 ranks: the same threads, so the
    same arithmetic key."""
    table = _mma_configs("shrink")
    first = next(c for c in table if c.tile_n)
    twins = [
        LaunchConfig(
            "mma", first.threads, first.tile_m, n, from_tokens_per_slot=1e9, from_rank=1 << 20
        )
        for n in (16, 24)
    ]
    machine = launch._SIMULATOR_CONFIGS if launch.SIMULATOR else launch._GPU_CONFIGS
    monkeypatch.setitem(machine, "shrink", (*launch_configs("shrink"), *twins))
    return [*table, *twins]


def test_every_tensor_core_shrink_past_rank_64(monkeypatch):
    """Every tensor-core shrink of this machine's table, forced at r=100 (not a multiple
    of 8: groups of 8 end in one of 4, of 16 in one of 4, of 24 in one of 4, of 64 in one
    of 36), 15 tokens on one slot and a padded row: each right, and every run
    of the same threads gives the same bits, whatever its rank groups. Blocks of every
    rank give way to the heuristic's pick (past their ``to_rank``)."""
    configs = _group_twins(monkeypatch)
    problem = Problem([0] * 15 + [-1], 15, 1, seed=21)
    case = ShrinkCase(problem, 64, 100, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
    runs = []
    for config in configs:
        ran = []

        def run(*args, config=config, ran=ran):
            _forced("shrink", config, ran)(*args)
            runs.append((ran[-1], args[2].clone()))

        check_shrink(run, case)
        assert ran[0] == config if config.tile_n else ran[0].tile_n > 0, (config, ran)
    by_key = {}
    for config, out in runs:
        by_key.setdefault(config.arithmetic("shrink"), []).append((config, out))
    for (first, want), *others in by_key.values():
        for config, out in others:
            differ = out != want
            assert not bool(differ.any()), (config_name(config), config_name(first))
    assert max(len(group) for group in by_key.values()) >= 3  # (the twins, at least)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tensor_core_shrink_stores_past_rank_64(out_dtype, monkeypatch):
    """A shrink that stores its products rather than adding them (``accumulate=False``,
    the wrapper's fresh buffers) at r=128, as the heuristic picks it (the tensor cores,
    rank groups): rows of a LoRA hold ``scaling * x @ A^T``, the others are untouched."""
    monkeypatch.setattr(
        api, "shrink_launch", lambda *args: launching.shrink_launch(*args, accumulate=False)
    )
    slots = torch.tensor([0] * 19 + [-1] + [0] * 12, device=DEVICE)  # 31 rows x r=128
    T, H, r = len(slots), 64, 128
    x = random_tensor((T, H), torch.bfloat16, 31)
    a = random_tensor((1, r, H), torch.bfloat16, 32)
    out = random_tensor((1, T, r), out_dtype, 33)
    before = out.clone()
    meta = Problem(slots.tolist(), T, 1, seed=0).meta()
    launch_now = ops.prepare_shrink(x, [a], out, *meta.meta_args(T), 0.5)
    launch_now()
    assert launch_now.config.kernel == "mma" and launch_now.config.tile_n > 0
    zeros = torch.zeros_like(before)
    want = reference.lora_shrink(x, [a], zeros, slots, 0.5)
    magnitude = reference.lora_shrink(x.abs(), [a.abs()], zeros, slots, 0.5)
    lora = slots != -1
    assert torch.equal(out[:, ~lora], before[:, ~lora])
    assert_close(out[:, lora], want[:, lora], magnitude[:, lora], terms=H, what="stored shrink")


# 4. The gate and the heuristic ----------------------------------------------------------


def test_the_operands_take_ranks_up_to_256():
    """The shrink's operands at r=128: taken for blocks of rank groups (``tile_n`` 8, 16,
    64), not for blocks of every rank (``tile_n`` 0, up to r=64); none past
    ``MMA_MAX_RANK``. The expand's: taken up to r=256."""
    assert operands.MMA_MAX_RANK == 256 and operands.MMA_ONE_BLOCK_RANK == 64
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    for rank in (64, 128, 256, 260):
        a = [check_stack("a", torch.zeros(1, rank, 64, dtype=torch.bfloat16, device=DEVICE))]
        taken = {n: operands.mma_shrink_operands(x, a, n) is not None for n in (0, 8, 16, 64)}
        assert taken == {0: rank <= 64, 8: rank <= 256, 16: rank <= 256, 64: rank <= 256}, rank
        buffer = torch.zeros(1, 4, rank, device=DEVICE)
        b = [check_stack("b", torch.zeros(1, 32, rank, dtype=torch.bfloat16, device=DEVICE))]
        out = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE)
        words = operands.weight_words(b)
        taken = operands.mma_expand_operands(buffer, b, words, out, [0]) is not None
        assert taken == (rank <= 256), rank


@pytest.mark.parametrize("table", [True, False], ids=["simulator-table", "gpu-table"])
@pytest.mark.parametrize("rank", [128, 256])
def test_the_heuristic_takes_the_tensor_cores_at_rank_128(rank, table, monkeypatch):
    """From 16 tokens per slot (32 on one slot, 256 over 16, 1024 over 32, 4096 over 64;
    one slice and three) a call the tensor cores can take gets them at r=128 and 256, in
    a configuration that reaches the rank: a shrink of rank groups (blocks of every rank
    stop at r=64), an expand within its ``to_rank``. With a token a slot, the FFMA
    shrink; the expand's tensor cores take any spread from 8 rows on the GPU (the H200's
    tuned table), from 4 tokens a slot on the simulator."""
    monkeypatch.setattr(launch, "SIMULATOR", table)
    for tokens, slots in ((32, 1), (256, 16), (1024, 32), (4096, 64)):
        for slices in (1, 3):
            for op in ("shrink", "expand"):
                hidden = 4096 if op == "shrink" else rank
                args = (op, tokens, slots, rank, True, slices)
                config = choose_launch_config(*args, K=hidden)
                assert config.kernel == "mma", (op, tokens, slots, slices, config)
                assert (config.to_rank or rank) >= rank, config
                assert op == "expand" or config.tile_n > 0, config
                one_each = choose_launch_config(op, tokens, tokens, rank, True, slices, K=hidden)
                spread_too = op == "expand" and not table  # (the GPU's expand from 8 rows)
                assert (one_each.kernel == "mma") == spread_too, (op, tokens, one_each)


@pytest.mark.parametrize("rank", [128, 256])
def test_a_call_of_32_tokens_on_a_slot_takes_the_tensor_cores(rank):
    """Through the ops (prepared, not run): a shrink and an expand of 32 tokens on one
    slot at r=128 and 256, bf16 weights and an fp32 buffer, get the tensor cores."""
    T, H, width = 32, 64, 32
    slots = [0] * T
    meta = Problem(slots, T, 1, seed=0).meta()
    x = torch.zeros(T, H, dtype=torch.bfloat16, device=DEVICE)
    a = torch.zeros(1, rank, H, dtype=torch.bfloat16, device=DEVICE)
    buffer = torch.zeros(1, T, rank, device=DEVICE)
    shrink = ops.prepare_shrink(x, [a], buffer, *meta.meta_args(T), 1.0)
    assert shrink.config.kernel == "mma" and shrink.config.tile_n > 0, shrink.config
    b = torch.zeros(1, width, rank, dtype=torch.bfloat16, device=DEVICE)
    y = torch.zeros(T, width, dtype=torch.bfloat16, device=DEVICE)
    expand = ops.prepare_expand(buffer, [b], y, *meta.meta_args(T), offset_start=0, add_inputs=True)
    assert expand.config.kernel == "mma", expand.config
