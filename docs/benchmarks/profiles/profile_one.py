"""One forced launch configuration, launched three times, for a profiler to read (a GPU only:
unlike ``probes/``, nothing here is built without one).

Not a timing: Nsight Compute (``ncu``) times and counts the launches it is told to
(``h100_ncu_79f3af9.json`` skipped the first two matching launches and read the third). Run
from the repository root on a GPU::

    ncu --section SpeedOfLight --section WarpStateStats --page raw --csv \\
        -k regex:'expand|shrink' -s 2 -c 1 \\
        python docs/benchmarks/profiles/profile_one.py OP CONFIG SLICES WIDTH RANK T LORAS [fp16]

``OP`` is ``shrink`` or ``expand``; ``CONFIG`` a name of :func:`punica_numba.launch.
launch_configs` (``mma_t256_m16_n0``); ``WIDTH`` the shrink's K or the expand's slice width;
``LORAS`` the adapters the ``T`` tokens are drawn among at random; bf16 unless ``fp16``.
"""

import sys

import torch

from punica_numba import ops
from punica_numba.launch import config_name, force_launch_config, launch_configs
from punica_numba.meta import LoRAKernelMeta


def main(argv: list[str]) -> None:
    op, name = argv[0], argv[1]
    slices, width, rank, tokens, loras = map(int, argv[2:7])
    dtype = torch.float16 if "fp16" in argv[7:] else torch.bfloat16
    config = next(c for c in launch_configs(op) if config_name(c) == name)
    slots = torch.randint(0, loras, (tokens,), device="cuda")
    meta = LoRAKernelMeta.make(loras, tokens, "cuda")
    meta.prepare_tensors(slots)
    if op == "expand":
        x = torch.randn(slices, tokens, rank, device="cuda")
        w = [torch.randn(loras, width, rank, device="cuda", dtype=dtype) for _ in range(slices)]
        out = torch.randn(tokens, slices * width, device="cuda", dtype=dtype)
        with force_launch_config(op, config):
            launch = ops.prepare_expand(
                x, w, out, *meta.meta_args(tokens), offset_start=0, add_inputs=True
            )
    else:
        x = torch.randn(tokens, width, device="cuda", dtype=dtype)
        w = [torch.randn(loras, rank, width, device="cuda", dtype=dtype) for _ in range(slices)]
        out = torch.zeros(slices, tokens, rank, device="cuda")
        with force_launch_config(op, config):
            launch = ops.prepare_shrink(x, w, out, *meta.meta_args(tokens), 1.0)
    print("ran", config_name(launch.config), flush=True)
    for _ in range(3):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
