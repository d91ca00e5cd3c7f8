"""vLLM's two call conventions (docs/vllm_conventions.md), both taken, with the same bits.

vLLM v0.8-v0.9 hands the ops six metadata values (``meta_args(T)``) and its wrapper's
``add_lora_linear`` / ``add_expand`` a bias; vLLM 0.33 hands the ops seven (the last,
``num_active_loras``, from ``meta_args(T, specialize_active_lora)``) and passes no bias.

Sections:

1. ``meta_args``: six values, or seven, and what the seventh holds;
2. the ops in both forms and every way of passing the values after the metadata: within
   the reference's tolerance and bit for bit equal to the six-value positional call;
3. bad calls: ``num_active_loras`` checked before any launch (nothing changes), and
   too many, too few or doubly given values;
4. the wrapper's vLLM 0.33 calls against its v0.9 calls (bias None): the same bits;
   malformed calls raise ``TypeError`` naming the argument;
5. the examples of docs/vllm_conventions.md run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import LoRAKernelMeta, lora_expand, lora_shrink, reference

from .op_cases import (
    META_ARG_NAMES,
    ExpandCase,
    Problem,
    ShrinkCase,
    check_expand,
    check_shrink,
    expand_cases,
    shrink_cases,
)
from .strategies import DEVICE, META_LIMITS, random_tensor, slot_lists
from .test_vllm_grid import expand_in_forms, num_active_loras, same_bits, shrink_in_forms
from .test_wrapper import absolute, make_batch, make_bias, prepared_wrapper, stacked
from .tolerance import assert_close

ROOT = Path(__file__).resolve().parents[1]

#: The ops' properties launch two or three kernels an example, over the space the other
#: property tests (test_ops.py) draw in full: at most 60 examples.
FEW = settings(max_examples=min(settings().max_examples, 60))

L = 5  # slots; active_lora_ids has L + 1 entries
SLOTS = (0, 3, -1, 3, 1, -1)  # entries in use: -1, 0, 1, 3
IN_USE = 4


def _meta(slots=SLOTS, max_tokens: int = 8) -> LoRAKernelMeta:
    meta = LoRAKernelMeta.make(L, max_tokens, DEVICE)
    meta.prepare_tensors(torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    return meta


def _count(value: int, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype)


# -- 1. meta_args -------------------------------------------------------------------------


def test_meta_args_gives_six_values_without_specialize():
    meta = _meta()
    six = meta.meta_args(len(SLOTS))
    assert len(six) == 6
    assert six[0].tolist() == list(SLOTS)
    for got, field in zip(six[2:], ("num_tokens_per_lora", "lora_token_start_loc")):
        assert got is getattr(meta, field), field
    assert six[4] is meta.active_lora_ids and six[5] is meta.no_lora_flag_cpu


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("specialize", [False, True])
def test_meta_args_gives_seven_values_with_specialize(specialize, by_keyword):
    meta = _meta()
    T = len(SLOTS)
    seven = (
        meta.meta_args(T, specialize_active_lora=specialize)
        if by_keyword
        else meta.meta_args(T, specialize)
    )
    six = meta.meta_args(T)
    assert len(seven) == 7
    for s, (got, want) in enumerate(zip(seven, six)):
        assert got.data_ptr() == want.data_ptr() and torch.equal(got, want), f"value {s}"
    count = seven[6]
    assert isinstance(count, torch.Tensor)
    assert (count.dtype, count.device.type, count.numel()) == (torch.int32, "cpu", 1)
    want = IN_USE if specialize else L + 1
    assert count.item() == want
    assert (L + 1) == len(meta.active_lora_ids)


@given(st.data())
def test_specialized_count_is_the_entries_in_use(data):
    num_loras = data.draw(st.integers(1, META_LIMITS.loras), label="L")
    n = data.draw(st.integers(0, META_LIMITS.tokens), label="T")
    slots = data.draw(slot_lists(n, num_loras))
    meta = LoRAKernelMeta.make(num_loras, META_LIMITS.tokens, DEVICE)
    meta.prepare_tensors(torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    specialized = meta.meta_args(n, True)[6].item()
    assert specialized == len(set(slots))  # -1 counted when a token has it; 0 for no token
    if any(slot >= 0 for slot in slots):  # (with none, the metadata keeps no segment)
        assert specialized == int((meta.num_tokens_per_lora > 0).sum())  # segments in use
    assert meta.meta_args(n, False)[6].item() == num_loras + 1


def test_count_follows_the_last_prepared_mapping():
    meta = _meta()
    for slots, want in (((2, 2, 4), 2), ((-1, -1), 1), ((), 0), (SLOTS, IN_USE)):
        meta.prepare_tensors(torch.tensor(slots, dtype=torch.int64, device=DEVICE))
        assert meta.meta_args(len(slots), True)[6].item() == want, slots
        assert meta.meta_args(len(slots), False)[6].item() == L + 1, slots


def test_meta_args_takes_only_a_bool_for_specialize():
    with pytest.raises(TypeError, match="specialize_active_lora"):
        _meta().meta_args(len(SLOTS), 1)


# -- 2. the ops in both forms, every way of passing them -----------------------------------

#: Ways to call lora_shrink; each gets the six values, the seventh and the scaling.
SHRINK_CALLS = {
    "v0.9, scaling by keyword": lambda x, a, out, six, n, s: lora_shrink(
        x, a, out, *six, scaling=s
    ),
    "0.33, positional": lambda x, a, out, six, n, s: lora_shrink(x, a, out, *six, n, s),
    "0.33, scaling by keyword": lambda x, a, out, six, n, s: lora_shrink(
        x, a, out, *six, n, scaling=s
    ),
    "0.33, num_active_loras and scaling by keyword": lambda x, a, out, six, n, s: lora_shrink(
        x, a, out, *six, num_active_loras=n, scaling=s
    ),
    "0.33, all by keyword": lambda x, a, out, six, n, s: lora_shrink(
        inputs=x,
        lora_a_weights=a,
        output_tensor=out,
        **dict(zip(META_ARG_NAMES, six)),
        num_active_loras=n,
        scaling=s,
    ),
}

#: Ways to call lora_expand; each gets the six values, the seventh, offset_start, add_inputs.
EXPAND_CALLS = {
    "v0.9, positional": lambda x, b, out, six, n, o, a: lora_expand(x, b, out, *six, o, a),
    "0.33, positional": lambda x, b, out, six, n, o, a: lora_expand(x, b, out, *six, n, o, a),
    "0.33, by keyword": lambda x, b, out, six, n, o, a: lora_expand(
        x, b, out, *six, n, offset_start=o, add_inputs=a
    ),
    "0.33, offset_start positional": lambda x, b, out, six, n, o, a: lora_expand(
        x, b, out, *six, n, o, add_inputs=a
    ),
    "0.33, num_active_loras by keyword": lambda x, b, out, six, n, o, a: lora_expand(
        x, b, out, *six, num_active_loras=n, offset_start=o, add_inputs=a
    ),
    "0.33, all by keyword": lambda x, b, out, six, n, o, a: lora_expand(
        inputs=x,
        lora_b_weights=b,
        output_tensor=out,
        **dict(zip(META_ARG_NAMES, six)),
        num_active_loras=n,
        offset_start=o,
        add_inputs=a,
    ),
}

#: A problem with tokens without a LoRA and a padded row; 4-D (vLLM's) weights, two
#: slices and a buffer slice past them, an odd hidden size.
PROBLEM = Problem(list(SLOTS) + [-1], len(SLOTS), L, seed=33)
SHRINK_CASE = ShrinkCase(PROBLEM, 13, 4, 2, 1, torch.bfloat16, torch.float32, 0.5, True)
EXPAND_CASE = ExpandCase(
    PROBLEM, 4, [5, 3], 2, 1, torch.float32, torch.bfloat16, torch.bfloat16, True, True, True
)


def _call_against_six(call, what: str, specialize: bool, op: str):
    """An impl for check_shrink / check_expand: ``call`` on the case, after the six-value
    positional call on a copy, whose bits it must give."""
    count = num_active_loras(PROBLEM, specialize)
    if op == "shrink":

        def impl(x, weights, out, *args):
            six, scaling = args[:6], args[6]
            want = out.clone()
            lora_shrink(x, weights, want, *six, scaling)
            call(x, weights, out, six, count, scaling)
            same_bits(out, want, what)

    else:

        def impl(x, weights, out, *six, offset_start, add_inputs):
            want = out.clone()
            lora_expand(x, weights, want, *six, offset_start=offset_start, add_inputs=add_inputs)
            call(x, weights, out, six, count, offset_start, add_inputs)
            same_bits(out, want, what)

    return impl


@pytest.mark.parametrize("specialize", [False, True])
@pytest.mark.parametrize("how", SHRINK_CALLS)
def test_shrink_call(how, specialize):
    check_shrink(_call_against_six(SHRINK_CALLS[how], how, specialize, "shrink"), SHRINK_CASE)


@pytest.mark.parametrize("specialize", [False, True])
@pytest.mark.parametrize("how", EXPAND_CALLS)
def test_expand_call(how, specialize):
    check_expand(_call_against_six(EXPAND_CALLS[how], how, specialize, "expand"), EXPAND_CASE)


def test_expand_defaults_in_the_seven_value_form():
    """``lora_expand(..., *seven)`` alone: offset_start 0 and add_inputs False."""
    meta = PROBLEM.meta()
    T = PROBLEM.num_tokens
    x = random_tensor((2, T, 4), torch.float32, 1)
    b = [random_tensor((L, n, 4), torch.bfloat16, 2 + n) for n in (5, 3)]
    got = random_tensor((T, 9), torch.bfloat16, 3)
    want = got.clone()
    lora_expand(x, b, got, *meta.meta_args(T, True))
    lora_expand(x, b, want, *meta.meta_args(T), offset_start=0, add_inputs=False)
    same_bits(got, want, "seven values, defaults")
    assert not torch.equal(got, random_tensor((T, 9), torch.bfloat16, 3)), "nothing written"


@FEW
@given(shrink_cases(), st.sampled_from([(False,), (True,), (False, True)]))
def test_shrink_forms_agree_on_drawn_problems(case, forms):
    check_shrink(shrink_in_forms(case.problem, forms), case)


@FEW
@given(expand_cases(), st.sampled_from([(False,), (True,), (False, True)]))
def test_expand_forms_agree_on_drawn_problems(case, forms):
    check_expand(expand_in_forms(case.problem, forms), case)


# -- 3. bad calls ----------------------------------------------------------------------------

T, H, R = len(SLOTS), 12, 4


def _shrink_tensors():
    return (
        random_tensor((T, H), torch.float32, 1),
        [random_tensor((L, R, H), torch.float32, 2)],
        random_tensor((1, T, R), torch.float32, 3),
    )


def _expand_tensors():
    return (
        random_tensor((2, T, R), torch.float32, 1),
        [random_tensor((L, 6, R), torch.float32, 2), random_tensor((L, 3, R), torch.float32, 3)],
        random_tensor((T, 11), torch.float32, 4),
    )


#: A bad ``num_active_loras``: the value, the error, and whether it can go by position
#: (a number there would be taken for scaling / offset_start).
BAD_COUNTS = {
    "an int, not a tensor": (lambda: 4, TypeError, False),
    "a float tensor": (lambda: torch.tensor([4.0]), TypeError, True),
    "a bool tensor": (lambda: torch.tensor([True]), TypeError, True),
    "two elements": (lambda: torch.tensor([4, 4], dtype=torch.int32), ValueError, True),
    "no element": (lambda: torch.zeros(0, dtype=torch.int32), ValueError, True),
    "negative": (lambda: _count(-1), ValueError, True),
    "more than len(lora_ids)": (lambda: _count(L + 2), ValueError, True),
    "fewer than the entries in use": (lambda: _count(IN_USE - 1), ValueError, True),
    "zero while tokens have a LoRA": (lambda: _count(0), ValueError, True),
}


@pytest.mark.parametrize("op", ["shrink", "expand"])
@pytest.mark.parametrize(
    "bad, by_keyword",
    [(bad, True) for bad in BAD_COUNTS]
    + [(bad, False) for bad, (_, _, positional) in BAD_COUNTS.items() if positional],
)
def test_bad_num_active_loras_is_rejected_before_any_launch(bad, by_keyword, op):
    make, error, _ = BAD_COUNTS[bad]
    tensors = _shrink_tensors() if op == "shrink" else _expand_tensors()
    snapshot = [t.clone() for t in (tensors[0], *tensors[1], tensors[2])]
    with pytest.raises(error, match="num_active_loras"):
        _run_on(op, tensors, make(), by_keyword)
    after = (tensors[0], *tensors[1], tensors[2])
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot)), "a rejected call wrote"


def _run_on(op: str, tensors, count, by_keyword: bool, meta=None) -> None:
    six = (meta or _meta()).meta_args(T)
    if op == "shrink":
        if by_keyword:
            lora_shrink(*tensors, *six, 0.5, num_active_loras=count)
        else:
            lora_shrink(*tensors, *six, count, 0.5)
    elif by_keyword:
        lora_expand(*tensors, *six, 1, True, num_active_loras=count)
    else:
        lora_expand(*tensors, *six, count, 1, True)


#: Counts that must be taken, and give the six-value form's bits.
GOOD_COUNTS = {
    "exactly the entries in use": lambda: _count(IN_USE),
    "every entry": lambda: _count(L + 1),
    "an int64 tensor": lambda: _count(IN_USE, torch.int64),
}


@pytest.mark.parametrize("op", ["shrink", "expand"])
@pytest.mark.parametrize("good", GOOD_COUNTS)
def test_good_num_active_loras_gives_the_six_value_bits(good, op):
    tensors = _shrink_tensors() if op == "shrink" else _expand_tensors()
    before = tensors[2].clone()
    copy = (tensors[0], tensors[1], tensors[2].clone())
    _run_on(op, tensors, GOOD_COUNTS[good](), by_keyword=False)
    six = _meta().meta_args(T)
    if op == "shrink":
        lora_shrink(*copy, *six, 0.5)
    else:
        lora_expand(*copy, *six, 1, True)
    same_bits(tensors[2], copy[2], good)
    assert not torch.equal(tensors[2], before), "nothing was written"


@pytest.mark.parametrize("count", [0, 1, L + 1])
@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_any_count_in_range_is_taken_when_no_token_has_a_lora(op, count):
    tensors = _shrink_tensors() if op == "shrink" else _expand_tensors()
    before = tensors[2].clone()
    _run_on(op, tensors, _count(count), by_keyword=False, meta=_meta(slots=(-1,) * T))
    assert torch.equal(tensors[2], before)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_num_active_loras_on_the_gpu_is_rejected(op):
    tensors = _shrink_tensors() if op == "shrink" else _expand_tensors()
    before = tensors[2].clone()
    count = torch.tensor([IN_USE], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_active_loras"):
        _run_on(op, tensors, count, by_keyword=True)
    assert torch.equal(tensors[2], before)


#: Calls with too many, too few or doubly given values after the metadata: each gets the
#: op's three tensors, the six values and a good seventh.
BAD_SHRINK_CALLS = {
    "seven values, no scaling": lambda t, six, n: lora_shrink(*t, *six, n),
    "six values, no scaling": lambda t, six, n: lora_shrink(*t, *six),
    "five values": lambda t, six, n: lora_shrink(*t, *six[:5]),
    "seven values, two scalings": lambda t, six, n: lora_shrink(*t, *six, n, 0.5, 0.5),
    "six values, two scalings": lambda t, six, n: lora_shrink(*t, *six, 0.5, 0.5),
    "scaling twice": lambda t, six, n: lora_shrink(*t, *six, n, 0.5, scaling=0.5),
    "num_active_loras twice": lambda t, six, n: lora_shrink(
        *t, *six, n, scaling=0.5, num_active_loras=n
    ),
}
BAD_EXPAND_CALLS = {
    "five values": lambda t, six, n: lora_expand(*t, *six[:5]),
    "seven values and three more": lambda t, six, n: lora_expand(*t, *six, n, 1, True, True),
    "six values and three more": lambda t, six, n: lora_expand(*t, *six, 1, True, True),
    "offset_start twice": lambda t, six, n: lora_expand(*t, *six, n, 1, offset_start=1),
    "num_active_loras twice": lambda t, six, n: lora_expand(*t, *six, n, num_active_loras=n),
}


@pytest.mark.parametrize(
    "op, how",
    [("shrink", h) for h in BAD_SHRINK_CALLS] + [("expand", h) for h in BAD_EXPAND_CALLS],
)
def test_calls_fitting_neither_form_raise_type_error(op, how):
    calls = BAD_SHRINK_CALLS if op == "shrink" else BAD_EXPAND_CALLS
    tensors = _shrink_tensors() if op == "shrink" else _expand_tensors()
    before = tensors[2].clone()
    with pytest.raises(TypeError):
        calls[how](tensors, _meta().meta_args(T), _count(IN_USE))
    assert torch.equal(tensors[2], before)


# -- 4. the wrapper: vLLM 0.33's calls and v0.9's ------------------------------------------

WIDTHS = [6, 3, 3]  # a small QKV layer
HIDDEN, RANK, SCALE = 13, 4, 0.5


def _layer(seed: int = 5):
    """A prepared wrapper (two requests on LoRAs, one without, padded to the batch), and
    a layer's tensors: x [T, H], A and B as vLLM stacks them, y [T, sum N_s]."""
    batch = make_batch([0, -1, 3, 2], [2, 1, 2, 1], L, False, seed)
    wrapper = prepared_wrapper(batch, L, batch.num_tokens + 2)
    rows = batch.num_tokens
    x = random_tensor((rows, HIDDEN), torch.bfloat16, seed)
    lora_a = tuple(stacked((L, RANK, HIDDEN), torch.bfloat16, seed + 1 + s) for s in range(3))
    lora_b = tuple(
        stacked((L, n, RANK), torch.bfloat16, seed + 4 + s) for s, n in enumerate(WIDTHS)
    )
    y = random_tensor((rows, sum(WIDTHS)), torch.bfloat16, seed + 7)
    return wrapper, x, lora_a, lora_b, y


