"""punica-numba: vLLM's multi-LoRA Punica layer as Numba CUDA kernels.

The public pieces, bottom to top:

* :mod:`punica_numba.reference`  dense float64 references (the yardstick);
* :class:`LoRAMapping`, :func:`convert_mapping`  adapter ids -> GPU slots;
* :class:`LoRAKernelMeta`  sort and segment tokens by slot;
* :func:`lora_shrink`, :func:`lora_expand`  the kernels, with vLLM's op signatures;
* :func:`align_pairs`, :func:`fused_moe_lora`  MoE LoRA: (token, expert) pairs in blocks,
  and the op on them;
* :class:`PunicaWrapperNumba`  vLLM's ``PunicaWrapperGPU`` API on those kernels.

Importing the package switches Numba to its CUDA simulator when no GPU is usable;
:func:`dependent_launch` says whether kernels are launched as Hopper's dependent launches.
"""

from ._cuda import SIMULATOR, FirstLaunchInCaptureError, dependent_launch
from .mapping import LongContextLoRAContext, LoRAMapping, convert_mapping
from .meta import LoRAKernelMeta
from .moe_meta import align_pairs
from .ops import lora_expand, lora_shrink
from .ops.moe import fused_moe_lora
from .wrapper import PunicaWrapperNumba

__version__ = "0.1.0"

__all__ = [
    "SIMULATOR",
    "FirstLaunchInCaptureError",
    "LoRAKernelMeta",
    "LoRAMapping",
    "PunicaWrapperNumba",
    "LongContextLoRAContext",
    "align_pairs",
    "convert_mapping",
    "dependent_launch",
    "fused_moe_lora",
    "lora_expand",
    "lora_shrink",
]
