"""One warp's tensor-core product, ``D = A @ B + C`` of shape m16 n8 k16, on both machines.

The H200's tensor cores multiply 16-bit operands far faster than its FP32 units can
(``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: a 16 x 16 tile of A times a
16 x 8 tile of B, added to a 16 x 8 fp32 tile C, in one instruction for the whole
warp). Numba has no API for them, so on the GPU :func:`mma_m16n8k16` is inline PTX.
The Numba CUDA simulator cannot run PTX; there the same function adds the same
products in Python, reading the other lanes' operands from shared memory.

**Fragments.** No lane holds a whole tile: each of the 32 lanes holds a few elements
(its *fragment*), two 16-bit elements to a 32-bit register. With ``g = lane // 4``
and ``t = lane % 4`` (PTX ISA, "Matrix Fragments for mma.m16n8k16"):

* A (16 x 16, row-major): ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``,
  ``a2 = A[g, 8+2t:8+2t+2]``, ``a3 = A[g+8, 8+2t:8+2t+2]``;
* B (16 x 8, "col": each register holds two neighbouring *k*): ``b0 = B[2t:2t+2, g]``,
  ``b1 = B[8+2t:8+2t+2, g]``;
* C and D (16 x 8, fp32): ``c0, c1 = C[g, 2t], C[g, 2t+1]``; ``c2, c3 = C[g+8, 2t],
  C[g+8, 2t+1]``.

In each register the element with the lower column (A) or k (B) sits in the low 16 bits.
So a fragment register is two neighbouring elements of a row of x or of a LoRA weight
(both keep k contiguous), and the kernels read fragments straight from memory, with no
shared-memory staging. They go one step further: a product's sum over k does not
depend on the order of the k, so they feed lane ``t`` the elements ``4t .. 4t + 3`` of
each step (one 8-byte load) as if they were ``2t, 2t + 1, 2t + 8, 2t + 9``, the same
order for both operands (:mod:`.shrink_mma`, "Whole words").

**Precision.** The products of 16-bit operands are exact; they are added in fp32. Every
lane of the warp must call the function together (it is one instruction for the warp).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
from numba import float32, uint32

from .._cuda import SIMULATOR, cuda
from .dtypes import bf16_pair, f16_pair, f16_pair_values

__all__ = [
    "FRAGMENT_WORDS",
    "MMA_DTYPES",
    "abs_bits",
    "f16_row_scale",
    "largest_of_lane_group",
    "mma_into",
    "mma_m16n8k16",
    "pair_of",
    "scaled_back",
    "split_f16_pair",
    "split_pair",
    "split_to_f16",
]

#: The operand dtypes the tensor-core kernels take, and each one's PTX type name.
MMA_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}

#: Words of one exchange of a lane's fragments on the simulator: a0..a3, b0, b1.
_EXCHANGE_WORDS = 6

#: Words of a lane's row of its warp's scratch, which only the simulator uses: two sets of
#: ``_EXCHANGE_WORDS``, one for each of two turns (:func:`_scratch_turn`).
FRAGMENT_WORDS = 2 * _EXCHANGE_WORDS if SIMULATOR else _EXCHANGE_WORDS


def _scratch_turn() -> int:
    """(Simulator only: plain Python.) The first word of the calling thread's set of its
    scratch row for its next exchange with the warp's lanes: 0 and ``_EXCHANGE_WORDS`` in
    turn, from 0 in a block's every thread.

    An exchange posts the lane's words, waits at one ``syncthreads`` for every lane's, and
    reads the others'. It needs no second barrier before the next exchange posts again: that
    one posts into the other set, which no lane still reads, and the one after it, back in
    this set, comes after the next barrier, which every lane reaches only once it has read
    this exchange's words (all threads of a block pass the same count of barriers, and the
    lanes of a warp exchange together). One barrier an exchange where there were two: on 2
    cores, blocks of 128 threads making 40 products each took 196 µs a thread a product,
    where they took 292 (``test_mma`` checks the turns, its lanes delayed by different times)."""
    thread = threading.current_thread()
    turn = getattr(thread, "scratch_turn", 0)
    thread.scratch_turn = _EXCHANGE_WORDS - turn
    return turn


@cuda.jit(device=True)
def pair_of(low_bits, high_bits):
    """Two 16-bit elements (their bits, in any integer type) as one fragment register:
    ``low_bits`` in bits 0-15, ``high_bits`` in bits 16-31."""
    low = uint32(np.int32(low_bits) & np.int32(0xFFFF))
    high = uint32(np.int32(high_bits) & np.int32(0xFFFF))
    return low | (high << uint32(16))


@cuda.jit(device=True)
def split_pair(v0, v1):
    """Two fp32 values as two fragment registers of bf16, ``(hi, lo)``: ``hi`` each value
    cut to bf16 (its top 16 bits; cutting never overflows to inf, as rounding up may),
    ``lo`` the remainders (exact in fp32) rounded to bf16 (:func:`.dtypes.bf16_pair`); the
    first value in the low halves. ``hi + lo`` keeps 16 of fp32's 24 significant bits
    (relative error <= 2**-16), against 8 for ``hi`` alone. An infinite value is its
    ``hi`` alone, with ``lo = 0``."""
    bits0 = np.float32(v0).view(np.uint32)
    bits1 = np.float32(v1).view(np.uint32)
    hi = np.uint32((bits0 >> np.uint32(16)) | (bits1 & np.uint32(0xFFFF0000)))
    cut0 = np.uint32(bits0 & np.uint32(0xFFFF0000)).view(np.float32)
    cut1 = np.uint32(bits1 & np.uint32(0xFFFF0000)).view(np.float32)
    rest0 = float32(0.0) if math.isinf(v0) else v0 - cut0
    rest1 = float32(0.0) if math.isinf(v1) else v1 - cut1
    return hi, bf16_pair(rest0, rest1)


@cuda.jit(device=True)
def split_f16_pair(pair):
    """A fragment register of two fp16 (bits 0-15, 16-31) as two of bf16, ``(hi, lo)``,
    with ``hi + lo`` each fp16 value **exactly**: :func:`split_pair` of their fp32 values.
    An fp16 value has 11 significant bits, ``hi`` keeps the top 8 and ``lo`` the other 3,
    which bf16 holds whole; bf16 has fp32's exponents, so the fp16 subnormals (down to
    2**-24) and 65504 split as exactly as the rest. An infinity is ``(inf, 0)``, a NaN
    stays a NaN in ``hi`` or ``lo``."""
    v0, v1 = f16_pair_values(pair)
    return split_pair(v0, v1)


# -- an fp32 row on the fp16 tensor cores ------------------------------------------------
#
# fp16 reaches only 65504 down to 2**-24, so an fp32 buffer row goes on the f16 tensor
# cores scaled by a power of two that brings its largest magnitude into [2**14, 2**15)
# (exact, as is the scaling back of the products), then split into two fp16
# (:mod:`.expand_mma`, "Precision").

#: The exponent field of an fp32 value whose row is scaled by 2**0 into [2**14, 2**15):
#: a row whose largest magnitude has exponent field E is scaled by 2**(141 - E)
#: (127 + 14 = 141).
_F16_TARGET = 141
#: The largest power of two a row is scaled by, and the smallest it is scaled back by
#: (2**126, 2**-126: both normal fp32 numbers).
_F16_MOST_SHIFT = 126


@cuda.jit(device=True)
def abs_bits(value):
    """The bits of ``|value|`` (fp32) as a non-negative int32: ordered as the magnitudes are,
    with every infinity above the finite values and every NaN above the infinities."""
    return np.float32(value).view(np.int32) & np.int32(0x7FFFFFFF)


@cuda.jit(device=True)
def _largest_of_lane_group_on_gpu(value, scratch):
    value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, 1))
    return max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, 2))


@cuda.jit(device=True)
def _largest_of_lane_group_simulated(value, scratch):
    # Simulator only (it has no warp shuffles): through the warp's scratch, one barrier,
    # as the emulated product trades fragments (_scratch_turn).
    lane, at = cuda.threadIdx.x % 32, _scratch_turn()
    scratch[lane, at] = value
    cuda.syncthreads()
    first = lane - lane % 4
    return max(
        max(np.int32(scratch[first, at]), np.int32(scratch[first + 1, at])),
        max(np.int32(scratch[first + 2, at]), np.int32(scratch[first + 3, at])),
    )


#: ``largest_of_lane_group(value, scratch) -> int32``: the largest of a non-negative int32
#: ``value`` over the four lanes of the caller's group ``lane // 4`` (the lanes that hold
#: rows ``g`` and ``g + 8`` of a fragment). Two ``shfl.sync.bfly`` on the GPU (lane xor 1,
#: then xor 2; ``scratch`` unused); on the simulator, which has no warp shuffles, the
#: warp's ``[32, FRAGMENT_WORDS]`` uint32 scratch and a ``syncthreads`` (so there, as for
#: :func:`mma_m16n8k16`, every thread of the block must call it the same number of times).
#: Every lane of the warp calls it together.
largest_of_lane_group = (
    _largest_of_lane_group_simulated if SIMULATOR else _largest_of_lane_group_on_gpu
)


@cuda.jit(device=True)
def f16_row_scale(largest_bits):
    """``(scale, inverse)``, two fp32 powers of two, for a row whose largest magnitude has
    the bits ``largest_bits`` (:func:`abs_bits`): ``scale`` brings that magnitude into
    [2**14, 2**15), fp16's range with room for the rounding of its high half, and
    ``scale * inverse == 1``. Both are normal fp32 numbers: the shift is at most 126 (a row
    whose largest magnitude is below 2**-112, fp32 subnormals included, is scaled by 2**126
    only). A zero row, and a row whose largest is an infinity or a NaN, are scaled by 1."""
    biased = np.int32(largest_bits) >> np.int32(23)  # the largest's exponent field
    if np.int32(largest_bits) == np.int32(0) or biased >= np.int32(255):
        return float32(1.0), float32(1.0)
    shift = min(np.int32(_F16_TARGET) - biased, np.int32(_F16_MOST_SHIFT))  # -113 .. 126
    scale = np.int32((shift + np.int32(127)) << np.int32(23)).view(np.float32)
    inverse = np.int32((np.int32(127) - shift) << np.int32(23)).view(np.float32)
    return scale, inverse


@cuda.jit(device=True)
def split_to_f16(v0, v1):
    """Two fp32 values (already scaled, below 2**15 in magnitude) as two fragment registers
    of fp16, ``(hi, lo)``: ``hi`` each value rounded to fp16 (nearest, ties to even), ``lo``
    the remainders (exact in fp32) rounded to fp16; the first value in the low halves
    (:func:`.dtypes.f16_pair`). ``hi + lo`` keeps 22 significant bits of a value (relative
    error <= 2**-22) down to 2**-3, below that an absolute error of at most 2**-25, fp16's
    subnormal spacing halved. An infinite ``hi`` (a value past 65504, or infinite) is its
    ``hi`` alone, with ``lo = 0``; a NaN stays a NaN."""
    hi = f16_pair(v0, v1)
    h0, h1 = f16_pair_values(hi)
    rest0 = float32(0.0) if math.isinf(h0) else v0 - h0
    rest1 = float32(0.0) if math.isinf(h1) else v1 - h1
    return hi, f16_pair(rest0, rest1)


@cuda.jit(device=True)
def _scaled_back_on_gpu(value, inverse):
    return value * inverse


@cuda.jit(device=True)
def _scaled_back_simulated(value, inverse):
    # Simulator only: past fp32's range the product is an infinity, as on the GPU, which
    # numpy would warn of.
    with np.errstate(over="ignore"):
        return np.float32(value) * np.float32(inverse)


#: ``scaled_back(value, inverse) -> float32``: an fp32 sum of a scaled row's products times
#: the row's inverse scale (:func:`f16_row_scale`), a power of two: exact, but for a result
#: past fp32's range (an infinity) or below its normal numbers.
scaled_back = _scaled_back_simulated if SIMULATOR else _scaled_back_on_gpu


@functools.cache
def mma_m16n8k16(dtype: torch.dtype):
    """The device function ``(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch) -> (d0, d1,
    d2, d3)`` for operands of ``dtype`` (bf16 or fp16): fragments as above, a-b as uint32,
    c and d as float32.

    ``scratch`` is a ``[32, FRAGMENT_WORDS]`` uint32 shared array of the calling warp,
    used only on the simulator (the GPU ignores it). There every thread of the *block*
    must call the function the same number of times: the lanes trade fragments through
    ``scratch`` at a ``syncthreads`` (the simulator has no warp-level barrier).
    """
    kind = MMA_DTYPES[dtype]
    if SIMULATOR:
        return _emulated(kind)
    return _tensor_core(kind)


@functools.cache
def mma_into(dtype: torch.dtype):
    """The device function ``(acc, p, a0, a1, a2, a3, b0, b1, scratch)``: one product of
    :func:`mma_m16n8k16` added to the lane's four outputs ``acc[p : p + 4]`` of a local
    accumulator array, in place."""
    mma = mma_m16n8k16(dtype)

    @cuda.jit(device=True)
    def add_product(acc, p, a0, a1, a2, a3, b0, b1, scratch):
        c0, c1, c2, c3 = acc[p], acc[p + 1], acc[p + 2], acc[p + 3]
        acc[p], acc[p + 1], acc[p + 2], acc[p + 3] = mma(
            a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch
        )

    return add_product


#: Where the simulator finds the operands of a lane's outputs among the 32 lanes'
#: fragments (the layout above, inverted): for k = 0..15, the lanes of A's rows g and
#: g + 8 (``_A_LANES[g]``) and of B's columns n = 2t, 2t + 1 (``_B_LANES[t]``), the word of
#: the set a0..a3, b0, b1 (a0 for A's row g, a1 for row g + 8, b0 for B) and the shift of
#: the element in it.
_K = np.arange(16)
_LANE_OF_K = (_K % 8) // 2
_A_LANES = [4 * g + _LANE_OF_K for g in range(8)]
_B_LANES = [4 * np.array([[2 * t], [2 * t + 1]]) + _LANE_OF_K for t in range(4)]
_A_REGISTER = np.stack([2 * (_K // 8), 1 + 2 * (_K // 8)])  # rows g and g + 8
_B_REGISTER = 4 + _K // 8
_SHIFT_OF_K = (16 * (_K % 2)).astype(np.uint32)


def _operand_words(lane: int, at: int) -> np.ndarray:
    """Where lane ``lane``'s outputs find their operands in its warp's scratch, flattened
    (rows of :data:`FRAGMENT_WORDS`), in the set of words from ``at``: A's rows g and g + 8,
    then B's columns 2t and 2t + 1, 16 elements each (the tables above, as one gather)."""
    g, t = lane // 4, lane % 4
    a = _A_LANES[g] * FRAGMENT_WORDS + at + _A_REGISTER  # [2, 16]
    b = _B_LANES[t] * FRAGMENT_WORDS + at + _B_REGISTER  # [2, 16]
    return np.concatenate([a.ravel(), b.ravel()])


