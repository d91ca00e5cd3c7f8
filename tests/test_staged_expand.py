"""The tensor-core expand with the buffer and B staged in shared memory
(``LaunchConfig(staged=True)`` for the expand, :mod:`punica_numba.kernels.expand_mma_staged`).
Checked here:

1. against the float64 reference, over drawn ranks (multiples of 32), slices, widths, tokens,
   B's dtype (bf16, or fp16 with the buffer's rows scaled) and blocks (warps along the tokens,
   the columns or both), added to the output or not; the staged configuration is the one that
   ran, and its bits are those of the tensor-core expand's other configurations (their
   arithmetic key, ``("mma",)``);
2. a rank of more chunks than the block's stages: each stage is copied into again only after
   every warp has multiplied what it held;
3. what it does not take (a rank that is not a multiple of 32, a 16-bit or strided buffer, B
   whose rows are not at multiples of 16 bytes) goes to another configuration, and is right;
4. how a block is split among its warps, and the stages it keeps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba import ops
from punica_numba.kernels import staged_expand_warps
from punica_numba.kernels.expand_mma_staged import staged_expand_stages
from punica_numba.launch import LaunchConfig, config_name

from .op_cases import ExpandCase, Problem, check_expand, rows_at_8_bytes
from .strategies import LARGE
from .test_split_shrink import forced

#: Blocks drawn, ``(threads, tokens, columns, stages)`` (stages 0: what 48 KB declared in
#: the kernel hold): on the simulator two warps (64 Python threads a block) of 16 tokens x 16
#: columns side by side, also with three stages in dynamic shared memory, or along the
#: tokens of 16 x 32 or 16 x 64; on the GPU the table's.
BLOCKS = (
    (
        (128, 64, 64, 0),
        (128, 32, 128, 0),
        (64, 32, 64, 0),
        (256, 64, 128, 0),
        (128, 64, 128, 0),
        (256, 64, 128, 5),
        (128, 64, 128, 5),
        (256, 64, 256, 4),
    )
    if LARGE
    else ((64, 16, 32, 0), (64, 16, 32, 3), (64, 32, 32, 0), (64, 32, 64, 0))
)
#: A plain tensor-core expand of every rank (one warp of 32 columns, the rank in chunks of
#: 32): the bits the staged blocks must give.
PLAIN = LaunchConfig("mma", 32, 16, 32, chunk=32, tuned_only=True)


def staged_config(threads: int, tile_m: int, tile_n: int, stages: int = 0) -> LaunchConfig:
    return LaunchConfig("mma", threads, tile_m, tile_n, staged=True, stages=stages, tuned_only=True)


def run_under(config: LaunchConfig, case: ExpandCase) -> tuple:
    """``case`` checked against the reference under ``config``: the configuration that ran
    (None: nothing to launch) and the output."""
    ran = []

    def expand(x, weights, out, *args, **kwargs):
        with forced(config, "expand"):
            launch_now = ops.prepare_expand(x, weights, out, *args, **kwargs)
        launch_now()
        ran.append((getattr(launch_now, "config", None), out.clone()))

    check_expand(expand, case)
    (result,) = ran
    return result


def assert_the_bits_of(twin: LaunchConfig, config: LaunchConfig, case: ExpandCase) -> None:
    """``case`` under ``config`` (the configuration that ran) gives ``twin``'s bits."""
    ran, got = run_under(config, case)
    assert ran == config, config_name(ran)
    _, want = run_under(twin, case)
    assert torch.equal(got, want), f"{config_name(config)} and {config_name(twin)} differ"