#: add_lora_linear calls without a bias, each as (vLLM 0.33's call, v0.9's with bias None).
LINEAR_CALLS = {
    "positional": (
        lambda w, y, x, a, b, **k: w.add_lora_linear(y, x, a, b, SCALE, WIDTHS, **k),
        lambda w, y, x, a, b, **k: w.add_lora_linear(y, x, a, b, None, SCALE, WIDTHS, **k),
    ),
    "scale and output_slices by keyword": (
        lambda w, y, x, a, b, **k: w.add_lora_linear(
            y, x, a, b, scale=SCALE, output_slices=WIDTHS, **k
        ),
        lambda w, y, x, a, b, **k: w.add_lora_linear(
            y, x, a, b, lora_bias_stacked=None, scale=SCALE, output_slices=WIDTHS, **k
        ),
    ),
    "output_slices by keyword": (
        lambda w, y, x, a, b, **k: w.add_lora_linear(y, x, a, b, SCALE, output_slices=WIDTHS, **k),
        lambda w, y, x, a, b, **k: w.add_lora_linear(
            y, x, a, b, None, SCALE, output_slices=WIDTHS, **k
        ),
    ),
    "all by keyword": (
        lambda w, y, x, a, b, **k: w.add_lora_linear(
            y=y, x=x, lora_a_stacked=a, lora_b_stacked=b, scale=SCALE, output_slices=WIDTHS, **k
        ),
        lambda w, y, x, a, b, **k: w.add_lora_linear(
            y=y,
            x=x,
            lora_a_stacked=a,
            lora_b_stacked=b,
            lora_bias_stacked=None,
            scale=SCALE,
            output_slices=WIDTHS,
            **k,
        ),
    ),
}