#: :func:`_operand_words` of each lane (first index) and each of its two sets of words
#: (second index: :func:`_scratch_turn` // ``_EXCHANGE_WORDS``), and each element's shift.
_OPERAND_WORDS = np.array(
    [[_operand_words(lane, turn * _EXCHANGE_WORDS) for turn in (0, 1)] for lane in range(32)]
)
_OPERAND_SHIFTS = np.tile(_SHIFT_OF_K, 4)


def _decoded(bits: np.ndarray, kind: str) -> np.ndarray:
    """16-bit elements (in uint32) as fp32, exactly."""
    if kind == "bf16":
        return (bits << np.uint32(16)).view(np.float32)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _emulated(kind: str):
    @cuda.jit(device=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        # Simulator only (plain Python with numpy): every lane posts its fragments, then
        # reads the two rows of A and two columns of B its outputs need (_scratch_turn).
        lane, at = cuda.threadIdx.x % 32, _scratch_turn()
        scratch[lane, at] = a0
        scratch[lane, at + 1] = a1
        scratch[lane, at + 2] = a2
        scratch[lane, at + 3] = a3
        scratch[lane, at + 4] = b0
        scratch[lane, at + 5] = b1
        cuda.syncthreads()
        where = _OPERAND_WORDS[lane, at // _EXCHANGE_WORDS]  # [64]
        bits = scratch.reshape(-1)[where] >> _OPERAND_SHIFTS
        values = _decoded(bits & np.uint32(0xFFFF), kind)
        a, b = values[:32].reshape(2, 16), values[32:].reshape(2, 16)
        with np.errstate(all="ignore"):  # inf and NaN propagate as on the GPU, silently
            d = a @ b.T  # d[i, j]: row g + 8 i, column 2t + j (g, t = lane // 4, lane % 4)
            return c0 + d[0, 0], c1 + d[0, 1], c2 + d[1, 0], c3 + d[1, 1]

    return mma


def _tensor_core(kind: str):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    instruction = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )

    @intrinsic
    def hmma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        signature = types.UniTuple(types.float32, 4)(*[types.uint32] * 6, *[types.float32] * 4)

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            asm_type = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(asm_type, instruction, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            result = builder.call(asm, args)
            values = [builder.extract_value(result, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, values)

        return signature, codegen

    @cuda.jit(device=True)
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scratch):
        return hmma(
            uint32(a0),
            uint32(a1),
            uint32(a2),
            uint32(a3),
            uint32(b0),
            uint32(b1),
            float32(c0),
            float32(c1),
            float32(c2),
            float32(c3),
        )

    return mma