@st.composite
def staged_cases(draw) -> ExpandCase:
    """An expand the staged blocks take: an fp32 buffer, a rank of whole chunks of 32 (up to
    96; on the GPU 256), 1-3 slices of whole 8-column words (some of 4) of up to 32 columns
    (4096), 1-24 tokens (96) on 1-3 LoRAs (some without), bf16 or fp16."""
    num_tokens = draw(st.integers(1, 96 if LARGE else 24), label="T")
    num_loras = draw(st.integers(1, 3), label="L")
    slots = draw(
        st.lists(st.integers(-1, num_loras - 1), min_size=num_tokens, max_size=num_tokens),
        label="slots",
    )
    problem = Problem(slots, num_tokens, num_loras, draw(st.integers(0, 2**31 - 1), label="seed"))
    word = draw(st.sampled_from((4, 8)), label="slice widths a multiple of")
    most = 4096 if LARGE else 32
    dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)), label="dtype")
    return ExpandCase(
        problem=problem,
        rank=32 * draw(st.integers(1, 8 if LARGE else 3), label="r / 32"),
        widths=[
            word * draw(st.integers(1, most // word), label=f"N_{s} / {word}")
            for s in range(draw(st.integers(1, 3), label="S"))
        ],
        offset_start=word * draw(st.integers(0, 1), label="offset_start / word"),
        extra_columns=4 * draw(st.integers(0, 1), label="columns past the slices / 4"),
        x_dtype=torch.float32,
        w_dtype=dtype,
        out_dtype=dtype,
        add_inputs=draw(st.booleans(), label="add_inputs"),
        four_d=draw(st.booleans(), label="4-D weights"),
        strided_input=False,
    )


@given(staged_cases(), st.sampled_from(BLOCKS))
def test_staged_expand_matches_reference_with_the_tensor_cores_bits(case, block):
    config = staged_config(*block)
    ran, got = run_under(config, case)
    if ran is None:  # no token with a LoRA: nothing launched
        return
    assert ran == config, config_name(ran)
    plain, want = run_under(PLAIN, case)
    assert plain == PLAIN, config_name(plain)
    assert torch.equal(got, want), f"{config_name(config)} and {config_name(PLAIN)} differ"


def test_a_rank_of_more_chunks_than_stages_goes_round_them():
    """r=256 is 8 chunks of 32; a block of 32 tokens x 64 columns keeps 5 stages, so its
    ring turns more than once: a stage is copied into again only after every warp has
    multiplied what it held (a ring that turned early would multiply a later chunk's
    elements). 19 tokens on one LoRA and one without, one slice of 64 columns: one block;
    fp16, whose rows are scaled first (bf16 is drawn above)."""
    assert staged_expand_stages(32, 64) < 256 // 32
    config = staged_config(64, 32, 64)
    problem = Problem([0] * 9 + [-1] + [0] * 10, 20, 1, seed=6)
    half = torch.float16
    case = ExpandCase(problem, 256, [64], 0, 0, torch.float32, half, half, True, False, False)
    assert_the_bits_of(PLAIN, config, case)


def _case(rank: int, x_dtype=torch.float32, strided: bool = False) -> ExpandCase:
    problem = Problem([0, 1, 0, 0, 1, -1], 6, 2, seed=2)
    return ExpandCase(
        problem, rank, [16, 8], 0, 0, x_dtype, torch.bfloat16, torch.bfloat16, True, False, strided
    )


@pytest.mark.parametrize(
    "case",
    [_case(48), _case(32, torch.bfloat16), _case(32, strided=True)],
    ids=["r48", "bf16-buffer", "strided-buffer"],
)
def test_what_it_does_not_take_goes_elsewhere(case):
    """A rank that is not a multiple of 32, a bf16 buffer, a buffer with gaps between its
    rows: not staged (its copies take 16 aligned bytes of an fp32 buffer, whole chunks), but
    another configuration, and right."""
    config = staged_config(*BLOCKS[0])
    ran, _ = run_under(config, case)
    assert ran is not None and not ran.staged, ran


def test_metadata_made_elsewhere_gives_the_same_bits():
    """vLLM's six metadata tensors made without ``LoRAKernelMeta`` (copies: no host-side
    facts, no tile table kept for them): the launch makes the table on the device, and the
    staged block reads the sorted tokens through it, as with the meta's own."""
    config = staged_config(*BLOCKS[0])
    problem = Problem([1, 0, 1, 1, -1, 0, 1, 0], 8, 2, seed=4)
    case = ExpandCase(
        problem, 32, [16], 0, 0, torch.float32, torch.bfloat16, torch.bfloat16, True, False, False
    )
    outputs = []
    for foreign in (False, True):

        def expand(x, weights, out, *meta, foreign=foreign, **kwargs):
            meta = [t.clone() for t in meta] if foreign else meta
            with forced(config, "expand"):
                launch_now = ops.prepare_expand(x, weights, out, *meta, **kwargs)
            launch_now()
            assert launch_now.config == config, launch_now.config
            outputs.append(out.clone())

        check_expand(expand, case)
    assert torch.equal(outputs[0], outputs[1])


def test_b_in_rows_at_8_bytes_goes_elsewhere():
    """B whose rows start 8 bytes past a multiple of 16 cannot be copied 16 bytes at a
    time: another configuration runs, and is right."""
    config = staged_config(*BLOCKS[0])
    ran = []

    def expand(x, weights, *args, **kwargs):
        weights = [rows_at_8_bytes(w) for w in weights]
        with forced(config, "expand"):
            launch_now = ops.prepare_expand(x, weights, *args, **kwargs)
        launch_now()
        ran.append(launch_now.config)

    check_expand(expand, _case(32))
    assert not ran[0].staged, ran


@pytest.mark.parametrize(
    "threads, tile_m, tile_n, split",
    [
        (128, 64, 64, (4, 1, 1, 8)),  # every warp along the tokens
        (128, 16, 128, (1, 4, 1, 4)),  # every warp along the columns
        (256, 64, 128, (4, 2, 1, 8)),  # both
        (64, 64, 32, (2, 1, 2, 4)),  # two 16-token tiles a warp
    ],
)
def test_a_block_splits_the_tokens_among_its_warps_first(threads, tile_m, tile_n, split):
    assert staged_expand_warps(threads, tile_m, tile_n) == split


@pytest.mark.parametrize(
    "threads, tile_m, tile_n",
    [(96, 16, 24), (128, 16, 32), (64, 20, 32), (48, 16, 32)],
    ids=["odd-tiles-a-warp", "too-few-columns", "partial-token-tile", "partial-warp"],
)
def test_a_block_that_does_not_split_is_refused(threads, tile_m, tile_n):
    with pytest.raises(ValueError):
        staged_expand_warps(threads, tile_m, tile_n)


def test_the_stages_fill_what_a_block_may_declare():
    """Rows of 144 bytes of the buffer and 64 of B a token and a column: 16 x 32 keeps the
    most, 8; 64 x 128 two; 128 x 128 cannot keep two."""
    assert staged_expand_stages(16, 32) == 8
    assert staged_expand_stages(32, 64) == 5
    assert staged_expand_stages(64, 128) == 2
    with pytest.raises(ValueError, match="two stages"):
        staged_expand_stages(128, 128)


def test_stages_asked_for_are_kept_in_dynamic_shared_memory_up_to_its_limit():
    """Asked for, a block keeps that many stages however large (64 x 128: 17,408 bytes each,
    13 of them in Hopper's 227 KB), never fewer than two nor more than fit."""
    assert staged_expand_stages(64, 128, 5) == 5
    assert staged_expand_stages(128, 128, 5) == 5
    assert staged_expand_stages(64, 128, 13) == 13
    for stages in (1, 14):
        with pytest.raises(ValueError, match="at most"):
            staged_expand_stages(64, 128, stages)
    with pytest.raises(ValueError, match="stages takes a staged configuration"):
        LaunchConfig("mma", 64, 16, 32, stages=3, tuned_only=True)


def test_a_ring_of_dynamic_stages_gives_the_bits_of_the_static_one():
    """Three stages in dynamic shared memory over r=128 (four chunks: the ring turns): the
    buffer's stages and B's share one buffer, so a stage of B written over the buffer's (or
    the reverse) would show here. 5 tokens on one LoRA and one without, one slice of 32
    columns, bf16: the bits of the ring declared in the kernel."""
    problem = Problem([0, 0, -1, 0, 0, 0], 6, 1, seed=7)
    bf16 = torch.bfloat16
    case = ExpandCase(problem, 128, [32], 0, 0, torch.float32, bf16, bf16, True, False, False)
    assert_the_bits_of(staged_config(64, 16, 32), staged_config(64, 16, 32, 3), case)