@pytest.mark.parametrize(
    "how, buffer",
    [(how, False) for how in LINEAR_CALLS] + [("positional", True), ("all by keyword", True)],
)
def test_add_lora_linear_without_bias_equals_v09_with_none(how, buffer):
    new_call, old_call = LINEAR_CALLS[how]
    wrapper, x, lora_a, lora_b, y = _layer()
    y_before, y_old = y.clone(), y.clone()
    rows = x.shape[0]

    def zeros():
        return torch.zeros(3, rows, RANK, dtype=torch.float32, device=DEVICE)

    extra, extra_old = ({"buffer": zeros()}, {"buffer": zeros()}) if buffer else ({}, {})
    new_call(wrapper, y, x, lora_a, lora_b, **extra)
    old_call(wrapper, y_old, x, lora_a, lora_b, **extra_old)
    same_bits(y, y_old, f"add_lora_linear, {how}")
    if buffer:
        same_bits(extra["buffer"], extra_old["buffer"], f"add_lora_linear's buffer, {how}")

    slots = wrapper.token_lora_indices
    want = reference.add_lora_linear(y_before, x, lora_a, lora_b, None, SCALE, WIDTHS, slots)
    magnitude = reference.add_lora_linear(
        y_before.abs(), x.abs(), absolute(lora_a), absolute(lora_b), None, SCALE, WIDTHS, slots
    )
    assert_close(y, want, magnitude, terms=HIDDEN + RANK, what="add_lora_linear torch.bfloat16")
    assert torch.equal(y[slots == -1], y_before[slots == -1]), "rows without a LoRA changed"


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_add_lora_linear_v09_with_a_bias(by_keyword):
    wrapper, x, lora_a, lora_b, y = _layer()
    bias = make_bias("some slices", WIDTHS, L, torch.bfloat16, 40)  # [L, 1, N_s] or None
    y_before = y.clone()
    if by_keyword:
        wrapper.add_lora_linear(
            y, x, lora_a, lora_b, lora_bias_stacked=bias, scale=SCALE, output_slices=WIDTHS
        )
    else:
        wrapper.add_lora_linear(y, x, lora_a, lora_b, bias, SCALE, WIDTHS)
    slots = wrapper.token_lora_indices
    want = reference.add_lora_linear(y_before, x, lora_a, lora_b, bias, SCALE, WIDTHS, slots)
    magnitude = reference.add_lora_linear(
        y_before.abs(),
        x.abs(),
        absolute(lora_a),
        absolute(lora_b),
        absolute(bias),
        SCALE,
        WIDTHS,
        slots,
    )
    assert_close(y, want, magnitude, terms=HIDDEN + RANK, what="add_lora_linear torch.bfloat16")
    assert not torch.equal(
        want, reference.add_lora_linear(y_before, x, lora_a, lora_b, None, SCALE, WIDTHS, slots)
    ), "the bias adds nothing here: the test would not see it dropped"


