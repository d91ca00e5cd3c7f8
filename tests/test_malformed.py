"""Malformed calls to every public entry point: a clear error that names the argument, and
nothing changed.

Each example starts from a *valid* call to one entry point (the ops, the metadata, the
mapping and every wrapper method) and applies one corruption to one argument: a wrong
dtype, shape, layout (non-contiguous, or a view that overlaps itself), device or Python
type; a slot out of range; more tokens than the buffers hold; an empty tensor where one
makes no sense; sequences of mismatched lengths. The call must raise ``ValueError`` or
``TypeError`` (exactly those, not a subclass such as numpy's ufunc errors) whose message
names the argument, and every tensor it was handed, and the state of the metadata or
wrapper it was called on, must be unchanged, bit for bit.

A corruption that touches two arguments' agreement (``inputs`` has one row more than
``output_tensor``) may be reported under either name. The wrapper's messages must name
the wrapper's arguments (``y``), not those of the ops it calls (``output_tensor``).

Known library defects are listed in ``KNOWN_DEFECTS``: the sweep leaves their cases out,
and ``test_known_defect`` runs one representative of each as a strict xfail, so a fix
shows up as an unexpected pass.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from punica_numba import LoRAKernelMeta, LoRAMapping, convert_mapping, lora_expand, lora_shrink
from punica_numba._cuda import SIMULATOR
from punica_numba.mapping import LongContextLoRAContext
from punica_numba.ops import prepare_expand, prepare_shrink
from punica_numba.wrapper import PunicaWrapperNumba

from .conftest import PROFILE
from .op_cases import meta_kwargs
from .strategies import DEVICE, DTYPES

# -- the valid calls ---------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    """The sizes of a valid call. The highest slot is always in use, and T >= 2, H >= 2,
    r >= 2, so every corruption below is malformed for every drawn baseline."""

    T: int = 5
    H: int = 12
    R: int = 4
    L: int = 3
    dtype: torch.dtype = torch.float32
    slots: tuple[int, ...] = (0, 1, -1, 2, 0)
    prompt_slots: tuple[int, ...] = (2, -1, 0)
    widths: tuple[int, int] = (5, 3)

    @property
    def capacity(self) -> int:
        """max_num_tokens of the metadata, max_num_batched_tokens of the wrapper."""
        return self.T + 3

    def ids(self, slots) -> tuple[int, ...]:
        """Adapter ids for slots: slot s holds adapter 11 + s; 0 is no LoRA."""
        return tuple(0 if s == -1 else 11 + s for s in slots)

    @property
    def lora_index_to_id(self) -> list[int]:
        return [11 + s for s in range(self.L)]


@st.composite
def dims(draw) -> Dims:
    T = draw(st.integers(2, 6), label="T")
    L = draw(st.integers(1, 3), label="L")

    def slot_list(n):
        slots = draw(st.lists(st.integers(-1, L - 1), min_size=n, max_size=n))
        slots[draw(st.integers(0, n - 1))] = L - 1  # the highest slot is in use
        return tuple(slots)

    return Dims(
        T=T,
        H=draw(st.integers(2, 12), label="H"),
        R=draw(st.integers(2, 4), label="r"),
        L=L,
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        slots=slot_list(T),
        prompt_slots=slot_list(draw(st.integers(2, 4), label="P")),
        widths=(draw(st.integers(2, 6)), draw(st.integers(2, 4))),
    )


def _randn(shape, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    return torch.randn(*shape).to(dtype=dtype, device=device)


@dataclass
class Call:
    """One call to an entry point, ready to run: keyword arguments and the state it owns."""

    entry: str
    fn: Callable
    args: dict
    owners: tuple = ()  # a LoRAKernelMeta or wrapper whose state the call must not change

    def run(self):
        return self.fn(**self.args)


def _meta(d: Dims) -> LoRAKernelMeta:
    meta = LoRAKernelMeta.make(d.L, d.capacity, DEVICE)
    meta.prepare_tensors(torch.tensor(d.slots, device=DEVICE))
    return meta


def _shrink(d: Dims, fn) -> Call:
    meta = _meta(d)
    args = dict(
        inputs=_randn((d.T, d.H), d.dtype),
        lora_a_weights=[_randn((d.L, d.R, d.H), d.dtype) for _ in range(2)],
        output_tensor=torch.zeros(2, d.T, d.R, device=DEVICE),
        **meta_kwargs(meta, d.T),
        scaling=0.5,
    )
    return Call(fn.__name__, fn, args, (meta,))


def _expand(d: Dims, fn) -> Call:
    meta = _meta(d)
    args = dict(
        inputs=_randn((2, d.T, d.R)),
        lora_b_weights=[_randn((d.L, n, d.R), d.dtype) for n in d.widths],
        output_tensor=_randn((d.T, 1 + sum(d.widths)), d.dtype),
        **meta_kwargs(meta, d.T),
        offset_start=1,
        add_inputs=True,
    )
    return Call(fn.__name__, fn, args, (meta,))


def _run_prepared(prepare):
    def run(**kwargs):
        prepare(**kwargs)()

    run.__name__ = prepare.__name__
    return run


def _make(d: Dims) -> Call:
    args = dict(max_loras=d.L, max_num_tokens=d.capacity, device=DEVICE)
    return Call("LoRAKernelMeta.make", LoRAKernelMeta.make, args)


def _prepare_tensors(d: Dims) -> Call:
    meta = _meta(d)
    args = dict(token_lora_mapping=torch.tensor(d.slots[::-1], device=DEVICE))
    return Call("LoRAKernelMeta.prepare_tensors", meta.prepare_tensors, args, (meta,))


def _meta_args(d: Dims) -> Call:
    meta = _meta(d)
    return Call("LoRAKernelMeta.meta_args", meta.meta_args, dict(token_nums=d.T), (meta,))


def _mapping_args(d: Dims) -> dict:
    return dict(
        mapping=LoRAMapping(d.ids(d.slots), d.ids(d.prompt_slots), is_prefill=True),
        lora_index_to_id=d.lora_index_to_id,
        max_loras=d.L + 1,
        vocab_size=32,
        extra_vocab_size=8,
    )


def _convert_mapping(d: Dims) -> Call:
    args = dict(
        **_mapping_args(d), device=DEVICE, long_lora_context=LongContextLoRAContext({11: 4})
    )
    return Call("convert_mapping", convert_mapping, args)


def _wrapper_init(d: Dims) -> Call:
    args = dict(max_num_batched_tokens=d.capacity, max_batches=4, device=DEVICE, max_loras=d.L)
    return Call("PunicaWrapperNumba", PunicaWrapperNumba, args)


def _wrapper(d: Dims) -> PunicaWrapperNumba:
    wrapper = PunicaWrapperNumba(d.capacity, 4, DEVICE, max_loras=d.L)
    wrapper.update_metadata(**_mapping_args(d))
    return wrapper


def _update_metadata(d: Dims) -> Call:
    w = _wrapper(d)
    args = dict(**_mapping_args(d), long_lora_context=LongContextLoRAContext({11: 4}))
    args["mapping"] = LoRAMapping(d.ids(d.slots[::-1]), d.ids(d.prompt_slots[::-1]))
    return Call("update_metadata", w.update_metadata, args, (w,))


def _add_shrink(d: Dims) -> Call:
    w = _wrapper(d)
    args = dict(
        y=torch.zeros(2, d.T, d.R, device=DEVICE),
        x=_randn((d.T, d.H), d.dtype),
        lora_a_stacked=tuple(_randn((d.L, 1, d.R, d.H), d.dtype) for _ in range(2)),
        scale=0.5,
        add_inputs=True,
    )
    return Call("add_shrink", w.add_shrink, args, (w,))


def _add_expand(d: Dims) -> Call:
    w = _wrapper(d)
    n0, n1 = d.widths
    args = dict(
        y=_randn((d.T, 1 + n0 + n1), d.dtype),
        x=_randn((2, d.T, d.R)),
        lora_b_stacked=tuple(_randn((d.L, 1, n, d.R), d.dtype) for n in d.widths),
        lora_bias_stacked=(_randn((d.L, 1, n0), d.dtype), None),
        output_slices=d.widths,
        offset_start=1,
        add_inputs=True,
    )
    return Call("add_expand", w.add_expand, args, (w,))


def _add_lora_linear(d: Dims) -> Call:
    w = _wrapper(d)
    args = dict(
        y=_randn((d.T, sum(d.widths)), d.dtype),
        x=_randn((d.T, d.H), d.dtype),
        lora_a_stacked=tuple(_randn((d.L, 1, d.R, d.H), d.dtype) for _ in d.widths),
        lora_b_stacked=tuple(_randn((d.L, 1, n, d.R), d.dtype) for n in d.widths),
        lora_bias_stacked=tuple(_randn((d.L, 1, n), d.dtype) for n in d.widths),
        scale=0.5,
        output_slices=d.widths,
        buffer=None,
    )
    return Call("add_lora_linear", w.add_lora_linear, args, (w,))


def _add_lora_embedding(d: Dims) -> Call:
    w = _wrapper(d)
    args = dict(
        y=_randn((d.T, 7), d.dtype),
        x=_randn((d.T, d.R), d.dtype),
        lora_b_stacked=_randn((d.L, 1, 7, d.R), d.dtype),
        add_inputs=True,
    )
    return Call("add_lora_embedding", w.add_lora_embedding, args, (w,))


def _add_lora_logits(d: Dims) -> Call:
    w = _wrapper(d)
    P = len(d.prompt_slots)
    args = dict(
        y=_randn((P, 10), d.dtype),
        x=_randn((P, d.H), d.dtype),
        lora_a_stacked=_randn((d.L, 1, d.R, d.H), d.dtype),
        lora_b_stacked=_randn((d.L, 1, 8, d.R), d.dtype),
        scale=0.5,
        buffer=None,
    )
    return Call("add_lora_logits", w.add_lora_logits, args, (w,))


BASELINES: dict[str, Callable[[Dims], Call]] = {
    "lora_shrink": lambda d: _shrink(d, lora_shrink),
    "prepare_shrink": lambda d: _shrink(d, _run_prepared(prepare_shrink)),
    "lora_expand": lambda d: _expand(d, lora_expand),
    "prepare_expand": lambda d: _expand(d, _run_prepared(prepare_expand)),
    "LoRAKernelMeta.make": _make,
    "LoRAKernelMeta.prepare_tensors": _prepare_tensors,
    "LoRAKernelMeta.meta_args": _meta_args,
    "convert_mapping": _convert_mapping,
    "PunicaWrapperNumba": _wrapper_init,
    "update_metadata": _update_metadata,
    "add_shrink": _add_shrink,
    "add_expand": _add_expand,
    "add_lora_linear": _add_lora_linear,
    "add_lora_embedding": _add_lora_embedding,
    "add_lora_logits": _add_lora_logits,
}

# -- the corruptions ---------------------------------------------------------------------


class NotApplicable(Exception):
    """This corruption cannot be applied to this baseline (e.g. a one-element tensor has
    no non-contiguous view)."""


def _wrong_devices(kind: str) -> tuple[str, ...]:
    """Devices a tensor of this kind must not be on: "meta" everywhere (no data); on the
    GPU also the CPU for the kernels' tensors, and the GPU for the CPU-side flag."""
    if kind == "flag":
        return ("meta",) if SIMULATOR else ("meta", "cuda")
    if kind == "slots":  # prepare_tensors copies from any device that holds data
        return ("meta",)
    return ("meta",) if SIMULATOR else ("meta", "cpu")


