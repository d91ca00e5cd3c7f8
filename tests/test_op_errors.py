"""Bad input to the ops: a clear error before any launch, naming the argument; nothing changes."""

from __future__ import annotations

import re

import pytest
import torch

from punica_numba import LoRAKernelMeta, lora_expand, lora_shrink

from .op_cases import meta_kwargs
from .strategies import DEVICE

T, H, R, L = 5, 12, 4, 3


def _meta(slots=(0, 1, -1, 2, 0), max_tokens=8, max_loras=L):
    meta = LoRAKernelMeta.make(max_loras, max_tokens, DEVICE)
    meta.prepare_tensors(torch.tensor(slots, device=DEVICE))
    return meta


def shrink_args(**change):
    """Valid shrink arguments, with some replaced."""
    meta = change.pop("meta", None) or _meta()
    args = dict(
        inputs=torch.randn(T, H, device=DEVICE),
        lora_a_weights=[torch.randn(L, R, H, device=DEVICE)],
        output_tensor=torch.zeros(1, T, R, device=DEVICE),
    )
    args.update(meta_kwargs(meta, T))
    args["scaling"] = 0.5
    args.update(change)
    return args


def expand_args(**change):
    meta = change.pop("meta", None) or _meta()
    args = dict(
        inputs=torch.randn(2, T, R, device=DEVICE),
        lora_b_weights=[torch.randn(L, 6, R, device=DEVICE), torch.randn(L, 3, R, device=DEVICE)],
        output_tensor=torch.zeros(T, 12, device=DEVICE),
    )
    args.update(meta_kwargs(meta, T))
    args.update(offset_start=1, add_inputs=True)
    args.update(change)
    return args


BAD_SHRINK = {
    "dtype mismatch x vs weights": (
        dict(inputs=torch.randn(T, H, device=DEVICE).half()),
        TypeError,
        "lora_a_weights",
    ),
    "x of wrong ndim": (dict(inputs=torch.randn(T, H, 1, device=DEVICE)), ValueError, "inputs"),
    "K of x differs from K of A": (
        dict(inputs=torch.randn(T, H + 1, device=DEVICE)),
        ValueError,
        "lora_a_weights[0]",
    ),
    "buffer rank differs": (
        dict(output_tensor=torch.zeros(1, T, R + 1, device=DEVICE)),
        ValueError,
        "output_tensor",
    ),
    "fewer buffer slices than weight slices": (
        dict(lora_a_weights=[torch.randn(L, R, H, device=DEVICE)] * 2),
        ValueError,
        "output_tensor",
    ),
    "integer buffer": (
        dict(output_tensor=torch.zeros(1, T, R, dtype=torch.int32, device=DEVICE)),
        TypeError,
        "output_tensor",
    ),
    "non-contiguous x": (dict(inputs=torch.randn(H, T, device=DEVICE).t()), ValueError, "inputs"),
    "non-contiguous weights": (
        dict(lora_a_weights=[torch.randn(L, H, R, device=DEVICE).transpose(1, 2)]),
        ValueError,
        "lora_a_weights[0]",
    ),
    "metadata shorter than the tokens": (
        dict(
            meta=_meta(max_tokens=T),
            inputs=torch.randn(T + 1, H, device=DEVICE),
            output_tensor=torch.zeros(1, T + 1, R, device=DEVICE),
        ),
        ValueError,
        "token_lora_mapping",
    ),
    "weights hold fewer slots than in use": (
        dict(lora_a_weights=[torch.randn(2, R, H, device=DEVICE)]),
        ValueError,
        "slot 2",
    ),
    "weights not a list": (
        dict(lora_a_weights=torch.randn(L, R, H, device=DEVICE)),
        TypeError,
        "lora_a_weights",
    ),
    "4-D weight with a middle dim other than 1": (
        dict(lora_a_weights=[torch.randn(L, 2, R, H, device=DEVICE)]),
        ValueError,
        "lora_a_weights[0]",
    ),
    "scaling not a number": (dict(scaling="0.5"), TypeError, "scaling"),
    "int64 metadata": (
        dict(lora_ids=torch.zeros(L + 1, dtype=torch.int64, device=DEVICE)),
        TypeError,
        "lora_ids",
    ),
    "flag on the wrong side": (
        dict(no_lora_flag_cpu=torch.zeros(2, dtype=torch.bool)),
        ValueError,
        "no_lora_flag_cpu",
    ),
}

