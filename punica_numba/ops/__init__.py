"""``lora_shrink`` and ``lora_expand``, vLLM's two Punica ops, on the Numba kernels.

A call goes down the floors of this package once, each floor a module:

============  ==================================================================
``api``       the public entry points: ``lora_shrink``, ``lora_expand`` and their
              ``prepare_*`` halves (check now, launch later)
``checks``    every argument checked before anything is launched, the metadata
              in either of vLLM's conventions (six values or seven)
``choice``    which kernel a checked call takes, and what is compiled into it
``operands``  the tensors as that kernel takes them (packed words, 16-byte rows)
``launching`` where each block finds its work (the tile table) and the launch
============  ==================================================================

vLLM-style code reads the same with either convention::

    lora_shrink(x, [A], buffer, *meta.meta_args(T), scale)                  # v0.8-v0.9
    lora_shrink(x, [A], buffer, *meta.meta_args(T, False), scale)           # 0.33
    lora_expand(buffer, [B], y, *meta.meta_args(T), offset_start=0, add_inputs=True)

A rejected call changes nothing. Kernels run on torch's current stream, on the GPU or,
without one, on Numba's CUDA simulator (the same kernels).
"""

from .api import lora_expand, lora_shrink, prepare_expand, prepare_shrink

__all__ = [
    "lora_shrink",
    "lora_expand",
    "prepare_shrink",
    "prepare_expand",
]