OFFSET = 2

#: add_expand calls without a bias, each as (vLLM 0.33's call, v0.9's with bias None).
EXPAND_WRAPPER_CALLS = {
    "positional": (
        lambda w, y, x, b, add: w.add_expand(y, x, b, WIDTHS, OFFSET, add),
        lambda w, y, x, b, add: w.add_expand(y, x, b, None, WIDTHS, OFFSET, add),
    ),
    "by keyword": (
        lambda w, y, x, b, add: w.add_expand(
            y, x, b, output_slices=WIDTHS, offset_start=OFFSET, add_inputs=add
        ),
        lambda w, y, x, b, add: w.add_expand(
            y,
            x,
            b,
            lora_bias_stacked=None,
            output_slices=WIDTHS,
            offset_start=OFFSET,
            add_inputs=add,
        ),
    ),
    "output_slices positional, the rest by keyword": (
        lambda w, y, x, b, add: w.add_expand(y, x, b, WIDTHS, offset_start=OFFSET, add_inputs=add),
        lambda w, y, x, b, add: w.add_expand(
            y, x, b, None, WIDTHS, offset_start=OFFSET, add_inputs=add
        ),
    ),
}


def _expand_layer():
    wrapper, _, _, lora_b, _ = _layer()
    rows = wrapper.token_lora_indices.shape[0]
    x = random_tensor((3, rows, RANK), torch.float32, 50)  # [S, T, r]: the shrink buffer
    y = random_tensor((rows, OFFSET + sum(WIDTHS) + 1), torch.bfloat16, 51)
    return wrapper, x, lora_b, y


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("how", EXPAND_WRAPPER_CALLS)
def test_add_expand_without_bias_equals_v09_with_none(how, add_inputs):
    new_call, old_call = EXPAND_WRAPPER_CALLS[how]
    wrapper, x, lora_b, y = _expand_layer()
    y_before, y_old = y.clone(), y.clone()
    new_call(wrapper, y, x, lora_b, add_inputs)
    old_call(wrapper, y_old, x, lora_b, add_inputs)
    same_bits(y, y_old, f"add_expand, {how}")
    slots = wrapper.token_lora_indices
    want = reference.lora_expand(x, lora_b, y_before, slots, OFFSET, add_inputs)
    magnitude = reference.lora_expand(
        x.abs(), absolute(lora_b), y_before.abs(), slots, OFFSET, add_inputs
    )
    assert_close(y, want, magnitude, terms=RANK, what="expand torch.float32->torch.bfloat16")


