"""The tensor-core expand: the op of :mod:`.expand`, 16 tokens of one slot at a time.

With many tokens per slot the FFMA expand is bound by issuing instructions, not by
memory (v7: T=4096 on one LoRA 77 µs, a fifth of the copy bandwidth; here 32 µs in v8,
28.5 in v9). A warp's ``mma.sync`` (:mod:`.mma`) does 16 tokens x 8 columns x 16 ranks
at once:

* block: a tile of ``16 * M_TILES`` tokens of one segment (``blockIdx.x``, the tile
  table), one slice (``.y``), ``WARPS * 8 * N_TILES`` output columns (``.z``; groups
  stride by ``gridDim.z``, so a grid of fewer groups than the slice has makes each block
  walk several: ``LaunchConfig.passes``);
* warp: every token of the tile x its own ``8 * N_TILES`` columns, as ``M_TILES x
  N_TILES`` products of 16 tokens x 8 columns, each over the rank in steps of 16 (past
  r=64 in chunks of four steps: "Ranks past 64");
* the A operand is the buffer row ``x[s, token, :]``, the B operand row n of
  ``B_s[slot]``, both read straight into fragment registers (no shared memory), lane
  ``t`` taking four neighbouring elements of each rank step (for B one 8-byte word), in
  the order of "The rank in a lane's order" below.

**Whole words of output.** A product tile leaves each lane two neighbouring columns of
a row (``2t, 2t + 1``, ``t = lane % 4``). Read and written that way, a warp's access
touches 8 rows x 4 bytes here and there: 2-byte loads and stores, a quarter of each
32-byte sector (the first tensor-core expand did this and lost to the FFMA kernel
everywhere: 91 against 77 µs at T=4096 on one LoRA, branch ``next/expand-mma``). So the
kernel renumbers the columns it feeds the tensor cores: tile ``j``'s column ``c`` is
the output column ::

    16 * (j // 2) + 4 * (c // 2) + 2 * (j % 2) + c % 2

(:func:`output_column`). Tiles ``2i`` and ``2i + 1`` then leave lane ``t`` the four
neighbouring columns ``16 i + 4t .. 16 i + 4t + 3``: one 8-byte word of four bf16 (or fp16),
and the warp's 4 lanes of a row cover 32 neighbouring bytes, a whole sector, in one
access. The renumbering only chooses which row of B feeds which tensor-core column;
every output is still the same dot product.

**16-byte words** (``wide``). Four tiles at a time do the same for a 16-byte word:
tile ``j``'s column ``c`` is ``32 * (j // 4) + 8 * (c // 2) + 2 * (j % 4) + c % 2``, so
tiles ``4i .. 4i + 3`` leave lane ``t`` the eight columns ``32 i + 8t .. 32 i + 8t + 7``,
read and written by one 16-byte load and store (``ld/st.global.v2.u64``): a warp's
access moves 8 rows x 64 bytes, twice the bytes per instruction (Nsight Compute had
found the L1 the busiest unit, 77 % at T=4096 on one LoRA, with DRAM at 31 %). It
needs a warp of a multiple of 4 tiles, output rows that start at multiples of 16 bytes
and slices that start and end at multiples of 8 columns; other calls keep the 8-byte
words. Again only the rows of B fed to each tensor-core column change: the same bits.

**Precision.** The buffer is fp32 but the tensor cores take 16-bit operands. Each
buffer element is split into two bf16 values, ``hi + lo`` (:func:`.mma.split_pair`),
and with bf16 B each product tile is two ``mma``: ``lo @ B`` first, then ``hi @ B``, into
the same fp32 accumulator. That keeps 16 significant bits of each buffer element
(relative error <= 2**-16), far below the rounding of the bf16 output (2**-9). A bf16
buffer is used as it is, in one ``mma``. The old output is added last, and the sum
rounded once.

*fp16 B and output* (``dtype``; the buffer fp32 or fp16). By default (``f16_products``)
fp16 B goes on the tensor cores as it is, in their fp16 product (``mma ...
f32.f16.f16.f32``, as the tensor-core shrink does), two ``mma`` a product tile as with bf16
B. What stands in the way is the buffer: fp16 holds magnitudes from 2**-24 (6.0e-8,
subnormal; normal from 6.1e-5) to 65504, while a shrink's fp32 buffer may hold anything
fp32 does (split as it is, above 65504 an fp16 ``hi`` would be infinite, and below about
2**-3 the bits of an fp16 ``lo`` fall into fp16's subnormals and then to zero). So each
token row of the buffer is first scaled by a power of two of its own:

* its largest magnitude: each lane takes the largest of its own elements of the row, of
  every rank step, before the first split (a build of one chunk holds the values it
  splits, ``HELD``: read first in ``BUFFER_FIRST`` builds, else where the fragments were
  read; a build of chunks makes one pass over its elements first, and reads them again
  for each chunk, mostly from L1), then the four lanes ``4g .. 4g + 3``, which share rows
  ``g`` and ``g + 8``, take the largest of theirs (:func:`.mma.largest_of_lane_group`: two
  ``shfl.sync.bfly``, lane xor 1 and 2, on the bits of the lanes' largest,
  :func:`.mma.abs_bits`). A lane compares its own magnitudes as floats, a ``max`` an
  element (as bits it took a compare and a select: the r=128 build of chunks 1,200 SASS
  instructions against 1,016, ``probes/expand_f16_static.py``): an infinity ranks above
  every finite value, and a NaN may be passed over, which changes no output, for every
  output of a row sums each of its elements, so a row holding a NaN gives NaN whatever its
  scale;
* the power of two ``2**s`` that brings that magnitude into [2**14, 2**15), room left for
  the largest to round up (:func:`.mma.f16_row_scale`). ``s`` is held to -113 .. 126, so
  that ``2**s`` and ``2**-s`` are both normal fp32 numbers: a row whose largest is below
  2**-112 (fp32 subnormals included) is scaled by 2**126 only, and its products lie far
  below fp16's smallest subnormal anyway. A zero row, and a row holding an infinity or a
  NaN, are scaled by 1;
* each scaled value split into fp16 ``hi`` (rounded to nearest) and ``lo``, the remainder
  (exact in fp32) rounded (:func:`.mma.split_to_f16`), packed two to a fragment register,
  and the tile's products ``lo @ B`` first, then ``hi @ B``, into the fp32 accumulator;
* the row's sums scaled back by ``2**-s`` (:func:`.mma.scaled_back`), before the old
  output is added and the sum rounded to fp16, once.

Scaling by a power of two is exact both ways (but for a result past fp32's range, an
infinity, as fp16's output would be by far, or below fp32's normal numbers, far under
fp16's subnormals), and a product of two fp16 is exact in fp32, so what is lost is what
the split drops. ``hi + lo`` holds a scaled value to 22 significant bits (relative error
at most 2**-22) while it is at least 2**-3, and to an absolute 2**-25 (half fp16's
subnormal spacing) below that. Scaled back, an element ``x_k`` of a row whose largest
magnitude is ``m`` errs by at most ``2**-22 |x_k| + 2**-39 m``: an output errs by at most
2**-22 of its magnitude ``sum_k |x_k| |B_k|``, plus ``2**-39 m sum_k |B_k|``. Elements
below about ``2**-38 m`` lose their bits (below ``2**-40 m`` they become zero), and those
a little above keep fewer than 22 (at ``2**-30 m`` about fp16's 11). Where B is not
small at a row's largest elements that is far below fp16's own rounding of the result
(2**-11), and below the reference check's tolerance, which is relative to the magnitude;
an output whose terms come only from the small elements of a row whose large ones meet
zeros (or tiny values) of B is not held to it: the price of one scale a row. An fp16
buffer goes as it is, one ``mma`` a product tile, unscaled: its products with B are exact
in fp32, and only the sum rounds. Non-finite values: a row holding an infinity or a NaN
is not scaled, and its values go as they are; an infinite ``hi`` (an infinity, or a
finite value past 65504 in such a row) has ``lo = 0``. So every output of such a row is
infinite or NaN, as in the reference, and where the row's values past fp16's range are
its infinities alone (the others at most 65504) they are the reference's own (an
infinity of the sign of its terms, NaN where B is zero at the infinity or the signs
meet); values past 65504 beside them may turn an infinity into NaN. An infinite element
of B may give NaN rather than an infinity: a zero ``lo`` (of a buffer value exact in
fp16) times it. The other rows are not touched by it: each has its own scale. The cost
against bf16 B, past the same two products: per token row, an integer maximum over the
lane's elements, two shuffles and the scale's integer arithmetic, once a block; per pair
of buffer elements two multiplications by the scale, two ``cvt.rn.f16x2.f32``, two
``cvt.f32.f16``, two infinity checks and two subtractions (:func:`.mma.split_to_f16`,
where bf16 B splits by cuts); per output one multiplication by the inverse scale; in a
build of chunks, the first pass's loads. Compiled on a CPU machine (ptxas 13.0, sm_90a;
builds that do not ask ahead), the build of r=64 with 64 columns a warp, one pass, takes
158 registers (the three products below: 96; bf16 B: 142), and the build of r=128 in
chunks 176 (132), held to :data:`MAX_REGISTERS` with 60 bytes of spills (bf16 B: 108).
The outputs are rounded two at a time by ``cvt.rn.f16x2.f32`` (:func:`.dtypes.f16_pair`)
and the old ones widened by ``cvt.f32.f16``. On the H200 (v34, b0b959b: the benchmark at
fp16, ``h200_fp16.json`` as committed then; the grid at 23fb2ea) the expand at r=64 took
0.32-0.67x the three products' time (256 tokens over 16 LoRAs 16.96 -> 6.47 µs; bf16 5.89)
and on the grid's fp16 cases past r=64 0.69-0.81x, but for BLOOM's QKV at r=128, 512
tokens on one LoRA (146.0 -> 170.6 µs), a build of chunks.

*Three bf16 products* (``f16_products=False``; the build before the two f16 products,
v31, kept for the comparison on a GPU). The bf16 product above with B split as well, for
range without looking at the values: bf16 has fp32's exponents, so the buffer's split
above holds for every finite fp32 value; and an fp16 element of B is exactly the sum of
two bf16 (:func:`.mma.split_f16_pair`): of its 11 significant bits ``B_hi`` takes 8 and
``B_lo`` the other 3, and bf16's exponents cover fp16's, subnormals included. So each
product tile is three ``mma``, small terms first: ``lo @ B_hi``, ``hi @ B_lo``, then
``hi @ B_hi``. The term left out, ``lo @ B_lo``, is at most 2**-7 * 2**-7 of ``|x| |B|``
(each ``lo`` is at most 2**-7 of its value), and the buffer's split errs by 2**-16 more:
together under 2**-13.6 of the magnitude ``sum_k |x_k| |B_k|``, over six times below
fp16's own rounding of the result (2**-11), which the output then adds. (A fourth ``mma`` for
``lo @ B_lo`` would leave only the buffer's 2**-16.) An fp16 buffer is split the same
way, exactly (its 11 bits as B's). At the ends of fp32's range the split changes nothing
that fp16's output would show: a buffer value so small that its ``lo`` becomes a bf16
subnormal (below 2**-118) gives products below 2**-102, far under fp16's smallest
subnormal; ``hi`` never rounds up to infinity (it is cut, not rounded); and a product
past fp32's range is past fp16's by far, infinite in the FFMA kernels too. As with bf16
B, an infinite element of B or of the buffer may give NaN rather than an infinity (a
zero ``lo`` times it, in one of the terms). The cost against bf16 B: one ``mma`` more a
product tile, and a split of each register of two fp16 of B (two ``cvt.f32.f16``, two
cuts, two infinity checks, two subtractions and one ``cvt.rn.bf16x2.f32``). On the H200
(lab notes, "fp16 on the tensor cores: the third product"; at 54ec7f5) that third product
made r=64 at 256 tokens over 16 LoRAs 17.0 µs against bf16's 5.84.

The sum is a tensor-core sum, not the FFMA kernels' sequential one, so this kernel has
an arithmetic key of its own (:meth:`..launch.LaunchConfig.arithmetic`); it does not
depend on the tile shapes.

**The rank in a lane's order.** The fragment layout (:mod:`.mma`) gives lane ``t``
elements ``2t, 2t + 1`` and ``2t + 8, 2t + 9`` of each step of 16, but a dot product
does not care in which order its k come, only that the buffer and B agree (as in
:mod:`.shrink_mma`'s "Whole words"). So lane ``t`` takes, in rank step ``kk`` of
``K_STEPS``, the four elements ``4 K_STEPS t + 4 kk .. + 3``: over all the steps its
elements of a row are ``4 K_STEPS`` neighbours. Of B that is ``K_STEPS`` neighbouring
8-byte words, so where the rank is a multiple of 32 and B's rows start at multiples of
16 bytes (``wide_b``) a lane reads two steps' words in one 16-byte load; of an fp32
buffer row, each step's four elements are 16 neighbouring bytes, one 16-byte load where
the rank is a multiple of 16 and the rows start at multiples of 16 bytes (``wide_x``).
Before v19 lane ``t`` took ``16 kk + 4t ..`` and read the buffer one element at a time:
at r=64 a lane's 32 four-byte loads of the buffer and 32 eight-byte loads of B became 8
and 16 sixteen-byte ones. On the H200 (``h200_v19_candidates.json``; two or three runs
each, one process per package) the buffer's loads alone took r=64 256/16 from 7.7-8.1 µs
to 7.2-7.5, 256 tokens on one LoRA from 4.1-4.2 to 4.0; B's too took r=64 4096/64 from
40.3 to 32.9-34.0. The sums are the same products in another grouping: bits differ from
v18's, but every configuration at a rank still gives the same ones.

**Instructions.** With the products on the tensor cores, what is left is bookkeeping,
and on the H200 that bookkeeping set the pace (Nsight Compute, T=4096 on one LoRA: 77 %
of the SMs' issue rate, 12 % of the DRAM bandwidth). Three things cut it by 40 % (1,416
to 832 instructions per warp for 16 tokens x 32 columns): the outputs are rounded two at
a time by one ``cvt.rn.bf16x2.f32`` (:func:`.dtypes.bf16_pair`; rounding in integer
arithmetic took a dozen 64-bit instructions per element) and so are the buffer's low
halves (:func:`.mma.split_pair`); a buffer row and a row of B are taken once as a 1-D
view (``x[s, token]``, ``w[slot, n]``), so their address is worked out once, not per
element; and whether the rank is a multiple of 16 is compiled in, so that then no step
needs a bound check. (A block order that started the column groups of one tile together,
rather than one band of columns of every tile, lost 5-11 %; not kept.) After them the
index arithmetic was the bulk: Numba works in signed 64-bit integers and wraps negative
indices, a compare and two selects per access, and ``range`` with a run-time step calls
a 64-bit division routine. So the columns and words are unsigned (``uint64``: no
wraparound), the column groups are walked by a ``while`` loop, and the lane's numbers
come from shifts and masks; with B read as words, that took the warp's instructions
(16 tokens x 64 columns) from 1,104 to 688 and its registers from 92 to 78.

**Order of the loads.** At decode a block's time is a chain of trips to memory, each
waiting for the one before: the tile table, then the tokens (``sorted_tokens``), then
the buffer rows, B and the old outputs, then the stores. B waits only for the slot,
and the old outputs only for the tokens, but written in the order "buffer, then the
rest", ptxas issued B's loads only after the buffer's values had arrived and been
split (it does not move loads across the work that waits on them): one more trip in
the chain. So where a lane's words of B for every rank step fit in
:data:`EARLY_B_WORDS` (r <= 32 with 64 columns a warp, r <= 64 with 32; or
:data:`ONE_PASS_B_WORDS`, r <= 64 with 64 columns, where no block walks a second
column group: ``one_pass``), the kernel
loads B right after the table and the old outputs right after the tokens, before the
buffer, and a block that walks several column groups loads the next group's B and
old outputs right after its stores. On the H200 (``h200_v14_candidates.json``, run
D) that took 64 tokens over 8 LoRAs from 4.08 to 3.91 µs, 256 over 16 from 5.23 to
4.95 and 1024 over 32 from 9.58 to 9.01. With more words (r=64: 32 a lane) the
registers run out: loading half of them early, ptxas spilled 120 bytes a thread at
the 128-register ceiling and r=64 256/16 went from 8.3 to 8.9 µs (run B), so those
builds keep the first order. Either order does the same arithmetic: the same bits.
Since v19 a build whose blocks each take one column group (``one_pass``: the grid has a
block for every group) loads the 32 words early all the same, without the ceiling:
nothing of a second pass is kept live, and ptxas gives it 134 registers and no spills.
Without it, ptxas had issued the old outputs only once B's products were under way, a
third trip. On the H200 (v19, three runs each, with the 16-byte loads above) r=64 64/8
went from 5.39-5.51 µs to 5.15-5.39 and 256/16 from 7.25-7.44 to 7.12-7.29; the same
early loads with the buffer read element by element had lost (256/16 7.7 -> 8.2).

**The buffer before B** (``BUFFER_FIRST``, v25). In those one-pass builds that hold more
than :data:`EARLY_B_WORDS` words of B a lane (r=64 with 64 columns a warp), B's 16 loads went out
first and the buffer's after them: rows that every column group of the tile reads, so mostly from
L2, waiting behind 8 KB a warp from DRAM. These builds now read the buffer's rows first, keep the
values as they came (``buffer_values``), then load B and the old outputs, and split the buffer
after. Compiled on a CPU machine, ptxas still split it as soon as it had arrived and issued B's
loads only then, one more trip; the H200 machine's own compile of the op's build issues all 32 of a
lane's loads before the first split (160 registers; the ``h200_v28_candidates.json`` trials, below).
Either way, on the H200 (``h200_v25_candidates.json``: two calls, three rounds each, one process per
tree and round) r=64 256/16 went from 7.13-7.37 µs to 6.85-7.21, 64/8 from 5.05-5.21 to 4.70-4.90
and 256 on one LoRA from 4.68-4.87 to 4.53-4.66. An order without that trip (the buffer, the old
outputs, then B, which ptxas kept) was no better at 256/16 (6.86-6.90) and lost on one LoRA
(5.12-5.14); the same builds with each ``mma`` replaced by four additions were not faster (256/16
7.26-7.60): memory, not the tensor cores, set their pace then (the ``h200_v28_candidates.json``
trials, below, measured what the products add after the loads). Compiled on a CPU machine, ptxas
13.0 gives these builds 144 registers (138 before; the H200 machine's compile, 160), and every other
build compiles to the same SASS as before. The same arithmetic, so the same bits
(``test_tensor_core_expand_bits_do_not_depend_on_reading_the_buffer_first``). B brought into shared
memory by Hopper's bulk copy instead (``cp.async.bulk``, branch ``next/expand-bulk-copy``) was
slower in these builds: r=64 256/16 6.84-7.24
-> 7.39-7.43 µs with one copy a warp, 256 on one LoRA 4.56-4.62 -> 5.04-5.06
(``h200_v26_candidates.json``). Four more were measured with the dependent launch
(``h200_v27_candidates.json``, three rounds, µs at r=64 256/16 against main's 6.34-6.47):
B's rows prefetched to L2 before the wait (6.46-6.64; with the old outputs 7.54-7.64), a
warp's columns multiplied and stored in two halves so that the first half's stores could
overlap the second's loads (6.35-6.50), and B read by ``ld.global.nc.L1::no_allocate``
(6.53-6.58; 4096/64 32.5-34.3 -> 42.2-44.0, where a slot's tiles share B through L1), or by
``ld.global.L2::256B`` (6.82-6.99 against 6.21-6.46 in its call). None kept. The next trials
(``h200_v28_candidates.json``; lab notes, "where the last microsecond goes"): this
kernel's loads and stores alone, every one in flight, take 5.0-5.1 µs at r=64 256/16 (the op
6.14-6.18 in the same processes), so what is left is its work after the loads. Multiplying
only the buffer's high halves (a diagnostic: half the ``mma``, not this kernel's precision)
took 0.3-0.5 µs off each r=64 decode case (256/16: 5.71-6.03); returning where ``known < 0``
(never) after the loads, so that no work comes before one (6.25-6.45: a tie), B's loads said
to be global (6.41-6.61), a warp past its slice leaving first (6.41-6.74), some column
groups starting 0.4-1.2 µs later so that their products overlap the others' loads
(6.41-6.85), and the column halves with each half's loads together, the first half's first
(6.59-6.77 against 6.23-6.35), were no faster. The trials of ``h200_v29_candidates.json``
(lab notes, "A warp's products wait for all of its loads") read why the products cannot
start earlier: in the H200's code every one of a lane's 28 loads of data sets the same
scoreboard, and the first split waits for it, so a warp multiplies nothing before its last load
has landed. B brought through shared memory by ``cp.async`` instead, in commit groups waited
for one at a time so that a group's products run while the next streams, in 26 forms
(``probes/r64_expand_staged.py``, the same bits): the best two (B in 4 or 2 groups, the old
outputs and the buffer loaded as here) tie this kernel (6.27-6.66 against 6.17-6.52 µs), every
other form is slower, by up to 5 µs. The trials of ``h200_v30_candidates.json`` multiplied the
tile on Hopper's warpgroup instruction ``wgmma`` instead, B's rows as its register operand and
the split buffer in shared memory (``probes/r64_expand_wgmma.py``; its outputs as accurate as
these): its two committed forms 0.3-0.8 µs slower than this kernel, and the best form measured,
a draft that loaded the buffer's rows before the old outputs, 0.1-0.3 µs slower (6.29-6.52
against 6.12-6.36).

The tokens themselves were a trip of their own: a block read its tile's ``position``
from the table, then ``sorted_tokens[position + j]``. Since v16 each tile's tokens sit in
a row of their own (:func:`.segments.tile_tokens`, made with the table), which a block
finds from its own index: its table row and its tokens leave together, and the chain is
two trips (the table and tokens, then B, the old outputs and the buffer), not three.
One thing more was needed. A block with no tile leaves as soon as it has read its slot,
so its tokens are used only on the other path, and the compilers moved their loads
below that exit (LLVM sank them; ptxas too, when they were pinned in ``asm volatile``):
the trip was back. So the exit also asks for the sum of ``rows`` and the tokens, which is
never negative but which no compiler can know before it has loaded them
(``known >= 0``). On the H200 (``h200_v16_candidates.json``, call 3, medians of three)
64 tokens over 8 LoRAs went from 3.65 to 3.38 µs, 4096 on one LoRA from 25.2 to 24.0
and the QKV layer's 256 on one LoRA from 5.78 to 5.21; 256 over 16 LoRAs lost 4 %
(4.54 to 4.70), 1024 over 32 2 %.

**One slot** (``one_slot``). Two trips were still a chain: the table row and tokens,
then the rest. Where the weight stacks hold one slot (vLLM's default ``max_loras`` is 1),
B is known before any slot is, and so are the tokens if a block takes 16 of them in their
own order (tile b: tokens ``16 b ..``) rather than a segment's: the block loads B, the
buffer rows and the old outputs at once, with the tokens' slots from
``token_lora_mapping``, and stores only the rows whose slot is not -1 (and none past the
last token): the one-slot blocks of the row shrink and the lane-split expand
(:mod:`.shrink`, "One slot"), for tiles of 16 tokens. The same products, so the same bits
(``test_one_slot_gives_the_tables_bits``). On the H200 (``h200_v22_candidates.json``, two
rounds against a0f5b4d) 256 tokens on one LoRA went from 4.09/4.00 to 3.86/3.76 µs, the QKV
layer's from 5.08/4.98 to 4.76/4.61.

**Whole column groups** (``whole_groups``). A warp's columns may run past its slice's
end (a slice of 72 columns and 64 a warp), so every row of B it reads is clamped to the
slice's last, every old output word too, and every store is checked against the end.
Where every slice's width is a multiple of a warp's columns (every real layer: 4096 or
1024 against 64), a group that starts inside its slice ends inside it, and the kernel is
built without the clamps and checks: the same loads and stores, and for r=16 with 64
columns a warp 576 SASS instructions instead of 808 (r=64: 792 instead of 952; ptxas
13.0 for sm_90, at the 128-register ceiling).

**Asking ahead** (``ask_ahead``, v27). What the measurements above leave of a decode
call is a chain, and it does not overlap the next call's: each launch's blocks wait for the launch
ahead (:mod:`.dependent_launch`), read their tile, wait a trip to DRAM for B, the buffer and the old
outputs, multiply and store; while one launch's last blocks multiply and store, DRAM idles, and the
next launch's loads leave only after its wait. A build with ``ask_ahead`` says
``griddepcontrol.launch_dependents`` as its first act, so the next launch may be placed beside this
one's blocks once all of them have started, and before its wait each warp asks L2
(:mod:`.l2_prefetch`) for what it will load: its rows of B in one bulk prefetch (8 KB at r=64), its
tokens' old output words and (one column group in eight, below) buffer rows a line at a time. The
next launch's early blocks so fetch their tiles while this launch's last blocks still work, and
after their wait find them in L2. Before its wait a v27 block read only its table row and tokens,
and only to choose lines to ask for: had a kernel ahead still been writing them, a stale entry would
have asked for lines the block does not load (the bounds keep every address in its tensor). (Behind
the wrapper's own shrink it also loads B there, and a block with no tile leaves: "B before the wait"
says when nothing it reads there can be stale.) After the wait it reads them again as every kernel
does, and ``griddepcontrol.wait`` makes every write of the kernels ahead visible to it (PTX's
promise). A prefetch puts nothing in a register: the same loads, products and stores, so the same
bits (``test_asking_ahead_does_not_change_the_bits``).

On the H200 (``h200_v31_candidates.json``, a git-excluded copy with a switch; two calls,
three rounds each, one process per setting and round; µs; the kernels each case ran are in
the file):

| case | wait only (v26) | said first | + B asked for | + its tokens' rows | said late |
| --- | --- | --- | --- | --- | --- |
| r=64, 256 over 16 LoRAs | 6.14-6.46 | 6.17-6.19 | 5.85-6.08 | **5.73-5.93** | 6.71-7.06 |
| r=64, 64 over 8 LoRAs | 4.15-4.28 | 4.27-4.31 | 3.97-4.07 | **3.66-3.79** | 4.12-4.21 |
| r=16, 256 over 16 LoRAs | 3.96-4.13 | 4.25-4.38 | 3.78-3.86 | **3.68-3.81** | 4.41-4.47 |
| r=16, 1024 over 32 (two passes) | 8.13-8.52 | 8.03-8.23 | 7.74-8.00 | 7.96-8.25 | 8.48-8.62 |
| r=64, 4096 over 64 (eight passes) | 32.2-33.3 | 32.8-34.4 | 33.2-34.6 | 33.3-34.4 | 34.1-38.6 |
| r=64, 256 on one LoRA (one slot) | 4.00-4.12 | 4.82-4.86 | 4.81-4.89 | 4.69-4.80 | 4.89-4.97 |
| QKV r=16, 256 over 16 LoRAs | 5.58-5.77 | 8.49-8.53 | 8.42-8.54 | 8.48-8.80 | 7.42-7.43 |
| QKV r=64, 256 over 16 LoRAs | 9.49-9.90 | | | 10.55-10.90 | |

("+ its tokens' rows": B, the old outputs and the buffer rows asked for; "said late": all
three asked for, ``launch_dependents`` said after the loads.) Said first alone ties or loses,
as v26 found; the bytes asked for pay for it and more in launches of one slice whose blocks
each take one column group and find their tokens in the table. Launches of three slices lost
0.7-3 µs (r=64, r=16), and one slot 0.6-0.8; why was not measured. So only one-slice,
one-pass table builds ask (:func:`..ops.choice.asks_ahead`), and only up to 256 tokens, the most
measured (more tokens make more blocks, where saying it first lost in v26's trials); the
others keep the plain wait. Held
to 128 registers (160 without), so that a whole second launch of r=64's one-warp blocks
fits beside the first, the r=64 build lost (256/16: 6.84-7.11). In the benchmark at e40f18a
(v27): r=64 256/16 6.14 -> 5.93 µs, r=16 64/8 2.77 -> 2.40, 256/16 3.97 -> 3.84.

Every column group of a tile reads the same buffer rows, and in v27 all of them (64 in a slice
of 4096 columns) asked L2 for them.
Since v28 one group in :data:`BUFFER_ASKERS` does (``h200_v32_candidates.json``, three rounds):
r=16 256/16 3.79-3.81 -> 3.34-3.46 µs, 64/8 2.35 -> 2.20-2.21; r=64 tied (256/16 5.75-6.09
against 5.84-5.87); none asking, r=64 64/8 lost 0.3. In the same trials a block asking also
for the tile of the block half a grid later lost (r=64 256/16 6.24-6.52 against 5.84-6.10), and
the column group along the grid's x, so that blocks are placed tile by tile with the table's
empty rows last, lost 0.4-1.3 µs. In the benchmark at 46f9381 (v28): r=16 256/16 3.38 µs, 64/8
2.21, r=64 256/16 5.84.

**B before the wait** (v29; since v30 only behind the package's own shrink). A block that
asks ahead may also load its words of B into registers before its wait
(``load_b_before_the_wait``, in the builds that hold them all early: ``EARLY``), and a block
whose table row has no tile may leave there, without waiting. Before the wait a block may read
only what no kernel still running can be writing. The launch just ahead of it may be running
(it lets this one start once its blocks have all started, if it says
``griddepcontrol.launch_dependents`` first, or once they have all ended), and so may anything
that launch has not yet waited for. v29 took B and the table to be such everywhere; the H200
showed otherwise (``docs/benchmarks/h200_fresh_weights.txt``): behind a caller's kernel that
says ``launch_dependents`` first and then writes the weights, the bare op read stale B in most
calls. Since v30 a build loads B before its wait only where the caller promises what runs
just ahead (``b_before_the_wait``): the wrapper's ``add_lora_linear``, whose expand follows its
own shrink, which writes neither B nor the table, says ``launch_dependents`` never, and whose
blocks end only after their own wait, so every kernel before it has ended by then. The bare
op's asking builds only ask L2 before the wait, as in v28. After the wait the block reads its
table row again, as every kernel does, and loads B again should the slot differ. On the H200
(``h200_v34_candidates.json``, two calls of three rounds, one process per form and round, µs,
main in the same call): B before the wait, r=64 256/16 5.78-5.89 and 5.60-5.61 against
5.83-6.02 and 5.76-5.86, 64/8 3.30-3.47 against 3.72-3.79, r=16 256/16 3.23-3.39 against
3.45-3.57, 64/8 1.97-2.04 against 2.20-2.28; with the empty tiles leaving before the wait
too (this build), r=64 256/16 5.42-5.57 and 64/8 3.29-3.30, r=16 256/16 3.35-3.50 and 64/8
2.11-2.17. Not kept: the register loads without the bulk prefetch of B (r=64 256/16
6.17-6.33), or issued before the other asks (5.83-6.02: 160 registers in the H200 machine's
compile, as before, where this build has 142), or held to 128 registers (5.58-5.83). In the
benchmark at dab1d2e (v29): r=64 256/16 5.84 -> 5.58 µs, r=16 64/8 2.21 -> 2.11, 256/16 3.38.

**Registers.** At most 128 a thread (:data:`MAX_REGISTERS`), so that an SM holds 16
warps of it (except the one-pass builds that hold every word of B early: above). ptxas
gave the 16-byte-word kernel 132 at r=64 on the H200, and 12 warps fitted: 4096 tokens
on 64 LoRAs took 60.5 µs, against 44.7 µs with the ceiling (124 registers, no spills).
The ceiling binds only where ptxas goes over it (:func:`.._cuda.jit_kernel`): imposed on
every build it made ptxas spend more, 78 registers at r=16 became 102, and slower.

**Ranks past 64** (``chunk_steps``). A lane holds its buffer fragments of every rank step
for all of its block's column groups: ``4 * TERMS`` registers a step and m-tile (8 with
an fp32 or fp16 buffer, split in two, 4 with bf16, or with fp16 beside fp16 B on the f16
products), 32 at r=64 with an fp32 buffer. At
r=256 that would be 128, a thread's whole ceiling before its 32 accumulators, old output
words and B. So a build of more than :data:`CHUNK_STEPS` rank steps (r > 64) walks the
rank in chunks of four steps (64 ranks): for each column group, chunk by chunk, a lane
loads the chunk's buffer elements into the same fragment registers (split as ever) and
adds the chunk's products into the same fp32 accumulators; the old output is added, and
the sum rounded, only after the last chunk. What a chunk costs a lane: the registers of
r=64's fragments (32, or 16 with a bf16 buffer, per m-tile), the same for every chunk;
its loads of the buffer (2 rows x 16 elements per m-tile and step: 8 16-byte loads with
``wide_x``), made again for each column group a block walks (where r <= 64 they are
made once for all of them; a block's second reading of its rows mostly finds them in
L1 or L2); B's words a step at a time, never early ("Order of the loads": a build of
chunks is not ``EARLY``, so neither is "B before the wait"); and no accumulator more.
A build of chunks so needs about what the r=64 builds that load B late need, under
:data:`MAX_REGISTERS`. With fp16 B on the f16 products and an fp32 buffer, a build of
chunks reads the lane's elements of every chunk once more, before the first, for each
row's largest magnitude ("Precision"): the scale of a row is the same whatever the
chunks. A last chunk may be short (r=80: four steps, then one); with
``wide_b`` (a rank that is a multiple of 32) its steps are an even number.

The chunks change which registers hold the fragments, not the sums: the rank keeps one
lane order over all of its steps ("The rank in a lane's order", with ``K_STEPS`` those
of the whole rank), and each accumulator adds the steps in order, chunk after chunk, as
a build holding every step would (``chunk_steps=k_steps``): the same bits
(``tests/test_high_rank_mma.py``), and the arithmetic key stays ``("mma",)``. A build of
at most 64 ranks is one chunk, compiled as before chunks came: its bits did not change.
Past r=64 the speed on a GPU is not yet measured; ``python -m punica_numba tune`` times
every configuration of the launch table there.

Memory traffic per block: ``TILE_M * r`` buffer elements (past r=64, that many per
column group it walks), ``BLOCK_N * r`` of B (from L2 after the first tile of a slot),
and ``TILE_M * BLOCK_N`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32, uint64

from .._cuda import SIMULATOR, cuda, dependent_launch, jit_kernel
from .dependent_launch import next_launch, prologue
from .dtypes import (
    bf16_pair,
    bf16_pair_values,
    bf16_word,
    f16_pair,
    f16_pair_values,
    four_float32_loader,
    loader,
    word_halves,
    words_loader,
    words_storer,
)
from .l2_prefetch import bytes_asker, line_asker
from .mma import (
    FRAGMENT_WORDS,
    MMA_DTYPES,
    abs_bits,
    f16_row_scale,
    largest_of_lane_group,
    mma_into,
    pair_of,
    scaled_back,
    split_f16_pair,
    split_pair,
    split_to_f16,
)
from .segments import read_tile, slice_of

__all__ = ["build_mma_expand_kernel", "output_column", "output_word_maker", "rank_chunks"]

#: Output columns per word of output (four bf16 or fp16 in 8 bytes).
WORD_COLUMNS = 4
#: Words of B (two registers each) a lane loads ahead, before the tokens are known.
EARLY_B_WORDS = 16
#: ... or, where no block walks a second column group, this many (r=64 with 64 columns a
#: warp): the registers they need are then lifted above MAX_REGISTERS ("Registers").
ONE_PASS_B_WORDS = 32
#: The most registers a thread may have: 65536 / 128 = 16 warps an SM (module notes).
MAX_REGISTERS = 128
#: Asking ahead, one column group in this many asks L2 for its tile's buffer rows, which
#: every group of the tile reads ("Asking ahead"; every group asking was slower at r=16).
BUFFER_ASKERS = 8
#: Rank steps of 16 whose buffer fragments a lane holds at once (64 ranks): a build of a
#: larger rank walks it in chunks of this many steps ("Ranks past 64").
CHUNK_STEPS = 4


@cuda.jit(device=True)
def output_column(tile, column, run):
    """The output column (within a warp's ``8 * N_TILES``) of column ``column`` of the
    warp's product tile ``tile``, where ``run`` tiles (2: 8-byte words of output, 4:
    16-byte ones) leave each lane neighbouring columns: see the module's notes."""
    return 8 * run * (tile // run) + 2 * run * (column // 2) + 2 * (tile % run) + column % 2


@functools.cache
def output_word_maker(n_tiles: int, half: bool, scaled: bool):
    """The device function ``new_word(acc, old, back, mi, half, i, v)`` of a lane whose warp
    has ``n_tiles`` 8-column tiles: word v of its token row i (row ``half`` of m-tile ``mi``),
    tiles 2v and 2v + 1 of the products in ``acc`` (``scaled``: scaled back by the row's
    ``back[i]``, exactly) plus the old word ``old``, rounded to four bf16 (``half``: fp16)
    two at a time ("Whole words")."""
    N_TILES, SCALED = n_tiles, scaled
    round_pair = f16_pair if half else bf16_pair  # two fp32 outputs -> one 32-bit pair
    pair_values = f16_pair_values if half else bf16_pair_values  # and back (old outputs)

    @cuda.jit(device=True, inline="always")
    def new_word(acc, old, back, mi, half, i, v):
        p0 = (mi * N_TILES + 2 * v) * 4 + 2 * half
        p1 = p0 + 4  # tile 2v + 1
        old_low, old_high = word_halves(old)
        o0, o1 = pair_values(old_low)
        o2, o3 = pair_values(old_high)
        if SCALED:  # the products of the scaled row, times the inverse power of two
            f = back[i]
            return bf16_word(
                round_pair(scaled_back(acc[p0], f) + o0, scaled_back(acc[p0 + 1], f) + o1),
                round_pair(scaled_back(acc[p1], f) + o2, scaled_back(acc[p1 + 1], f) + o3),
            )
        return bf16_word(  # (the packing of four 16-bit elements, whichever their dtype)
            round_pair(acc[p0] + o0, acc[p0 + 1] + o1),
            round_pair(acc[p1] + o2, acc[p1 + 1] + o3),
        )

    return new_word


def rank_chunks(k_steps: int, chunk_steps: int = CHUNK_STEPS) -> tuple[int, int]:
    """``(steps, chunks)``: a build of ``k_steps`` rank steps walks the rank in ``chunks``
    chunks of ``steps`` steps (the last one may be shorter): one chunk of every step up to
    ``chunk_steps`` of them (r <= 64 by default), as every build did before chunks came
    ("Ranks past 64")."""
    steps = min(k_steps, chunk_steps)
    return steps, -(-k_steps // steps)


@functools.cache
def build_mma_expand_kernel(
    x_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    k_steps: int,
    whole: bool,
    wide: bool = False,
    whole_groups: bool = False,
    wide_x: bool = False,
    wide_b: bool = False,
    one_pass: bool = False,
    one_slot: bool = False,
    ask_ahead: bool = False,
    b_before_the_wait: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    chunk_steps: int = CHUNK_STEPS,
    f16_products: bool = True,
):
    """Compile-time specialisation: the buffer's dtype (fp32 or fp16, split in two bf16, or
    bf16),
    warps per block (``threads // 32``), 16-token tiles and 8-column tiles per warp
    (``n_tiles`` even: two tiles make a lane's word), the rank in steps of 16 (``k_steps
    = ceil(r / 16)``), and:

    * ``whole``: whether r is a multiple of 16, so that no step reaches past it and no
      bound is checked;
    * ``wide``: 16-byte words of output (``n_tiles`` a multiple of 4; the caller's
      promise that output rows start at multiples of 16 bytes and slices start and end
      at multiples of 8 columns);
    * ``whole_groups``: the caller's promise that every slice's width is a multiple of a
      warp's ``8 * n_tiles`` columns, so that a warp's column group lies wholly inside
      its slice or wholly past it, and no column or word is clamped or checked against
      the slice's end ("Whole column groups" in the module notes);
    * ``wide_x``: the caller's promise that the fp32 buffer's rows are contiguous and
      start at multiples of 16 bytes, so that a lane's four elements of a row for a rank
      step come in one 16-byte load (``whole`` too, so that none lies past the rank);
    * ``wide_b``: the caller's promise that B's rows start at multiples of 16 bytes, so
      that with an even number of whole rank steps a lane's words of B for two steps
      come in one 16-byte load (both: "The rank in a lane's order");
    * ``one_pass``: the caller's promise that the grid has a block for every column
      group, so that no block walks a second one ("Order of the loads");
    * ``one_slot``: the weight stacks hold one slot; block b takes the tokens
      ``16 * m_tiles * b ..`` in their own order and loads B, their buffer rows and old
      outputs before it knows their slots ("One slot"). The kernel's ``tiles`` argument
      is then ``token_lora_mapping`` (``tile_rows`` is not read), and the grid has a
      block per ``16 * m_tiles`` tokens.
    * ``ask_ahead``: say ``griddepcontrol.launch_dependents`` first, and before the wait
      ask L2 for the lines the block will load ("Asking ahead"); not with ``one_slot``.
    * ``b_before_the_wait``: with ``ask_ahead``, also load B into registers before the
      wait and, with no tile, leave there ("B before the wait"): the caller's promise
      that no kernel still running can be writing B or the tile table, because the
      launch just ahead of this one on the stream is one of this package's kernels that
      waits before it ends and writes neither (the wrapper's own shrink).
      The same loads, products and stores: the same bits.
    * ``dtype``: the dtype of B and of the output, bf16 or fp16; the buffer is fp32 or of
      this dtype.
    * ``f16_products``: with fp16 B, its products on the f16 tensor cores, B as it is, two
      ``mma`` a product tile: an fp32 buffer's rows each scaled by a power of two into
      fp16's range and split into fp16 hi + lo, an fp16 buffer as it is ("Precision").
      Off, B is split into two bf16 too, and each product tile is three bf16 ``mma``
      ("Three bf16 products"). Nothing changes for bf16 B.
    * ``chunk_steps``: the rank steps whose buffer fragments a lane holds at once; a
      rank of more steps is walked in chunks of this many, each chunk's fragments loaded
      for each column group ("Ranks past 64"; an even number with ``wide_b``). The
      products are added in the same order whatever the chunks: the same bits.

    The rank itself is read at run time, so that a test drawing many ranks compiles a
    handful of kernels, not one per rank.

    The kernel takes the buffer as fp32 or fp16, or as the int16 bits of its bf16
    elements; B as int64 words of four elements (``[L, N, r/4]``, r a multiple of 4); the
    output as int64 words of four elements (``[T, W/4]``: the output's width, every
    slice's first column and every slice's width are multiples of 4), and where each
    slice starts as the index of its first word."""
    if threads % 32:
        raise ValueError(f"threads must be whole warps, got {threads}")
    if n_tiles % 2:
        raise ValueError(f"n_tiles must be even (two tiles make a word), got {n_tiles}")
    if wide and n_tiles % 4:
        raise ValueError(
            f"16-byte words take 4 tiles each: n_tiles must be a multiple of 4, got {n_tiles}"
        )
    if dtype not in MMA_DTYPES:
        raise ValueError(f"B and the output must be bf16 or fp16, got {dtype}")
    if x_dtype not in (torch.float32, dtype):
        raise ValueError(f"the buffer must be fp32 or {dtype} (B's dtype), got {x_dtype}")
    HALF = dtype == torch.float16  # fp16 B and outputs
    # fp16 B on the f16 tensor cores as it is ("Precision"): the buffer's rows scaled and
    # split into fp16 hi + lo (an fp32 buffer, SCALED) or as they are (an fp16 buffer) ...
    F16 = HALF and f16_products
    SCALED = F16 and x_dtype == torch.float32
    # ... else (bf16 B, or f16_products off) an fp32 or fp16 buffer split into bf16 hi + lo,
    # and fp16 B too ("three bf16 products").
    VALUES = x_dtype != torch.bfloat16  # the buffer read as fp32 values, not bf16 bits
    SPLIT = VALUES and not (F16 and not SCALED)  # two terms, lo and hi
    if wide_x and not (x_dtype == torch.float32 and whole):
        raise ValueError("16-byte loads of the buffer take an fp32 buffer and a whole rank")
    WIDE_X = wide_x
    if ask_ahead and one_slot:
        raise ValueError("asking ahead reads the tile table, which one_slot builds have not")
    if b_before_the_wait and not ask_ahead:
        raise ValueError("B is loaded before the wait only by builds that ask ahead")
    if wide_b and not (whole and k_steps % 2 == 0):
        raise ValueError("16-byte loads of B take an even number of whole rank steps")
    B_STEP = 2 if wide_b else 1  # rank steps whose words of B a lane loads at once
    if chunk_steps < 1 or (wide_b and chunk_steps < k_steps and chunk_steps % 2):
        raise ValueError(
            f"chunks of {chunk_steps} rank steps: at least one, an even number with wide_b"
        )
    # The rank in chunks of CHUNK steps ("Ranks past 64"): one chunk up to 64 ranks.
    CHUNK, CHUNKS = rank_chunks(k_steps, chunk_steps)
    CHUNKED = CHUNKS > 1  # the fragments reloaded for each chunk and column group
    SHORT_LAST = k_steps % CHUNK != 0  # the last chunk has fewer steps
    KQ = 4 * k_steps  # elements of a row one lane multiplies, over every rank step
    load_four = four_float32_loader(wide_x)
    add_product = mma_into(torch.float16 if F16 else torch.bfloat16)
    load_x = loader(x_dtype)
    WARPS, M_TILES, N_TILES, K_STEPS = threads // 32, m_tiles, n_tiles, k_steps
    WHOLE_STEPS = whole  # no k of any step lies past the rank: no checks
    ROWS = 2 * M_TILES  # token rows a lane touches: g + 8 * i
    WORDS = N_TILES // 2  # output words a lane holds per row
    RUN = 4 if wide else 2  # tiles whose columns a lane holds side by side
    PAIR = RUN // 2  # words a lane reads or writes at once: 1 (8 bytes) or 2 (16 bytes)
    load_pair, store_pair = words_loader(wide), words_storer(wide)
    load_b_pair = words_loader(wide_b)
    WARP_N = 8 * N_TILES
    BLOCK_N = WARPS * WARP_N
    TERMS = 2 if SPLIT else 1  # A fragments per k step: lo and hi, or the buffer as it is
    A_WORDS = CHUNK * M_TILES * 4 * TERMS  # the lane's A fragments, every k step of a chunk
    OUTPUTS = M_TILES * N_TILES * 4
    OLD_WORDS = ROWS * WORDS
    SCRATCH_WARPS = WARPS if SIMULATOR else 1  # the GPU never touches the scratch
    # Whether the lane's words of B for every rank step fit EARLY_B_WORDS: then they are
    # loaded first and the old outputs before the buffer ("Order of the loads"). Not in
    # a build of chunks, which holds no more of the rank than a chunk's.
    ONE_PASS = one_pass  # no block walks a second column group
    EARLY = not CHUNKED and K_STEPS * N_TILES <= (ONE_PASS_B_WORDS if ONE_PASS else EARLY_B_WORDS)
    CEILING = MAX_REGISTERS if K_STEPS * N_TILES <= EARLY_B_WORDS or not EARLY else None
    EARLY_WORDS = K_STEPS * N_TILES if EARLY else 1  # (a local array has at least one)
    # Whether the buffer's rows are read before B ("The buffer before B"): the one-pass
    # builds holding more words of B early than EARLY_B_WORDS (r=64 with 64 columns).
    BUFFER_FIRST = EARLY and ONE_PASS and WIDE_X and K_STEPS * N_TILES > EARLY_B_WORDS
    # Whether the lane's buffer values of every step are held before the split: read first
    # (BUFFER_FIRST), or, in a SCALED build of one chunk, read where the fragments would be,
    # so that the rows' largest values are known before the split ("Precision").
    HELD = BUFFER_FIRST or (SCALED and not CHUNKED)
    BUFFER_WORDS = K_STEPS * M_TILES * 8 if HELD else 1  # 2 rows x 4 a step and m-tile
    SCALES = ROWS if SCALED else 1  # the lane's rows' scales, and the inverses
    new_word = output_word_maker(N_TILES, HALF, SCALED)  # ("Whole words")
    WHOLE_GROUPS = whole_groups  # no column of a group that starts in the slice lies past it
    ONE_SLOT = one_slot
    TILE_M = 16 * M_TILES

    @cuda.jit(device=True)
    def element(row, k):
        """Element k of a buffer row (zero past the rank): its fp32 value (of an fp32 or
        fp16 element) to be split or packed, or the bits of a bf16 one."""
        if VALUES:
            return load_x(row[k]) if WHOLE_STEPS or k < row.shape[0] else float32(0.0)
        return row[k] if WHOLE_STEPS or k < row.shape[0] else 0

    @cuda.jit(device=True)
    def word_of(b_rows, n, q):
        """Word q of row n of B (zero past the rank)."""
        return b_rows[n, q] if WHOLE_STEPS or q < b_rows.shape[1] else int64(0)

    @cuda.jit(device=True, inline="always")
    def b_words(b_rows, n0, lane_n, last_n, nj, kk, t):
        """The lane's words of B for tile nj and rank steps kk .. kk + B_STEP - 1 of the
        column group at n0 (the second is the first again where B_STEP is 1): B's column
        g of tile nj is row n of B (rows past the slice repeat its last), and the lane's
        words of a row are K_STEPS side by side ("The rank in a lane's order")."""
        n = n0 + lane_n + uint64(output_column(nj, 0, RUN))
        if not WHOLE_GROUPS:
            n = min(n, last_n)
        q = K_STEPS * t + kk
        if B_STEP == 2:
            return load_b_pair(b_rows[n], q)
        word = word_of(b_rows, n, q)
        return word, word

    @cuda.jit(device=True, inline="always")
    def load_early_b(early_b, b_rows, n0, lane_n, last_n, t):
        """The lane's words of B for every rank step of the column group at n0."""
        for kk in range(0, K_STEPS, B_STEP):
            for nj in range(N_TILES):
                first, second = b_words(b_rows, n0, lane_n, last_n, nj, kk, t)
                early_b[kk * N_TILES + nj] = first
                early_b[(kk + B_STEP - 1) * N_TILES + nj] = second

    @cuda.jit(device=True, inline="always")
    def buffer_four(x, s, token, mi, half, kk, t):
        """The lane's four elements of rank step kk of row ``half`` of m-tile mi of the
        buffer (``wide_x``: one 16-byte load), as fp32 values."""
        return load_four(x[s, token[2 * mi + half]], KQ * t + 4 * kk)

    @cuda.jit(device=True, inline="always")
    def buffer_at(kk, mi, half):
        """Where the lane's four elements of rank step kk of row ``half`` of m-tile mi sit
        in the buffer values held (HELD: read first, or before the split)."""
        return ((kk * M_TILES + mi) * 2 + half) * 4

    @cuda.jit(device=True, inline="always")
    def read_four(x, s, token, mi, half, kk, t):
        """The lane's four elements ``KQ t + 4 kk ..`` of row ``half`` of m-tile mi of the
        buffer as fp32 values: one 16-byte load (``wide_x``) or four (zero past the rank)."""
        if WIDE_X:
            return buffer_four(x, s, token, mi, half, kk, t)
        row = x[s, token[2 * mi + half]]
        k = KQ * t + 4 * kk
        return element(row, k), element(row, k + 1), element(row, k + 2), element(row, k + 3)

    @cuda.jit(device=True, inline="always")
    def hold_buffer(buffer_values, x, s, token, t):
        """The lane's buffer values of every rank step, kept as they came (HELD)."""
        for kk in range(K_STEPS):
            for mi in range(M_TILES):
                for half in range(2):
                    p = buffer_at(kk, mi, half)
                    v0, v1, v2, v3 = read_four(x, s, token, mi, half, kk, t)
                    buffer_values[p], buffer_values[p + 1] = v0, v1
                    buffer_values[p + 2], buffer_values[p + 3] = v2, v3

    @cuda.jit(device=True, inline="always")
    def four_values(x, s, token, mi, half, kk, t, buffer_values):
        """:func:`read_four`'s values, from those held where the build holds them."""
        if HELD:
            p = buffer_at(kk, mi, half)
            return (
                buffer_values[p],
                buffer_values[p + 1],
                buffer_values[p + 2],
                buffer_values[p + 3],
            )
        return read_four(x, s, token, mi, half, kk, t)

    @cuda.jit(device=True, inline="always")
    def row_scales(scale, back, x, s, token, t, buffer_values, my_scratch):
        """SCALED: the scale of each of the lane's token rows, and its inverse
        (:func:`.mma.f16_row_scale`), from the largest magnitude of the whole row: of the
        lane's elements of every rank step (held, or read: a build of chunks reads them
        again for each chunk's fragments), then of the four lanes that share the row."""
        for i in range(ROWS):  # row g + 8 * (i % 2) of m-tile i // 2
            largest = float32(0.0)
            for kk in range(K_STEPS):
                v0, v1, v2, v3 = four_values(x, s, token, i // 2, i % 2, kk, t, buffer_values)
                pair01 = max(abs(v0), abs(v1))
                pair23 = max(abs(v2), abs(v3))
                largest = max(largest, max(pair01, pair23))
            bits = abs_bits(largest)
            scale[i], back[i] = f16_row_scale(largest_of_lane_group(bits, my_scratch))

    @cuda.jit(device=True, inline="always")
    def add_step(acc, a, j, nj, word, my_scratch):
        """Add the products of step j of the chunk (rank step kk = its first + j) of tile
        nj, from the lane's word of B, into acc."""
        b0, b1 = word_halves(word)  # k = KQ t + 4 kk ..
        if HALF and not F16:  # fp16 B: each register as bf16 hi + lo, exactly ("Precision")
            b0_hi, b0_lo = split_f16_pair(b0)
            b1_hi, b1_lo = split_f16_pair(b1)
            for mi in range(M_TILES):
                p = (mi * N_TILES + nj) * 4
                q = (j * M_TILES + mi) * 8  # the buffer's lo halves at q, its hi at q + 4
                # lo x B_hi, hi x B_lo, then hi x B_hi: the small terms first
                add_product(acc, p, a[q], a[q + 1], a[q + 2], a[q + 3], b0_hi, b1_hi, my_scratch)
                q += 4
                add_product(acc, p, a[q], a[q + 1], a[q + 2], a[q + 3], b0_lo, b1_lo, my_scratch)
                add_product(acc, p, a[q], a[q + 1], a[q + 2], a[q + 3], b0_hi, b1_hi, my_scratch)
        else:
            for mi in range(M_TILES):
                p = (mi * N_TILES + nj) * 4
                for term in range(TERMS):  # lo first, then hi (F16: fp16 B as it is)
                    q = ((j * M_TILES + mi) * TERMS + term) * 4
                    add_product(acc, p, a[q], a[q + 1], a[q + 2], a[q + 3], b0, b1, my_scratch)

    @cuda.jit(device=True, inline="always")
    def load_fragments(a, x, s, token, first_step, t, buffer_values, scale):
        """The lane's A fragments of rank steps ``first_step .. + CHUNK - 1`` (none past
        the last step), into ``a`` by step within the chunk: lo and hi halves of fp32 or
        fp16 buffer elements (bf16; F16: fp16, of the rows scaled by ``scale``), an fp16
        buffer's pairs (F16) or a bf16 buffer's; from the values held (HELD builds, which
        have one chunk) or from the buffer."""
        for j in range(CHUNK):  # step j of the chunk: rank step kk
            kk = first_step + j
            if SHORT_LAST and kk >= K_STEPS:
                break
            for mi in range(M_TILES):
                base = (j * M_TILES + mi) * TERMS * 4
                if F16:  # fp16 B on the f16 tensor cores ("Precision")
                    for half in range(2):  # rows g, g + 8: a0 / a2, a1 / a3
                        v0, v1, v2, v3 = four_values(x, s, token, mi, half, kk, t, buffer_values)
                        if SCALED:  # the row scaled into fp16's range, as fp16 hi + lo
                            f = scale[2 * mi + half]
                            a[base + 4 + half], a[base + half] = split_to_f16(v0 * f, v1 * f)
                            a[base + 6 + half], a[base + 2 + half] = split_to_f16(v2 * f, v3 * f)
                        else:  # an fp16 buffer as it is (fp16 values: the rounding is exact)
                            a[base + half] = f16_pair(v0, v1)
                            a[base + 2 + half] = f16_pair(v2, v3)
                    continue
                if WIDE_X:  # the lane's four k of the step, of each row: one 16-byte load
                    for half in range(2):  # (or the four held: BUFFER_FIRST)
                        v0, v1, v2, v3 = four_values(x, s, token, mi, half, kk, t, buffer_values)
                        a[base + 4 + half], a[base + half] = split_pair(v0, v1)
                        a[base + 6 + half], a[base + 2 + half] = split_pair(v2, v3)
                    continue
                for q in range(4):  # a0, a1: rows g, g + 8, k = k0, k0 + 1; a2, a3: k0 + 2, k0 + 3
                    k = KQ * t + 4 * kk + 2 * (q // 2)  # k0 = KQ t + 4 kk
                    row = x[s, token[2 * mi + q % 2]]
                    v0 = element(row, k)
                    v1 = element(row, k + 1)
                    if SPLIT:
                        a[base + 4 + q], a[base + q] = split_pair(v0, v1)  # hi, lo
                    else:
                        a[base + q] = pair_of(v0, v1)

    @cuda.jit(device=True, inline="always")
    def load_old(old, out, token, n0, lane_word, last_start, add_inputs):
        """The lane's old output words of every token row of the column group at n0
        (zeros without add_inputs). Rows past the tile repeat a token, words past the
        slice its last word: in bounds, never stored."""
        first_word = lane_word + (n0 >> uint64(2))
        for i in range(ROWS):
            row = out[token[i]]
            for v in range(0, WORDS, PAIR):
                word = first_word + uint64(4 * v)
                if not WHOLE_GROUPS:
                    word = min(word, last_start)
                if not add_inputs:
                    old[i * WORDS + v] = int64(0)
                    old[i * WORDS + v + PAIR - 1] = int64(0)
                elif PAIR == 2:
                    old[i * WORDS + v], old[i * WORDS + v + 1] = load_pair(row, word)
                else:
                    old[i * WORDS + v] = row[word]

    @cuda.jit(device=True, inline="always")
    def tile_of_table(token, tiles, tile_rows, out, g):
        """The block's tile from the table: its slot and a mask of the lane's token rows
        it stores (bit i: row ``g + 8 * i``), its tokens into ``token``. Also ``known``,
        the rows plus the tokens: never negative ("Order of the loads")."""
        slot, _, rows, _ = read_tile(tiles, cuda.blockIdx.x)
        my_rows = tile_rows[cuda.blockIdx.x]
        known = rows
        stored = 0
        for i in range(ROWS):
            token[i] = int64(my_rows[g + 8 * i])
            known += token[i]
            if g + 8 * i < rows:
                stored |= 1 << i
        return slot, stored, known

    @cuda.jit(device=True, inline="always")
    def tile_of_tokens(token, token_lora_mapping, tile_rows, out, g):
        """One slot: the block's ``TILE_M`` tokens in their own order (past the last token,
        the last again: in bounds, never stored), slot 0, and the mask of the rows of a
        LoRA (``token_lora_mapping`` not -1), whose loads leave with the rest."""
        first = cuda.blockIdx.x * TILE_M
        last = out.shape[0] - 1
        stored = 0
        for i in range(ROWS):
            row = first + g + 8 * i
            token[i] = min(row, last)
            if row <= last and token_lora_mapping[token[i]] != -1:
                stored |= 1 << i
        return 0, stored, 0

    read_block = tile_of_tokens if ONE_SLOT else tile_of_table

    begin = prologue()
    let_next = next_launch()
    ask_line, ask_bytes = line_asker(), bytes_asker()
    ASK_AHEAD = ask_ahead and dependent_launch()  # (no launch to overlap: nothing to ask)
    X_LINE = 128 // x_dtype.itemsize  # buffer elements in a 128-byte line
    OUT_LINE = 16  # output words in a 128-byte line

    @cuda.jit(device=True, inline="always")
    def ask_for_the_tile(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, tile_rows):
        """Before the wait ("Asking ahead"): ask L2 for the warp's rows of B (one bulk
        prefetch), and for its tokens' old output words and (one column group in
        :data:`BUFFER_ASKERS`) buffer rows, a line at a time, found from the table as it
        reads before the wait: a stale entry only asks for lines the block will not load."""
        warp, lane = cuda.threadIdx.x >> 5, cuda.threadIdx.x & 31
        slot, _, _, _ = read_tile(tiles, cuda.blockIdx.x)
        w, word0 = slice_of(cuda.blockIdx.y, w0, w1, w2, col0, col1, col2)
        n0 = cuda.blockIdx.z * BLOCK_N + warp * WARP_N
        if slot < 0 or slot >= w.shape[0] or n0 >= w.shape[1]:
            return
        rows = min(WARP_N, w.shape[1] - n0)
        if lane == 0:
            ask_bytes(w[slot, n0], 0, rows * w.shape[2] * 8)
        first = word0 + (n0 >> 2)
        last = first + ((rows - 1) >> 2)
        for i in range(lane, TILE_M, 32):
            token = tile_rows[cuda.blockIdx.x, i]
            if token >= 0 and token < out.shape[0]:
                old_row = out[token]
                for q in range(first, last, OUT_LINE):
                    ask_line(old_row, q)
                ask_line(old_row, last)
                if cuda.blockIdx.z % BUFFER_ASKERS == 0:  # the tile's rows: every group reads them
                    x_row = x[slice_base + cuda.blockIdx.y, token]
                    for q in range(0, x_row.shape[0], X_LINE):
                        ask_line(x_row, q)
                    ask_line(x_row, x_row.shape[0] - 1)

    # B before the wait ("B before the wait"): builds that ask ahead, hold B early and
    # follow the package's own shrink.
    B_BEFORE_THE_WAIT = ASK_AHEAD and EARLY and b_before_the_wait
    # ... and a block with no tile leaves there, in every build that may read before it.
    LEAVE_BEFORE_THE_WAIT = ASK_AHEAD and b_before_the_wait

    @cuda.jit(device=True, inline="always")
    def load_b_before_the_wait(early_b, w0, w1, w2, col0, col1, col2, tiles):
        """Before the wait: the lane's words of B for its tile's slot, read from the table
        (what no kernel that can still be running writes: "B before the wait"). The slot
        whose words ``early_b`` now holds, or -1 where the block has none to load (or the
        build does not load B before the wait)."""
        if not B_BEFORE_THE_WAIT:
            return int64(-1)
        warp, lane = cuda.threadIdx.x >> 5, cuda.threadIdx.x & 31
        slot, _, _, _ = read_tile(tiles, cuda.blockIdx.x)
        w, _ = slice_of(cuda.blockIdx.y, w0, w1, w2, col0, col1, col2)
        n0 = cuda.blockIdx.z * BLOCK_N + warp * WARP_N
        if slot < 0 or slot >= w.shape[0] or n0 >= w.shape[1]:
            return int64(-1)
        lane_n = uint64(output_column(0, lane >> 2, RUN))
        last_n = uint64(w.shape[1] - 1)
        load_early_b(early_b, w[slot], uint64(n0), lane_n, last_n, lane & 3)
        return int64(slot)

    @jit_kernel(threads, CEILING)
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, tile_rows, add_inputs):
        # x: [S, M, r] fp32 or int16 bits; w*: [L, N_s, r/4] int64 words;
        # out: [M, W/4] int64 words; col*: the word of a slice's first column;
        # tile_rows: [B, TILE_M] each tile's tokens (segments.tile_tokens)
        early_b = cuda.local.array(EARLY_WORDS, int64)
        early_slot = int64(-1)  # the slot whose words of B early_b holds (-1: none)
        if ASK_AHEAD:  # the next launch may be placed now; L2 asked for this one's tile
            let_next()
            ask_for_the_tile(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, tile_rows)
            early_slot = load_b_before_the_wait(early_b, w0, w1, w2, col0, col1, col2, tiles)
            if LEAVE_BEFORE_THE_WAIT and (
                early_slot == -1 and read_tile(tiles, cuda.blockIdx.x)[0] == -1
            ):
                return  # no tile: nothing to wait for ("B before the wait")
        begin()  # wait for the kernels before this one (dependent_launch)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31  # shifts and masks: no signed-division fix-ups
        g, t = lane >> 2, lane & 3
        # The old outputs and the buffer rows need the tokens, which need only the block's
        # own index: their loads go out with the table's ("Order of the loads").
        token = cuda.local.array(ROWS, int64)  # row g + 8 * (i % 2) of m-tile i // 2
        slot, stored, known = read_block(token, tiles, tile_rows, out, g)
        if not ONE_SLOT and slot == -1 and known >= 0:  # (known >= 0: "Order of the loads")
            return
        s_local = cuda.blockIdx.y
        w, word0 = slice_of(s_local, w0, w1, w2, col0, col1, col2)
        s = slice_base + s_local
        width = w.shape[1]  # a multiple of 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]

        # Unsigned column and word numbers from here on: indexing with them needs no
        # wraparound of negative indices (a compare and two selects per access).
        b_rows = w[slot]
        last_n = uint64(width - 1)
        lane_n = uint64(output_column(0, g, RUN))  # the lane's B row in tile 0, from n0
        # The lane's first word of a row: lane_word + (n0 >> 2); its words v, v + 1 of a
        # pair (wide) sit side by side, pairs (or single words) 4 * PAIR words apart.
        lane_word = uint64(word0 + PAIR * t)
        last_word = uint64(word0 + ((width - WORD_COLUMNS) >> 2))
        last_start = last_word - uint64(PAIR - 1)  # of the slice's last pair (or word)
        n0 = uint64(cuda.blockIdx.z * BLOCK_N + warp * WARP_N)  # a multiple of 16
        step_n = uint64(cuda.gridDim.z * BLOCK_N)

        # BUFFER_FIRST: the buffer's rows before B, kept as they came ("The buffer before
        # B") ...
        buffer_values = cuda.local.array(BUFFER_WORDS, float32)
        if BUFFER_FIRST:
            hold_buffer(buffer_values, x, s, token, t)

        # EARLY: loads in the order of what they wait for ("Order of the loads"). B needs
        # only the slot ... (A warp past the slice's columns loads nothing.)
        if EARLY and n0 < uint64(width) and (not B_BEFORE_THE_WAIT or slot != early_slot):
            load_early_b(early_b, b_rows, n0, lane_n, last_n, t)

        # ... the old outputs and the buffer rows need the tokens.
        old = cuda.local.array(OLD_WORDS, int64)  # old[i * WORDS + v]: row i, word v
        if EARLY and n0 < uint64(width):
            load_old(old, out, token, n0, lane_word, last_start, add_inputs)

        # The A fragments of every k step, once, where the rank is one chunk (a build of
        # chunks loads each chunk's in the loop below: "Ranks past 64"): a[((j * M_TILES
        # + mi) * TERMS + term) * 4 + q] holds elements k, k + 1 of step j of the chunk
        # (their lo halves for term 0, hi for term 1).
        a = cuda.local.array(A_WORDS, uint32)
        # SCALED: each token row's scale, and its inverse for the sums ("Precision"), from
        # the whole row before its first split (HELD: the values, read here where not first).
        scale = cuda.local.array(SCALES, float32)
        back = cuda.local.array(SCALES, float32)
        if HELD and not BUFFER_FIRST:
            hold_buffer(buffer_values, x, s, token, t)
        if SCALED:
            row_scales(scale, back, x, s, token, t, buffer_values, my_scratch)
        if not CHUNKED:  # (a build of chunks loads each chunk's for each column group)
            load_fragments(a, x, s, token, 0, t, buffer_values, scale)

        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + q]
        while n0 < uint64(width):
            first_word = lane_word + (n0 >> uint64(2))
            if not EARLY:  # their trip to memory overlaps the loads of B
                load_old(old, out, token, n0, lane_word, last_start, add_inputs)
            for p in range(OUTPUTS):
                acc[p] = float32(0.0)
            for c in range(CHUNKS):  # chunks 0 .. CHUNKS - 1 of the rank (one up to r=64)
                first_step = c * CHUNK
                if CHUNKED:  # this chunk's fragments, into the same registers
                    load_fragments(a, x, s, token, first_step, t, buffer_values, scale)
                for j in range(0, CHUNK, B_STEP):  # each tile's steps in order
                    kk = first_step + j  # (j: the step within the chunk)
                    if SHORT_LAST and kk >= K_STEPS:  # (past the last chunk's steps)
                        break
                    for nj in range(N_TILES):
                        if EARLY:
                            first = early_b[kk * N_TILES + nj]
                            second = early_b[(kk + B_STEP - 1) * N_TILES + nj]
                        else:
                            first, second = b_words(b_rows, n0, lane_n, last_n, nj, kk, t)
                        add_step(acc, a, j, nj, first, my_scratch)
                        if B_STEP == 2:
                            add_step(acc, a, j + 1, nj, second, my_scratch)
            # Word v of row i holds tiles 2v (its columns 0, 1) and 2v + 1 (columns 2,
            # 3): lane t's columns 2t, 2t + 1 of each, in the row's half of the tile.
            for i in range(ROWS):
                mi, half = i // 2, i % 2
                if (stored >> i) & 1:  # row g + 8 * i of the tile: 16 * mi + g + 8 * half
                    row = out[token[i]]
                    for v in range(0, WORDS, PAIR):
                        word = first_word + uint64(4 * v)
                        if WHOLE_GROUPS or word <= last_start:
                            old_word = old[i * WORDS + v]
                            first = new_word(acc, old_word, back, mi, half, i, v)
                            if PAIR == 2:
                                old_word = old[i * WORDS + v + 1]
                                second = new_word(acc, old_word, back, mi, half, i, v + 1)
                                store_pair(row, word, first, second)
                            else:
                                row[word] = first
            if ONE_PASS:  # (no second pass to prepare: fewer registers live in the loop)
                break
            n0 += step_n
            if EARLY and n0 < uint64(width):  # the next pass's loads, as before the first
                load_early_b(early_b, b_rows, n0, lane_n, last_n, t)
                load_old(old, out, token, n0, lane_word, last_start, add_inputs)

    return expand
