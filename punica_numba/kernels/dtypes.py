"""Reading and writing fp16, bf16 and fp32 elements as fp32, the same way on both machines.

Every kernel computes in fp32. It reads its operands through a *loader* (storage
element -> fp32) and writes through a *storer* (fp32 -> storage element), chosen
per tensor dtype when the kernel is built (:func:`loader`, :func:`storer`).

bfloat16 is stored as ``int16`` bits (see ``punica_numba._cuda.kernel_array``)
because the CUDA simulator has no bfloat16 type. A bf16 number is the top half of
an fp32 number, so the conversions are shifts:

* bf16 -> fp32: put the 16 bits in the top of a 32-bit word (exact);
* fp32 -> bf16: round to nearest even on the 16 bits that are dropped.

Every shift operand is cast to a 32-bit type explicitly: on the GPU Numba would
promote ``int16 << 16`` to int64, while on the simulator numpy keeps int16 and
the result would be 0.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import float32, int16, int64
from numba.cuda.types import float16

from .._cuda import SIMULATOR, cuda

__all__ = [
    "loader",
    "storer",
    "word_loader",
    "memory_type",
    "packing",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "f16_bits_to_f32",
    "bf16_pair",
    "bf16_pair_values",
    "bf16_word",
    "f16_pair",
    "f16_pair_values",
    "word_halves",
    "words_loader",
    "words_storer",
]

_BF16_QUIET_NAN = np.int16(0x7FC0)


@cuda.jit(device=True)
def bf16_bits_to_f32(bits):
    """int16 holding bf16 bits -> float32 (exact)."""
    return np.int32(np.int32(bits) << np.int32(16)).view(np.float32)


@cuda.jit(device=True)
def f32_to_bf16_bits(value):
    """float32 -> int16 holding the bf16 bits, rounded to nearest, ties to even."""
    if value != value:  # NaN: keep it a NaN whatever its low bits were
        return _BF16_QUIET_NAN
    word = np.float32(value).view(np.uint32)
    word = word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))
    return np.uint16(word >> np.uint32(16)).view(np.int16)


@cuda.jit(device=True)
def to_f32(value):
    """fp16 or fp32 element -> float32 (exact)."""
    return np.float32(value)


@cuda.jit(device=True)
def as_stored(value):
    """float32 -> fp16 / fp32 element: the array store itself rounds (to nearest even)."""
    return value


def loader(dtype: torch.dtype):
    """The device function that reads one element of a ``dtype`` tensor as fp32."""
    return bf16_bits_to_f32 if dtype == torch.bfloat16 else to_f32


def storer(dtype: torch.dtype):
    """The device function that turns an fp32 value into one element of a ``dtype`` tensor."""
    return f32_to_bf16_bits if dtype == torch.bfloat16 else as_stored


# -- packed words: several elements read with one 8-byte load ------------------------------
#
# A row whose length in bytes is a multiple of 8 can be viewed as int64 words (a
# zero-copy ``tensor.view(torch.int64)`` on the host): one load then brings 4 fp16 /
# bf16 elements or 2 fp32 elements, four times fewer load instructions than reading
# 2-byte elements. The same integer arithmetic unpacks them on both machines.


@cuda.jit(device=True)
def f16_bits_to_f32(bits):
    """The 16 bits of an IEEE half (in the low bits of an integer) -> float32 (exact)."""
    sign = np.uint32((bits >> 15) & 1) << np.uint32(31)
    exponent = (bits >> 10) & 0x1F
    mantissa = np.uint32(bits & 0x3FF)
    if exponent == 0:  # zero or subnormal: mantissa * 2**-24, exact in fp32
        magnitude = np.float32(mantissa) * np.float32(5.960464477539063e-08)
        return -magnitude if sign else magnitude
    if exponent == 31:  # inf or NaN
        return np.uint32(sign | np.uint32(0x7F800000) | (mantissa << np.uint32(13))).view(
            np.float32
        )
    biased = np.uint32(exponent + 112) << np.uint32(23)  # 127 - 15 = 112
    return np.uint32(sign | biased | (mantissa << np.uint32(13))).view(np.float32)


@cuda.jit(device=True)
def _bf16_lane(word, lane):
    bits = (word >> np.int64(16 * lane)) & np.int64(0xFFFF)
    return np.uint32(bits << np.int64(16)).view(np.float32)


@cuda.jit(device=True)
def _f16_lane_in_software(word, lane):
    return f16_bits_to_f32((word >> np.int64(16 * lane)) & np.int64(0xFFFF))


def _f16_lane_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_f32_f16(typingctx, bits):
        signature = types.float32(types.int64)

        def codegen(context, builder, sig, args):
            asm_type = ir.FunctionType(ir.FloatType(), [ir.IntType(16)])
            # cvt.f32.f16 d, a: the half in the 16-bit register a, widened (exact)
            asm = ir.InlineAsm(asm_type, "cvt.f32.f16 $0, $1;", "=f,h")
            return builder.call(asm, [builder.trunc(args[0], ir.IntType(16))])

        return signature, codegen

    @cuda.jit(device=True)
    def f16_lane(word, lane):
        return cvt_f32_f16(np.int64(word >> np.int64(16 * lane)))

    return f16_lane


#: ``_f16_lane(word, lane) -> float32``: the fp16 in bits ``16 * lane ..`` of an int64
#: word, widened exactly. One ``cvt.f32.f16`` on the GPU; on the simulator (which cannot
#: run PTX) the integer arithmetic of :func:`f16_bits_to_f32`. On the GPU that arithmetic
#: made the T=1 shrink kernel 2,032 SASS instructions instead of 776 (ptxas 13.0), and
#: 5.44 µs instead of 2.66 on the H200 (``h200_v15_candidates.json``). A NaN stays a NaN
#: (the GPU may not keep its payload bits); ``tests/test_dtypes.py`` checks every pattern.
_f16_lane = _f16_lane_in_software if SIMULATOR else _f16_lane_on_gpu()


@cuda.jit(device=True)
def _f32_lane(word, lane):
    return np.uint32((word >> np.int64(32 * lane)) & np.int64(0xFFFFFFFF)).view(np.float32)


# -- two bf16 in 32 bits, and 8-byte words of four ---------------------------------------
#
# A kernel that writes whole 8-byte words of bf16 output (the tensor-core expand) packs
# and unpacks them in 32-bit halves: on the GPU one ``cvt.rn.bf16x2.f32`` instruction
# rounds two fp32 values into one register (the software rounding of
# :func:`f32_to_bf16_bits` costs a dozen 64-bit integer instructions per element, and
# in that kernel's epilogue it was most of the work).


def _pair_on_gpu(kind: str):
    """``pair(low, high) -> uint32`` on the GPU: ``cvt.rn.{kind}x2.f32`` rounds two fp32
    values into one register (``kind``: ``bf16`` or ``f16``), ``low`` in bits 0-15."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cvt_x2(typingctx, high, low):
        signature = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            asm_type = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            # cvt.rn.<kind>x2.f32 d, a, b: a rounded into the upper half of d, b the lower
            asm = ir.InlineAsm(asm_type, f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, args)

        return signature, codegen

    @cuda.jit(device=True)
    def pair(low, high):
        return cvt_x2(float32(high), float32(low))

    return pair