def test_add_expand_defaults_in_vllm_033_form():
    """``add_expand(y, x, B, output_slices)``: offset_start 0, add_inputs True."""
    wrapper, x, lora_b, y = _expand_layer()
    y_old = y.clone()
    wrapper.add_expand(y, x, lora_b, WIDTHS)
    wrapper.add_expand(y_old, x, lora_b, None, WIDTHS, 0, True)
    same_bits(y, y_old, "add_expand, defaults")


#: Malformed wrapper calls: (the call, the argument its TypeError must name).
BAD_WRAPPER_CALLS = {
    "linear: scale by position and by keyword": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, SCALE, WIDTHS, scale=SCALE),
        "scale",
    ),
    "linear v0.9: scale by position and by keyword": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, None, SCALE, WIDTHS, scale=SCALE),
        "scale",
    ),
    "linear: no output_slices": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, SCALE),
        "output_slices",
    ),
    "linear v0.9: no output_slices": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, None, SCALE),
        "output_slices",
    ),
    "linear: no scale": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, output_slices=WIDTHS),
        "scale",
    ),
    "linear: output_slices twice": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, SCALE, WIDTHS, output_slices=WIDTHS),
        "output_slices",
    ),
    "linear v0.9: lora_bias_stacked twice": (
        lambda w, y, x, a, b: w.add_lora_linear(
            y, x, a, b, None, SCALE, WIDTHS, lora_bias_stacked=None
        ),
        "lora_bias_stacked",
    ),
    "linear: a value too many": (
        lambda w, y, x, a, b: w.add_lora_linear(y, x, a, b, None, SCALE, WIDTHS, 0),
        "add_lora_linear",
    ),
    "expand: no output_slices": (
        lambda w, y, x, a, b: w.add_expand(y, x, b),
        "output_slices",
    ),
    "expand v0.9: no output_slices": (
        lambda w, y, x, a, b: w.add_expand(y, x, b, None),
        "output_slices",
    ),
    "expand: offset_start twice": (
        lambda w, y, x, a, b: w.add_expand(y, x, b, WIDTHS, OFFSET, offset_start=OFFSET),
        "offset_start",
    ),
    "expand v0.9: add_inputs twice": (
        lambda w, y, x, a, b: w.add_expand(y, x, b, None, WIDTHS, 0, True, add_inputs=True),
        "add_inputs",
    ),
    "expand: a value too many": (
        lambda w, y, x, a, b: w.add_expand(y, x, b, WIDTHS, 0, True, True),
        "add_expand",
    ),
}