BAD_DTYPES = {
    "float": (torch.float64, torch.int32, torch.bool),
    "index": (torch.int64, torch.float64, torch.bool),  # the metadata is int32
    "flag": (torch.int32, torch.float64),
    "slots": (torch.float64, torch.float32, torch.bool),  # any integer dtype is fine
}


def _on(t: torch.Tensor, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t.to(device)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view with gaps between elements (not contiguous)."""
    big = torch.zeros(*t.shape, 2, dtype=t.dtype, device=t.device)
    view = big[..., 0]
    view.copy_(t)
    if view.is_contiguous():
        raise NotApplicable("a tensor of one element has no non-contiguous view")
    return view


def _overlapping(t: torch.Tensor, how: str) -> torch.Tensor:
    """A view in which distinct indices share memory (a zero stride)."""
    dims = [d for d, n in enumerate(t.shape) if n > 1]
    if not dims:
        raise NotApplicable("every dimension has size 1: nothing can overlap")
    d = dims[0]
    if how == "expand":
        return t.narrow(d, 0, 1).expand(t.shape)
    strides = list(t.contiguous().stride())
    strides[d] = 0
    return torch.as_strided(t.clone().contiguous(), t.shape, strides)


def _fresh(t: torch.Tensor, shape) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return _randn(shape, t.dtype, t.device)
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


@dataclass(frozen=True)
class Corruption:
    """One way to break one argument. ``apply(value, call)`` returns the broken value;
    ``names`` are other arguments the message may name instead (their agreement broke)."""

    what: str
    apply: Callable
    names: tuple[str, ...] = ()


Shape = tuple[str, Callable, tuple[str, ...]]  # (label, old shape -> bad shape, other names)


@dataclass(frozen=True)
class TensorArg:
    kind: str  # a key of BAD_DTYPES
    shapes: tuple[Shape, ...] = ()
    contiguous: bool = False  # a non-contiguous or self-overlapping view must be rejected
    python_types: tuple[str, ...] = ("None", "a list", "a str")  # None may be valid

    def corruptions(self) -> list[Corruption]:
        out = [
            Corruption(f"dtype {str(dt).replace('torch.', '')}", lambda t, c, dt=dt: t.to(dt))
            for dt in BAD_DTYPES[self.kind]
        ]
        out += [
            Corruption(f"shape {label}", lambda t, c, f=f: _fresh(t, f(tuple(t.shape))), names)
            for label, f, names in self.shapes
        ]
        if self.contiguous:
            out.append(Corruption("non-contiguous", lambda t, c: _strided(t)))
            for how in ("as_strided", "expand"):
                out.append(
                    Corruption(f"overlapping ({how})", lambda t, c, h=how: _overlapping(t, h))
                )
        out += [
            Corruption(f"on {dev}", lambda t, c, dev=dev: _on(t, dev))
            for dev in _wrong_devices(self.kind)
        ]
        python = {
            "None": lambda t, c: None,
            "a list": lambda t, c: t.tolist(),
            "a str": lambda t, c: "tensor",
        }
        return out + [Corruption(label, python[label]) for label in self.python_types]


Length = tuple[str, Callable, tuple[str, ...]]  # (label, old list -> bad list, other names)


@dataclass(frozen=True)
class TensorListArg:
    element: TensorArg
    lengths: tuple[Length, ...] = ()
    elements: tuple[str, ...] = ("first", "last")
    none_ok: bool = False  # None is a valid value (a bias)

    def corruptions(self) -> list[Corruption]:
        out = [] if self.none_ok else [Corruption("None", lambda v, c: None)]
        out += [
            Corruption("a lone tensor", lambda v, c: v[0]),
            Corruption("a str", lambda v, c: "weights"),
            Corruption("empty", lambda v, c: type(v)()),
        ]
        out += [
            Corruption(f"length {label}", lambda v, c, f=f: type(v)(f(list(v))), names)
            for label, f, names in self.lengths
        ]
        for which in self.elements:
            for bad in self.element.corruptions():
                out.append(
                    Corruption(
                        f"{which} element: {bad.what}",
                        lambda v, c, w=which, b=bad: _replace_element(v, w, b.apply, c),
                        bad.names,
                    )
                )
        return out


def _replace_element(seq, which: str, apply, call):
    index = 0 if which == "first" else len(seq) - 1
    items = list(seq)
    items[index] = apply(items[index], call)
    return type(seq)(items)


INT_TYPES = (("None", None), ("a str", "3"), ("a float", 2.5), ("a bool", True))


@dataclass(frozen=True)
class IntArg:
    values: tuple[tuple[str, Callable, tuple[str, ...]], ...] = ()

    def corruptions(self) -> list[Corruption]:
        out = [
            Corruption(label, lambda v, c, f=f: f(v, c), names) for label, f, names in self.values
        ]
        return out + [Corruption(label, lambda v, c, x=x: x) for label, x in INT_TYPES]


@dataclass(frozen=True)
class RealArg:
    def corruptions(self) -> list[Corruption]:
        bad = (("None", None), ("a str", "0.5"), ("a tensor", torch.tensor(0.5)), ("complex", 1j))
        return [Corruption(label, lambda v, c, x=x: x) for label, x in bad]


@dataclass(frozen=True)
class BoolArg:
    def corruptions(self) -> list[Corruption]:
        bad = (("None", None), ("an int", 1), ("a str", "True"))
        return [Corruption(label, lambda v, c, x=x: x) for label, x in bad]


@dataclass(frozen=True)
class Custom:
    """Corruptions of a non-tensor argument: (label, (value, call) -> bad value, names)."""

    items: tuple[tuple[str, Callable, tuple[str, ...]], ...]

    def corruptions(self) -> list[Corruption]:
        return [Corruption(label, f, names) for label, f, names in self.items]


# Shape changes that no valid call allows.
def _grow(dim, by=1):
    return lambda s: s[:dim] + (s[dim] + by,) + s[dim + 1 :]


def _set(dim, value):
    return lambda s: s[:dim] + (value,) + s[dim + 1 :]


def _more_dims(s):
    return (*s, 1)


def _fewer_dims(s):
    return s[:-2] + (s[-2] * s[-1],)


def _ndim(extra=()) -> tuple[Shape, ...]:
    return (("one more dim", _more_dims, extra), ("one fewer dim", _fewer_dims, extra))


def _capacity(call: Call) -> int:
    meta_or_wrapper = call.owners[0]
    return (
        getattr(meta_or_wrapper, "max_num_tokens", None) or meta_or_wrapper.max_num_batched_tokens
    )


def _more_rows(*names):
    """Every tensor named gets capacity + 1 rows (dim ``dim``): more tokens than the
    metadata and the wrapper hold."""

    def apply(value, call):
        rows = _capacity(call) + 1
        for name, dim in names:
            t = call.args[name]
            call.args[name] = _fresh(t, _set(dim, rows)(tuple(t.shape)))
        return call.args[names[0][0]]

    return apply


def _meta_tensors() -> dict[str, TensorArg]:
    index = dict(kind="index")
    one_d = (("2-D", _more_dims, ()),)
    return {
        "token_lora_mapping": TensorArg(
            shapes=(*one_d, ("T - 1", _grow(0, -1), ()), ("empty", _set(0, 0), ())), **index
        ),
        "token_indices_sorted_by_lora_ids": TensorArg(
            shapes=(*one_d, ("T - 1", _grow(0, -1), ()), ("empty", _set(0, 0), ())), **index
        ),
        "num_tokens_per_lora": TensorArg(
            shapes=(*one_d, ("L", _grow(0, -1), ("lora_ids",)), ("L + 2", _grow(0), ("lora_ids",))),
            **index,
        ),
        "lora_token_start_loc": TensorArg(
            shapes=(*one_d, ("L + 1", _grow(0, -1), ("lora_ids",)), ("L + 3", _grow(0), ())),
            **index,
        ),
        "lora_ids": TensorArg(
            shapes=(
                *one_d,
                ("L", _grow(0, -1), ("num_tokens_per_lora", "lora_token_start_loc")),
                ("empty", _set(0, 0), ("num_tokens_per_lora", "lora_token_start_loc")),
            ),
            **index,
        ),
        "no_lora_flag_cpu": TensorArg(
            kind="flag", shapes=(("2 elements", _set(0, 2), ()), ("empty", _set(0, 0), ()))
        ),
    }


def _foreign_slot(value, call):
    """lora_ids rebuilt outside LoRAKernelMeta, using a slot the weights do not hold."""
    ids = value.clone()
    ids[ids == ids.max()] = call.owners[0].max_loras + 2
    return ids


def _shrink_spec() -> dict:
    weight = TensorArg(
        "float",
        shapes=(
            *_ndim(),
            ("K + 1", _grow(2), ("inputs",)),
            ("4-D with a middle dim of 2", lambda s: (s[0], 2, *s[1:]), ()),
            ("L - 1 slots", _grow(0, -1), ()),
            ("no slots", _set(0, 0), ()),
            ("r + 1", _grow(1), ("output_tensor",)),
        ),
        contiguous=True,
    )
    return {
        "inputs": TensorArg(
            "float",
            shapes=(
                *_ndim(),
                ("K + 1", _grow(1), ("lora_a_weights",)),
                ("T + 1", _grow(0), ("output_tensor",)),
                ("T - 1", _grow(0, -1), ("output_tensor",)),
                ("no rows", _set(0, 0), ("output_tensor",)),
            ),
            contiguous=True,
        ),
        "lora_a_weights": TensorListArg(
            weight,
            lengths=(("3 slices for a 2-slice buffer", lambda v: v + v[:1], ("output_tensor",)),),
        ),
        "output_tensor": TensorArg(
            "float",
            shapes=(
                *_ndim(),
                ("fewer slices", _set(0, 1), ("lora_a_weights",)),
                ("T + 1", _grow(1), ("inputs",)),
                ("r + 1", _grow(2), ()),
                ("empty", _set(1, 0), ("inputs",)),
            ),
            contiguous=True,
        ),
        **_meta_tensors(),
        "lora_ids (rebuilt)": Custom(
            (("a slot the weights lack, not from LoRAKernelMeta", _foreign_slot, ()),)
        ),
        "inputs (rows)": Custom(
            (
                (
                    "more tokens than the metadata holds",
                    _more_rows(("inputs", 0), ("output_tensor", 1)),
                    ("token_lora_mapping", "token_indices_sorted_by_lora_ids"),
                ),
            )
        ),
        "scaling": RealArg(),
    }


def _expand_spec() -> dict:
    weight = TensorArg(
        "float",
        shapes=(
            *_ndim(),
            ("r + 1", _grow(2), ("inputs",)),
            ("4-D with a middle dim of 2", lambda s: (s[0], 2, *s[1:]), ()),
            ("L - 1 slots", _grow(0, -1), ()),
            ("N + 1", _grow(1), ("output_tensor",)),
        ),
        contiguous=True,
    )
    return {
        "inputs": TensorArg(
            "float",
            shapes=(
                *_ndim(),
                ("fewer slices", _set(0, 1), ("lora_b_weights",)),
                ("r + 1", _grow(2), ("lora_b_weights",)),
                ("T + 1", _grow(1), ("output_tensor",)),
                ("no rows", _set(1, 0), ("output_tensor",)),
            ),
        ),
        "lora_b_weights": TensorListArg(
            weight, lengths=(("3 slices for a 2-slice input", lambda v: v + v[:1], ("inputs",)),)
        ),
        "output_tensor": TensorArg(
            "float",
            shapes=(
                *_ndim(),
                ("one column short", _grow(1, -1), ("offset_start",)),
                ("T + 1", _grow(0), ("inputs",)),
                ("no rows", _set(0, 0), ("inputs",)),
            ),
            contiguous=True,
        ),
        **_meta_tensors(),
        "lora_ids (rebuilt)": Custom(
            (("a slot the weights lack, not from LoRAKernelMeta", _foreign_slot, ()),)
        ),
        "inputs (rows)": Custom(
            (
                (
                    "more tokens than the metadata holds",
                    _more_rows(("inputs", 1), ("output_tensor", 0)),
                    ("token_lora_mapping", "token_indices_sorted_by_lora_ids"),
                ),
            )
        ),
        "offset_start": IntArg(
            (
                ("negative", lambda v, c: -1, ()),
                ("past the output", lambda v, c: v + 1, ("output_tensor",)),
            )
        ),
        "add_inputs": BoolArg(),
    }


def _device_arg(extra=(), none: bool = False) -> Custom:
    """``none``: None is no device here (torch's factories read None as the default)."""
    bad = [("not a device", lambda v, c: "not-a-device", ())]
    bad += [("None", lambda v, c: None, ())] if none else []
    bad += [(f"{dev}, not the kernels' device", lambda v, c, d=dev: d, ()) for dev in extra]
    return Custom(tuple(bad))


_NOT_KERNEL_DEVICES = ("meta",) if SIMULATOR else ("meta", "cpu")


def _mapping_arg(wrapper: bool) -> Custom:
    bad = [
        ("None", lambda v, c: None, ()),
        ("a tuple of ids", lambda v, c: v.index_mapping, ()),
        ("a str", lambda v, c: "1,2", ()),
        (
            "an unknown adapter id",
            lambda v, c: LoRAMapping((*v.index_mapping[:-1], 99), v.prompt_mapping),
            ("lora_index_to_id",),
        ),
        (
            "an unknown adapter id in prompt_mapping",
            lambda v, c: LoRAMapping(v.index_mapping, (99, *v.prompt_mapping[1:])),
            ("lora_index_to_id",),
        ),
    ]
    if wrapper:

        def longer(field_name):
            def apply(v, c):
                rows = getattr(v, field_name)
                n = c.owners[0].max_num_batched_tokens + 1
                rows = (rows * n)[:n]
                return dataclasses.replace(v, **{field_name: rows})

            return apply

        bad += [
            ("more tokens than max_num_batched_tokens", longer("index_mapping"), ()),
            ("more sampled rows than max_num_batched_tokens", longer("prompt_mapping"), ()),
        ]
    return Custom(tuple(bad))


def _index_to_id_arg(wrapper: bool) -> Custom:
    bad = [
        ("None", lambda v, c: None, ()),
        ("an int", lambda v, c: 3, ()),
        ("a str", lambda v, c: "abc", ()),
        ("holding a str", lambda v, c: ["x", *v[1:]], ()),
        ("missing an id in use", lambda v, c: v[:-1], ("index_mapping", "prompt_mapping")),
    ]
    if wrapper:  # an id in use sits in slot L, which the wrapper does not have
        bad.append(("longer than max_loras", lambda v, c: [None, *v], ("mapping",)))
    return Custom(tuple(bad))


def _long_lora_arg() -> Custom:
    return Custom(
        (
            ("a dict", lambda v, c: {11: 4}, ()),
            ("a str", lambda v, c: "context", ()),
        )
    )


def _vocab_arg() -> IntArg:
    return IntArg((("negative", lambda v, c: -1, ()),))


def _mapping_specs(wrapper: bool) -> dict:
    return {
        "mapping": _mapping_arg(wrapper),
        "lora_index_to_id": _index_to_id_arg(wrapper),
        "max_loras": IntArg((("0", lambda v, c: 0, ()), ("negative", lambda v, c: -1, ()))),
        "vocab_size": _vocab_arg(),
        "extra_vocab_size": _vocab_arg(),
        "long_lora_context": _long_lora_arg(),
    }


def _positive_int() -> IntArg:
    return IntArg((("0", lambda v, c: 0, ()), ("negative", lambda v, c: -1, ())))


def _wrapper_x_rows(*names):
    return Custom(
        (
            (
                "more tokens than max_num_batched_tokens",
                _more_rows(*names),
                tuple(n for n, _ in names),
            ),
        )
    )


def _shrink_weights() -> TensorArg:
    return TensorArg(
        "float",
        shapes=(
            ("2-D", lambda s: s[-2:], ()),
            ("K + 1", _grow(-1), ("x",)),
            ("middle dim of 2", _set(1, 2), ()),
            ("L - 1 slots", _grow(0, -1), ()),
            ("r + 1", _grow(-2), ("y", "buffer")),
        ),
        contiguous=True,
    )


def _expand_weights(wider: int = 1) -> TensorArg:
    return TensorArg(
        "float",
        shapes=(
            ("2-D", lambda s: s[-2:], ()),
            ("r + 1", _grow(-1), ("x", "buffer")),
            ("middle dim of 2", _set(1, 2), ()),
            ("L - 1 slots", _grow(0, -1), ()),
            (f"N + {wider}", _grow(-2, wider), ("output_slices", "y")),
        ),
        contiguous=True,
    )


_X_SHAPES = (
    ("1-D", lambda s: (s[0] * s[1],), ()),
    ("K + 1", _grow(1), ("lora_a_stacked",)),
    ("T + 1", _grow(0), ("y",)),
)
_SEQ_LENGTHS = (
    ("one more slice", lambda v: v + v[:1], ("output_slices", "y", "lora_b_stacked")),
    ("one fewer slice", lambda v: v[:1], ("output_slices", "y", "lora_b_stacked")),
)


def _slices_arg() -> Custom:
    def widths(f):
        return lambda v, c: type(v)(f(list(v)))

    others = ("lora_b_stacked", "lora_bias_stacked")
    return Custom(
        (
            ("None", lambda v, c: None, ()),
            ("an int", lambda v, c: sum(v), ()),
            ("empty", lambda v, c: (), ()),
            ("one more slice", widths(lambda v: v + v[:1]), others),
            ("one fewer slice", widths(lambda v: v[:1]), others),
            ("a width + 1", widths(lambda v: [v[0], v[1] + 1]), others),
            ("a width of 0", widths(lambda v: [v[0], 0]), others),
        )
    )


def _bias_arg() -> TensorListArg:
    return TensorListArg(
        TensorArg(
            "float",
            shapes=(
                ("1-D", lambda s: (s[0] * s[-1],), ()),
                ("L + 1 slots", _grow(0), ()),
                ("N + 1", _grow(-1), ()),
                ("no slots", _set(0, 0), ()),
            ),
            python_types=("a list", "a str"),  # a None slice is valid: no bias there
        ),
        lengths=(("one more slice", lambda v: v + v[:1], ("output_slices",)),),
        elements=("first",),
        none_ok=True,
    )


SPECS: dict[str, dict] = {
    "lora_shrink": _shrink_spec(),
    "prepare_shrink": _shrink_spec(),
    "lora_expand": _expand_spec(),
    "prepare_expand": _expand_spec(),
    "LoRAKernelMeta.make": {
        "max_loras": _positive_int(),
        "max_num_tokens": IntArg((("negative", lambda v, c: -1, ()),)),
        "device": _device_arg(_NOT_KERNEL_DEVICES),
    },
    "LoRAKernelMeta.prepare_tensors": {
        "token_lora_mapping": TensorArg(
            "slots", shapes=(("2-D", _more_dims, ()), ("capacity + 1 tokens", lambda s: (99,), ()))
        ),
        "token_lora_mapping (values)": Custom(
            (
                ("a slot = L", lambda v, c: torch.where(v == v.max(), v.max() + 1, v), ()),
                ("a slot = -2", lambda v, c: torch.where(v == v.min(), -2, v), ()),
            )
        ),
    },
    "LoRAKernelMeta.meta_args": {
        "token_nums": IntArg(
            (
                ("negative", lambda v, c: -1, ()),
                ("capacity + 1", lambda v, c: c.owners[0].max_num_tokens + 1, ()),
            )
        ),
    },
    "convert_mapping": {**_mapping_specs(wrapper=False), "device": _device_arg()},
    "PunicaWrapperNumba": {
        "max_num_batched_tokens": _positive_int(),
        "max_batches": _positive_int(),
        "max_loras": _positive_int(),
        "device": _device_arg(_NOT_KERNEL_DEVICES, none=True),
    },
    "update_metadata": _mapping_specs(wrapper=True),
    "add_shrink": {
        "y": TensorArg(
            "float",
            shapes=(
                *_ndim(),
                ("fewer slices", _set(0, 1), ("lora_a_stacked",)),
                ("r + 1", _grow(2), ()),
            ),
            contiguous=True,
        ),
        "x": TensorArg("float", shapes=_X_SHAPES, contiguous=True),
        "x (rows)": _wrapper_x_rows(("x", 0), ("y", 1)),
        "lora_a_stacked": TensorListArg(
            _shrink_weights(), lengths=(("one more slice", lambda v: v + v[:1], ("y",)),)
        ),
        "scale": RealArg(),
        "add_inputs": BoolArg(),
    },
    "add_expand": {
        "y": TensorArg(
            "float",
            shapes=(
                ("one column short", _grow(1, -1), ("offset_start",)),
                ("T + 1", _grow(0), ("x",)),
            ),
            contiguous=True,
        ),
        "x": TensorArg(
            "float",
            shapes=(
                ("2-D", lambda s: s[1:], ()),
                ("r + 1", _grow(2), ("lora_b_stacked",)),
                ("fewer slices", _set(0, 1), ("lora_b_stacked",)),
                ("T + 1", _grow(1), ("y",)),
            ),
        ),
        "x (rows)": _wrapper_x_rows(("x", 1), ("y", 0)),
        "lora_b_stacked": TensorListArg(_expand_weights(), lengths=_SEQ_LENGTHS),
        "lora_bias_stacked": _bias_arg(),
        "output_slices": _slices_arg(),
        "offset_start": IntArg(
            (("negative", lambda v, c: -1, ()), ("past the output", lambda v, c: v + 1, ("y",)))
        ),
        "add_inputs": BoolArg(),
    },
    "add_lora_linear": {
        "y": TensorArg(
            "float",
            shapes=(("one column short", _grow(1, -1), ()), ("T + 1", _grow(0), ("x",))),
            contiguous=True,
        ),
        "x": TensorArg("float", shapes=_X_SHAPES, contiguous=True),
        "x (rows)": _wrapper_x_rows(("x", 0), ("y", 0)),
        "lora_a_stacked": TensorListArg(
            _shrink_weights(),
            lengths=(("one more slice", lambda v: v + v[:1], ("lora_b_stacked", "output_slices")),),
        ),
        "lora_b_stacked": TensorListArg(_expand_weights(), lengths=_SEQ_LENGTHS),
        "lora_bias_stacked": _bias_arg(),
        "scale": RealArg(),
        "output_slices": _slices_arg(),
        "buffer": TensorArg(
            "float",
            shapes=(*_ndim(), ("r + 1", _grow(2), ()), ("T + 1", _grow(1), ("x",))),
            contiguous=True,
            python_types=("a list", "a str"),  # None: the wrapper allocates one
        ),
    },
    "add_lora_embedding": {
        "y": TensorArg(
            "float",
            shapes=(
                ("one column short", _grow(1, -1), ("lora_b_stacked",)),
                ("T + 1", _grow(0), ("x",)),
            ),
            contiguous=True,
        ),
        "x": TensorArg(
            "float",
            shapes=(
                ("3-D", _more_dims, ()),
                ("r + 1", _grow(1), ("lora_b_stacked",)),
                ("T + 1", _grow(0), ("y",)),
            ),
        ),
        "x (rows)": _wrapper_x_rows(("x", 0), ("y", 0)),
        "lora_b_stacked": _expand_weights(),
        "add_inputs": BoolArg(),
    },
    "add_lora_logits": {
        "y": TensorArg(
            "float",
            shapes=(
                ("narrower than B", _set(1, 7), ("lora_b_stacked",)),
                ("P + 1", _grow(0), ("x",)),
            ),
            contiguous=True,
        ),
        "x": TensorArg("float", shapes=_X_SHAPES, contiguous=True),
        "x (rows)": _wrapper_x_rows(("x", 0), ("y", 0)),
        "lora_a_stacked": _shrink_weights(),
        "lora_b_stacked": _expand_weights(wider=3),  # y is 2 columns wider than B
        "scale": RealArg(),
        "buffer": TensorArg(
            "float",
            shapes=(("3-D", _more_dims, ()), ("r + 1", _grow(1), ()), ("P + 1", _grow(0), ("x",))),
            contiguous=True,
            python_types=("a list", "a str"),  # None: the wrapper allocates one
        ),
    },
}


@dataclass(frozen=True)
class Case:
    """One entry point, one argument, one corruption: ``key`` names it for the reports."""

    entry: str
    arg: str  # the argument changed; "inputs (rows)" etc. change several at once
    corruption: Corruption

    @property
    def key(self) -> str:
        return f"{self.entry}: {self.arg}: {self.corruption.what}"

    @property
    def param(self) -> str:
        return self.arg.split(" (")[0]

    def accepted_names(self) -> tuple[str, ...]:
        return (self.param, *self.corruption.names)

    def apply(self, call: Call) -> None:
        if self.param == "buffer" and call.args.get("buffer") is None:
            call.args["buffer"] = _default_buffer(call)
        call.args[self.param] = self.corruption.apply(call.args[self.param], call)


def _default_buffer(call: Call) -> torch.Tensor:
    """The buffer the wrapper would allocate, so that it can be corrupted."""
    x, b = call.args["x"], call.args["lora_b_stacked"]
    if call.entry == "add_lora_logits":
        return torch.zeros(x.shape[0], b.shape[-1], device=DEVICE)
    return torch.zeros(len(b), x.shape[0], b[0].shape[-1], device=DEVICE)


ALL_CASES: list[Case] = [
    Case(entry, arg, corruption)
    for entry, spec in SPECS.items()
    for arg, kind in spec.items()
    for corruption in kind.corruptions()
]

# -- known library defects ----------------------------------------------------------------


@dataclass(frozen=True)
class Defect:
    """A library defect: the cases it affects (a regex over case keys) and one to show it."""

    pattern: str
    example: str  # the key of a case that shows it (run as a strict xfail)
    what: str
    gpu_unsafe: bool = False  # out of bounds on a GPU: only shown on the simulator

    def matches(self, key: str) -> bool:
        return re.search(self.pattern, key) is not None


_OPS = r"^(lora|prepare)_(shrink|expand)"
_INT_TYPES = r"(None|a str|a float|a bool)$"

KNOWN_DEFECTS: dict[str, Defect] = {}


def _known(case: Case) -> Defect | None:
    return next((d for d in KNOWN_DEFECTS.values() if d.matches(case.key)), None)


SWEPT = [c for c in ALL_CASES if _known(c) is None]

# -- the checks ---------------------------------------------------------------------------


def _flatten(value, path: str, out: dict) -> dict:
    """Every tensor and plain value inside ``value`` (containers, dataclasses and the
    attributes of a meta or wrapper followed), keyed by a path."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":  # no data to compare
            out[path] = value.clone()
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k, item in value.items():
            _flatten(item, f"{path}[{k!r}]", out)
    elif isinstance(value, (LoRAKernelMeta, PunicaWrapperNumba)) or dataclasses.is_dataclass(value):
        for k, item in vars(value).items():
            _flatten(item, f"{path}.{k}", out)
    elif value is None or isinstance(value, (int, float, str, torch.device, torch.dtype)):
        out[path] = value
    return out


def _snapshot(call: Call) -> dict[str, object]:
    """Copies of every tensor and value the call was handed or owns."""
    return _flatten((call.args, call.owners), "call", {})


def _changed(before: dict, after: dict) -> list[str]:
    changed = [k for k in after if k not in before] + [k for k in before if k not in after]
    for k, old in before.items():
        new = after.get(k)
        if isinstance(old, torch.Tensor):
            same = isinstance(new, torch.Tensor) and torch.equal(old, new)
        else:
            same = old == new
        if not same:
            changed.append(k)
    return changed


def _names_in(message: str, names) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


def check_rejected(case: Case, d: Dims) -> None:
    """Apply ``case`` to the valid call of ``d``; the call must raise ValueError or
    TypeError naming the argument and change nothing."""
    call = BASELINES[case.entry](d)
    case.apply(call)
    before = _snapshot(call)
    try:
        call.run()
    except (ValueError, TypeError) as e:
        error = e
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        raise AssertionError(f"{case.key}: raised {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"{case.key}: the malformed call was accepted")
    assert type(error) in (ValueError, TypeError), (
        f"{case.key}: raised {type(error).__module__}.{type(error).__name__}, a subclass: {error}"
    )
    names = case.accepted_names()
    assert _names_in(str(error), names), (
        f"{case.key}: the message does not name {' or '.join(names)}: {error}"
    )
    changed = _changed(before, _snapshot(call))
    assert not changed, f"{case.key}: a rejected call changed {changed}"


# -- the tests ----------------------------------------------------------------------------

EXAMPLES = {"dev": 150, "ci": 400, "sim": 1000, "gpu": 1500}.get(PROFILE, 400)


@settings(max_examples=EXAMPLES)
@given(st.data())
def test_malformed_call_is_rejected(data):
    """One drawn entry point, one drawn corruption, on a drawn valid call."""
    entry = data.draw(st.sampled_from(sorted(BASELINES)), label="entry point")
    case = data.draw(st.sampled_from([c for c in SWEPT if c.entry == entry]), label="case")
    d = data.draw(dims(), label="dims")
    try:
        check_rejected(case, d)
    except NotApplicable:
        assume(False)


@pytest.mark.parametrize("entry", sorted(BASELINES))
def test_every_corruption_once(entry):
    """Every swept case once, on the default valid call (hypothesis may miss some)."""
    for case in SWEPT:
        if case.entry == entry:
            check_rejected(case, Dims())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", sorted(BASELINES))
def test_valid_baseline_is_accepted(entry, dtype):
    """The calls the corruptions start from are valid (so each rejection is the corruption's)."""
    call = BASELINES[entry](Dims(dtype=dtype))
    call.run()


@pytest.mark.parametrize(
    "defect",
    [
        pytest.param(
            defect,
            id=name,
            marks=[pytest.mark.xfail(strict=True, reason=defect.what)]
            + (
                [pytest.mark.skipif(not SIMULATOR, reason="out of bounds on a GPU")]
                if defect.gpu_unsafe
                else []
            ),
        )
        for name, defect in KNOWN_DEFECTS.items()
    ],
)
def test_known_defect(defect):
    """One case of each known defect; it passes (and so fails strictly) once fixed."""
    (case,) = [c for c in ALL_CASES if c.key == defect.example]
    check_rejected(case, Dims())


def test_known_defects_name_real_cases():
    """Every pattern matches a case, and every example is a case of its own pattern."""
    keys = [c.key for c in ALL_CASES]
    for name, defect in KNOWN_DEFECTS.items():
        assert any(defect.matches(k) for k in keys), name
        assert defect.example in keys and defect.matches(defect.example), name