@cuda.jit(device=True)
def _bf16_pair_in_software(low, high):
    low_bits = np.uint32(np.int32(f32_to_bf16_bits(low)) & np.int32(0xFFFF))
    high_bits = np.uint32(np.int32(f32_to_bf16_bits(high)) & np.int32(0xFFFF))
    return np.uint32(low_bits | np.uint32(high_bits << np.uint32(16)))


#: ``bf16_pair(low, high) -> uint32``: two fp32 values rounded to bf16 (nearest, ties to
#: even; a NaN stays a NaN), ``low`` in bits 0-15. One instruction on the GPU, integer
#: arithmetic on the simulator (which cannot run PTX).
bf16_pair = _bf16_pair_in_software if SIMULATOR else _pair_on_gpu("bf16")


@cuda.jit(device=True)
def bf16_word(low_pair, high_pair):
    """Two :func:`bf16_pair` results as one int64 word of four bf16, ``low_pair`` in bits
    0-31: the packed form :func:`word_loader` reads. The packing looks only at the bits,
    so two :func:`f16_pair` results make a word of four fp16 the same way."""
    return np.int64(low_pair) | (np.int64(high_pair) << np.int64(32))


@cuda.jit(device=True)
def bf16_pair_values(pair):
    """The two bf16 of a 32-bit pair as fp32 (exact): bits 0-15, then bits 16-31."""
    low = np.uint32(np.uint32(pair) << np.uint32(16))
    high = np.uint32(np.uint32(pair) & np.uint32(0xFFFF0000))
    return low.view(np.float32), high.view(np.float32)