@pytest.mark.parametrize("how", BAD_WRAPPER_CALLS)
def test_malformed_wrapper_calls_raise_type_error(how):
    call, names = BAD_WRAPPER_CALLS[how]
    wrapper, x, lora_a, lora_b, y = _layer()
    if how.startswith("expand"):
        wrapper, x, lora_b, y = _expand_layer()
    before = y.clone()
    with pytest.raises(TypeError, match=re.escape(names)):
        call(wrapper, y, x, lora_a, lora_b)
    assert torch.equal(y, before), "a rejected call wrote"


# -- 5. the documentation page --------------------------------------------------------------


def test_the_conventions_page_examples_run():
    """docs/vllm_conventions.md's Python blocks, run in order (their asserts check them)."""
    page = (ROOT / "docs" / "vllm_conventions.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) >= 3, "the page should show the ops, the count and the wrapper"
    for needed in ("meta_args(T, specialize_active_lora=False)", "add_lora_linear(y_layer"):
        assert any(needed in block for block in blocks), needed
    for version in ("v0.8.4", "v0.9.2", "0.33"):
        assert version in page, version
    namespace: dict = {"__name__": "docs_vllm_conventions"}
    exec(compile("\n".join(blocks), str(ROOT / "docs" / "vllm_conventions.md"), "exec"), namespace)
    assert torch.equal(namespace["y_layer"], namespace["y"])