BAD_EXPAND = {
    "fp16 input with fp32 weights": (
        dict(inputs=torch.randn(2, T, R, device=DEVICE).half()),
        TypeError,
        "inputs",
    ),
    "input of wrong ndim": (dict(inputs=torch.randn(T, R, device=DEVICE)), ValueError, "inputs"),
    "rank of the buffer differs": (
        dict(inputs=torch.randn(2, T, R + 1, device=DEVICE)),
        ValueError,
        "rank",
    ),
    "fewer buffer slices than weight slices": (
        dict(inputs=torch.randn(1, T, R, device=DEVICE)),
        ValueError,
        "inputs",
    ),
    "output too narrow": (
        dict(output_tensor=torch.zeros(T, 9, device=DEVICE)),
        ValueError,
        "output_tensor",
    ),
    "negative offset_start": (dict(offset_start=-1), ValueError, "offset_start"),
    "offset_start pushing past the output": (dict(offset_start=4), ValueError, "offset_start"),
    "integer output": (
        dict(output_tensor=torch.zeros(T, 12, dtype=torch.int64, device=DEVICE)),
        TypeError,
        "output_tensor",
    ),
    "non-contiguous output": (
        dict(output_tensor=torch.zeros(12, T, device=DEVICE).t()),
        ValueError,
        "output_tensor",
    ),
    "output rows differ from tokens": (
        dict(output_tensor=torch.zeros(T + 1, 12, device=DEVICE)),
        ValueError,
        "output_tensor",
    ),
    "weights hold fewer slots than in use": (
        dict(lora_b_weights=[torch.randn(2, 6, R, device=DEVICE)]),
        ValueError,
        "slot 2",
    ),
    "weights of mixed dtypes": (
        dict(
            lora_b_weights=[
                torch.randn(L, 6, R, device=DEVICE),
                torch.randn(L, 3, R, device=DEVICE).half(),
            ]
        ),
        TypeError,
        "lora_b_weights[1]",
    ),
    "add_inputs not a bool": (dict(add_inputs=1), TypeError, "add_inputs"),
    "sorted indices shorter than the tokens": (
        dict(token_indices_sorted_by_lora_ids=torch.zeros(T - 1, dtype=torch.int32, device=DEVICE)),
        ValueError,
        "token_indices_sorted_by_lora_ids",
    ),
}


def _snapshot(args):
    return {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def _unchanged(args, before):
    return all(torch.equal(args[k], v) for k, v in before.items())


@pytest.mark.parametrize("name", BAD_SHRINK)
def test_shrink_rejects(name):
    change, error, mentions = BAD_SHRINK[name]
    args = shrink_args(**change)
    before = _snapshot(args)
    with pytest.raises(error, match=re.escape(mentions)):
        lora_shrink(**args)
    assert _unchanged(args, before)


@pytest.mark.parametrize("name", BAD_EXPAND)
def test_expand_rejects(name):
    change, error, mentions = BAD_EXPAND[name]
    args = expand_args(**change)
    before = _snapshot(args)
    with pytest.raises(error, match=re.escape(mentions)):
        lora_expand(**args)
    assert _unchanged(args, before)


def test_valid_arguments_are_accepted():
    """The baselines the bad cases start from are themselves valid (and do something)."""
    args = shrink_args()
    lora_shrink(**args)
    assert torch.count_nonzero(args["output_tensor"]) > 0
    args = expand_args()
    lora_expand(**args)
    assert torch.count_nonzero(args["output_tensor"]) > 0


def test_no_lora_batch_launches_nothing():
    args = shrink_args(meta=_meta(slots=(-1,) * T))
    lora_shrink(**args)
    assert torch.count_nonzero(args["output_tensor"]) == 0


def test_empty_batch_is_fine():
    meta = LoRAKernelMeta.make(L, 4, DEVICE)
    meta.prepare_tensors(torch.empty(0, dtype=torch.int64, device=DEVICE))
    out = torch.zeros(1, 0, R, device=DEVICE)
    lora_shrink(
        torch.zeros(0, H, device=DEVICE),
        [torch.randn(L, R, H, device=DEVICE)],
        out,
        *meta.meta_args(0),
        1.0,
    )
    y = torch.zeros(0, 6, device=DEVICE)
    lora_expand(
        torch.zeros(1, 0, R, device=DEVICE),
        [torch.randn(L, 6, R, device=DEVICE)],
        y,
        *meta.meta_args(0),
    )
