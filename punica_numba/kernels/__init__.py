"""The ``@cuda.jit`` kernels, one file per op, plus the pieces they share.

* :mod:`.dtypes`   fp16 / bf16 / fp32 loads and stores through fp32;
* :mod:`.segments` from a block index to a tile of one slot's tokens;
* :mod:`.shrink`   ``x @ A^T`` into the fp32 buffer;
* :mod:`.shrink_token` the same shrink for a token and a rank a block, on stacks of one
  slot (decode with vLLM's default ``max_loras``);
* :mod:`.shrink_split` the same shrink with K split over blocks, the last block of each
  tile adding the chunks' sums in order, for a long K and few tokens per slot (down
  projections; its H200 speed not yet measured);
* :mod:`.expand`   ``buffer @ B^T`` into the layer output;
* :mod:`.expand_lanes` the same expand with each row of B split among lanes, for
  few tokens per slot at larger ranks;
* :mod:`.expand_tiled` the same expand as shared-memory tiles, for many tokens per
  slot (prefill);
* :mod:`.mma`      one warp's tensor-core product, on the GPU and on the simulator;
* :mod:`.shrink_mma`, :mod:`.expand_mma` both ops on the tensor cores, for many tokens
  per slot; :mod:`.shrink_mma_split` the tensor-core shrink with K split over blocks
  (:mod:`.shrink_mma_cluster` with a tile's runs added up in one thread block cluster, its
  barriers and reads :mod:`.cluster`'s), and
  :mod:`.shrink_mma_joint` with a layer's slices in one block, their ranks side by side;
  :mod:`.shrink_mma_staged` with x and A staged in shared memory and the block's ranks split
  among its warps (:mod:`.shrink_mma_staged_split` with K split over blocks too), its copies
  :mod:`.async_copy`'s; :mod:`.expand_mma_staged` the expand's large tiles, the buffer and
  B staged the same way;
* :mod:`.moe_blocks`, :mod:`.moe_shrink`, :mod:`.moe_expand` MoE LoRA: both ops over blocks
  of (token, expert) pairs, one (slot, expert) a block; :mod:`.moe_shrink_tiled` the
  shrink's second version, in shared-memory tiles; :mod:`.moe_shrink_split` and
  :mod:`.moe_expand_columns` the third, K split over a block's threads and columns
  whose rows of B stay in registers; :mod:`.moe_shrink_mma` and :mod:`.moe_expand_mma`
  the fourth, both on the tensor cores; :mod:`.moe_expand_outer` the expand that takes a
  chunk of a block's pairs at once, as outer products; :mod:`.moe_tiles` the blocks as the
  dense op's tile table, for version 7's dense kernels;
* :mod:`.dependent_launch` every kernel's first step, ``begin()``: on Hopper, wait for the
  kernels before it (which a dependent launch does not).
"""

from .expand import COMPILED_WORDS, build_expand_kernel
from .expand_lanes import build_lanes_expand_kernel, splits
from .expand_mma import build_mma_expand_kernel
from .expand_mma_staged import build_staged_mma_expand_kernel, staged_expand_warps
from .expand_tiled import build_tiled_expand_kernel
from .shrink import MAX_SLICES, build_shrink_kernel
from .shrink_mma import build_mma_shrink_kernel
from .shrink_mma_cluster import build_cluster_mma_shrink_kernel
from .shrink_mma_joint import build_joint_mma_shrink_kernel
from .shrink_mma_split import build_split_mma_shrink_kernel
from .shrink_mma_staged import build_staged_mma_shrink_kernel
from .shrink_mma_staged_split import build_split_staged_mma_shrink_kernel
from .shrink_split import build_split_shrink_kernel
from .shrink_token import MAX_WORDS_PER_THREAD, build_token_shrink_kernel

__all__ = [
    "COMPILED_WORDS",
    "MAX_SLICES",
    "MAX_WORDS_PER_THREAD",
    "build_cluster_mma_shrink_kernel",
    "build_expand_kernel",
    "build_joint_mma_shrink_kernel",
    "build_lanes_expand_kernel",
    "build_mma_expand_kernel",
    "build_mma_shrink_kernel",
    "build_shrink_kernel",
    "build_split_mma_shrink_kernel",
    "build_split_shrink_kernel",
    "build_split_staged_mma_shrink_kernel",
    "build_staged_mma_expand_kernel",
    "build_staged_mma_shrink_kernel",
    "build_tiled_expand_kernel",
    "build_token_shrink_kernel",
    "splits",
    "staged_expand_warps",
]