@cuda.jit(device=True)
def word_halves(word):
    """An int64 word as its two 32-bit halves (uint32): bits 0-31, then bits 32-63."""
    return np.uint32(word & np.int64(0xFFFFFFFF)), np.uint32(word >> np.int64(32))


# -- two fp16 in 32 bits ---------------------------------------------------------------
#
# The same pairs for fp16 output (the tensor-core expand of fp16 B): one
# ``cvt.rn.f16x2.f32`` rounds two fp32 values into one register on the GPU, and the two
# halves of a pair are widened by ``cvt.f32.f16`` (:data:`_f16_lane`).


@cuda.jit(device=True)
def _f16_pair_in_software(low, high):
    # Simulator only: numpy rounds fp32 to fp16 to nearest even (subnormals too); past
    # fp16's largest value that is an infinity, as on the GPU, which numpy would warn of.
    with np.errstate(over="ignore"):
        halves = np.array([low, high], dtype=np.float32).astype(np.float16)
    bits = halves.view(np.uint16).astype(np.uint32)
    return np.uint32(bits[0] | (bits[1] << np.uint32(16)))


#: ``f16_pair(low, high) -> uint32``: two fp32 values rounded to fp16 (nearest, ties to
#: even; past 65504 an infinity; a NaN stays a NaN), ``low`` in bits 0-15. One instruction
#: on the GPU; numpy's own rounding on the simulator (which cannot run PTX).
f16_pair = _f16_pair_in_software if SIMULATOR else _pair_on_gpu("f16")


@cuda.jit(device=True)
def f16_pair_values(pair):
    """The two fp16 of a 32-bit pair as fp32 (exact): bits 0-15, then bits 16-31."""
    word = np.int64(pair)
    return _f16_lane(word, 0), _f16_lane(word, 1)


@cuda.jit(device=True)
def _bf16_element(word, lane):
    return bf16_bits_to_f32(word)


@cuda.jit(device=True)
def _element(word, lane):
    return np.float32(word)


def packing(dtype: torch.dtype, packed: bool) -> int:
    """Elements per word: 8 bytes over the element size when packed, else 1."""
    return 8 // dtype.itemsize if packed else 1


def memory_type(dtype: torch.dtype, packed: bool):
    """The Numba type of one word as it sits in memory: an int64 of packed elements, or
    the element itself (bf16 travels as its int16 bits)."""
    if packed:
        return int64
    return {torch.float16: float16, torch.bfloat16: int16, torch.float32: float32}[dtype]


def word_loader(dtype: torch.dtype, packed: bool):
    """The device function ``(word, lane) -> fp32`` reading lane ``lane`` of one word:
    an int64 holding ``packing(dtype, True)`` elements, or a single element."""
    if packed:
        return {torch.bfloat16: _bf16_lane, torch.float16: _f16_lane, torch.float32: _f32_lane}[
            dtype
        ]
    return _bf16_element if dtype == torch.bfloat16 else _element


# -- 16 bytes in one load or store: two int64 words, or four int32 ---------------------
#
# Numba has no vector load from an array; an intrinsic bitcasts the address of an element
# to a pointer to a vector of 16 bytes and loads (or stores) it at once: two int64 words
# (``ld.global.v2.u64``, one ``LDG.E.128``: half the load instructions of two 8-byte
# loads, and a warp's access moves twice the bytes) or four int32 (a tile-table row).


def element_pointer(context, builder, sig, args):
    """In an intrinsic's codegen whose first two arguments are ``(row, q)``: the pointer to
    element ``q`` of the 1-D array ``row`` (also :mod:`.l2_prefetch`'s address)."""
    from numba import types
    from numba.core import cgutils

    row_type, q_type = sig.args[:2]
    array = context.make_array(row_type)(context, builder, args[0])
    index = context.cast(builder, args[1], q_type, types.intp)
    return cgutils.get_item_pointer(context, builder, row_type, array, [index])


def _vector_address(context, builder, sig, args, vector):
    """:func:`element_pointer` as a pointer to ``vector``."""
    return builder.bitcast(element_pointer(context, builder, sig, args), vector.as_pointer())


@functools.cache
def _vector_load(bits: int, count: int):
    """The intrinsic ``(row, q) -> tuple`` that loads ``count`` ``bits``-bit integers
    (16 bytes, at a multiple of 16) from element ``q`` of the 1-D array ``row`` at once."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    vector = ir.VectorType(ir.IntType(bits), count)

    @intrinsic
    def load(typingctx, row, q):
        signature = types.UniTuple(getattr(types, f"int{bits}"), count)(row, q)

        def codegen(context, builder, sig, args):
            value = builder.load(_vector_address(context, builder, sig, args, vector), align=16)
            lanes = [
                builder.extract_element(value, ir.Constant(ir.IntType(32), i)) for i in range(count)
            ]
            return context.make_tuple(builder, sig.return_type, lanes)

        return signature, codegen

    return load


@functools.cache
def _two_words_on_gpu():
    load_two = _vector_load(64, 2)

    @cuda.jit(device=True)
    def two_words(row, q):
        return load_two(row, q)

    return two_words


@cuda.jit(device=True)
def _two_words_one_by_one(row, q):
    return row[q], row[q + 1]


def words_loader(wide: bool):
    """The device function ``(row, q) -> (row[q], row[q + 1])`` for a 1-D C-contiguous
    int64 array: with ``wide`` (the caller's promise that word ``q`` starts at a multiple
    of 16 bytes) one 16-byte load on the GPU; else, and on the simulator, two loads of
    the same words (so the same results)."""
    return _two_words_on_gpu() if wide and not SIMULATOR else _two_words_one_by_one


@functools.cache
def _store_two_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def store_two(typingctx, row, q, first, second):
        signature = types.void(row, q, first, second)

        def codegen(context, builder, sig, args):
            pair = ir.VectorType(ir.IntType(64), 2)
            address = _vector_address(context, builder, sig, args, pair)
            value = ir.Constant(address.type.pointee, ir.Undefined)
            for i, word in enumerate(args[2:]):
                value = builder.insert_element(value, word, ir.Constant(ir.IntType(32), i))
            builder.store(value, address, align=16)
            return context.get_dummy_value()

        return signature, codegen

    @cuda.jit(device=True)
    def two_words_stored(row, q, first, second):
        store_two(row, q, first, second)

    return two_words_stored


@cuda.jit(device=True)
def _two_words_stored_one_by_one(row, q, first, second):
    row[q] = first
    row[q + 1] = second


def words_storer(wide: bool):
    """The device function ``(row, q, first, second)`` that stores ``row[q], row[q + 1] =
    first, second`` in a 1-D C-contiguous int64 array: with ``wide`` (word ``q`` starts at
    a multiple of 16 bytes) one 16-byte store on the GPU (``st.global.v2.u64``); else, and
    on the simulator, two stores of the same words."""
    return _store_two_on_gpu() if wide and not SIMULATOR else _two_words_stored_one_by_one


@functools.cache
def _four_int32_on_gpu():
    load_four = _vector_load(32, 4)

    @cuda.jit(device=True)
    def four_loaded(row):
        return load_four(row, 0)

    return four_loaded


@cuda.jit(device=True)
def _four_one_by_one(row):
    return row[0], row[1], row[2], row[3]


def four_int32_loader():
    """The device function ``row -> (row[0], row[1], row[2], row[3])`` for a 1-D
    C-contiguous int32 array that starts at a multiple of 16 bytes (the caller's promise):
    one 16-byte load on the GPU (``ld.global.v4.u32``), so the four arrive together;
    four loads on the simulator (the same values)."""
    return _four_int32_on_gpu() if not SIMULATOR else _four_one_by_one


@functools.cache
def _four_float32_on_gpu():
    load_four = _vector_load(32, 4)

    @cuda.jit(device=True)
    def four_loaded(row, q):
        b0, b1, b2, b3 = load_four(row, q)
        return (
            np.int32(b0).view(np.float32),
            np.int32(b1).view(np.float32),
            np.int32(b2).view(np.float32),
            np.int32(b3).view(np.float32),
        )

    return four_loaded


@cuda.jit(device=True)
def _four_float32_one_by_one(row, q):
    return row[q], row[q + 1], row[q + 2], row[q + 3]


def four_float32_loader(wide: bool):
    """The device function ``(row, q) -> (row[q], ..., row[q + 3])`` for a 1-D
    C-contiguous float32 array: with ``wide`` (the caller's promise that element ``q``
    starts at a multiple of 16 bytes) one 16-byte load on the GPU (``ld.global.v4.u32``);
    else, and on the simulator, four loads of the same elements (so the same values)."""
    return _four_float32_on_gpu() if wide and not SIMULATOR else _four_float32_one_by_one
