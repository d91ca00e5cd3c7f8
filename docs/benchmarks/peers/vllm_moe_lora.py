"""vLLM 0.33's ``fused_moe_lora`` Triton op, timed on ``bench --moe``'s cases.

A script kept outside the package, which never imports vLLM: it loads two files of
vLLM's source release (``vllm/lora/ops/triton_ops/utils.py`` and
``fused_moe_lora_op.py``), with the few vLLM helpers they import stood in for below,
and times the op the way ``python -m punica_numba bench --moe`` times ours: the same
cases and argument sets (:mod:`punica_numba.bench_moe`), checked against
``reference.fused_moe_lora`` on the first set, then CUDA-graph replays of a pool larger
than twice the L2 (``bench.time_calls``).

What vLLM's Punica wrapper would pass (``add_lora_w13`` / ``add_lora_w2``, without
``VLLM_TUNED_CONFIG_FOLDER``; ``docs/benchmarks/lab_notes.md``): the base fused-MoE
kernel's configuration for the layer (``E=128,N=768,device_name=NVIDIA_H200.json`` of the
release, the entry nearest the token count), the shrink's ``BLOCK_SIZE_N`` and the
expand's ``BLOCK_SIZE_K`` capped at the next power of two of the rank (the latter at
least 16); one block per pair where ``T * top_k * 8 <= experts * adapters``, else blocks
of the shrink's ``BLOCK_SIZE_M`` pairs. vLLM makes those blocks with an op of its compiled
extension, which this script does not build: it makes the same layout with
``punica_numba.moe_meta.align_pairs`` (not timed, as vLLM's is not timed either).

Usage, on the GPU (the release from PyPI: ``vllm-0.33.0.tar.gz``, sha256
``f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112``)::

    tar xzf vllm-0.33.0.tar.gz
    python docs/benchmarks/peers/vllm_moe_lora.py --vllm-src vllm-0.33.0 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import types
from pathlib import Path

import torch

from punica_numba import bench, bench_moe
from punica_numba.moe_meta import align_pairs

SPARSITY_FACTOR = 8  # vLLM 0.33's rule for one block per pair (lab notes)


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # (a package, so that its children can be imported)
    sys.modules[name] = module
    return module


def _stand_ins() -> None:
    """The vLLM helpers the two files import, each as little as they use of it."""
    import triton
    import triton.language as tl

    class Platform:
        def is_cuda(self):
            return True

        is_cuda_alike = is_cuda

        def is_xpu(self):
            return False

        def has_device_capability(self, capability):
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor >= capability

        def num_compute_units(self, index=0):
            return torch.cuda.get_device_properties(index).multi_processor_count

    class Logger(logging.LoggerAdapter):
        def warning_once(self, *args, **kwargs):
            self.warning(*args, **kwargs)

        def info_once(self, *args, **kwargs):
            self.info(*args, **kwargs)

    def allocator(device):
        triton.set_allocator(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device)
        )

    def to_device(data, dtype, target_device=None, pin_memory=False, device=None):
        # (vLLM's callers name the device either way: utils.py by position,
        # fused_moe_lora_op.py as device=)
        where = device if target_device is None else target_device
        return torch.tensor(data, dtype=dtype).to(where, non_blocking=True)

    def collective(*args, **kwargs):
        raise RuntimeError("no tensor parallelism in this script")

    _module("vllm")
    _module("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_TUNED_CONFIG_FOLDER=None,
            VLLM_LORA_DISABLE_PDL=False)  # fmt: skip
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]
    _module("vllm.logger", init_logger=lambda name: Logger(logging.getLogger(name), {}))
    _module("vllm.platforms", current_platform=Platform())
    _module("vllm.triton_utils", tl=tl, triton=triton)
    _module("vllm.triton_utils.allocation", set_triton_allocator=allocator)
    _module("vllm.utils")
    _module("vllm.utils.math_utils", next_power_of_2=triton.next_power_of_2)
    _module("vllm.utils.mem_utils", get_max_shared_memory_bytes=lambda index=0: (
        torch.cuda.get_device_properties(index).shared_memory_per_block_optin))  # fmt: skip
    # (registering a custom op is left out: the file then uses its plain functions)
    _module("vllm.utils.torch_utils", async_tensor_h2d=to_device,
            direct_register_custom_op=lambda *args, **kwargs: None)  # fmt: skip
    _module("vllm.distributed", tensor_model_parallel_all_gather=collective,
            tensor_model_parallel_all_reduce=collective)  # fmt: skip
    for package in ("vllm.lora", "vllm.lora.ops", "vllm.lora.ops.triton_ops"):
        _module(package)


def load_op(source: Path):
    """vLLM's ``_fused_moe_lora`` from the release at ``source``."""
    _stand_ins()
    folder = source / "vllm" / "lora" / "ops" / "triton_ops"
    for name in ("utils", "fused_moe_lora_op"):
        full = f"vllm.lora.ops.triton_ops.{name}"
        spec = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules["vllm.lora.ops.triton_ops.fused_moe_lora_op"]._fused_moe_lora


def configs(source: Path, case: bench_moe.MoECase) -> tuple[dict, dict]:
    """The shrink's and expand's configuration vLLM 0.33 would pick (module docstring)."""
    name = f"E={case.experts},N={case.intermediate},device_name=NVIDIA_H200.json"
    path = source / "vllm" / "model_executor" / "layers" / "fused_moe" / "configs" / name
    table = json.loads(path.read_text())
    nearest = dict(table[min(table, key=lambda m: abs(int(m) - case.T))])
    base = {k if k.isupper() else k.upper(): v for k, v in nearest.items()}
    power = 1 << max(case.rank - 1, 0).bit_length()  # next power of two of the rank
    shrink = {**base, "BLOCK_SIZE_N": min(base.get("BLOCK_SIZE_N") or 64, power)}
    expand = {**base, "BLOCK_SIZE_K": max(16, min(base.get("BLOCK_SIZE_K") or 32, power))}
    return shrink, expand


def one_block_per_pair(case: bench_moe.MoECase) -> bool:
    """Whether vLLM 0.33 gives each pair a block of its own at this case (lab notes)."""
    return case.T * case.top_k * SPARSITY_FACTOR <= case.experts * case.loras


def vllm_call(op, case, args, shrink: dict, expand: dict):
    """One call of vLLM's op on ``args`` (a set of ``bench_moe.argument_set``)."""
    L, k = case.loras, case.top_k
    block = shrink.get("BLOCK_SIZE_M", 64)
    if one_block_per_pair(case):
        sorted_ids, expert_ids, post = None, args["topk_ids"].reshape(-1).to(torch.int32), None
    else:
        blocks = align_pairs(
            args["topk_ids"], args["slots"], case.experts, block, L, args["enabled"]
        )
        sorted_ids, expert_ids, post = blocks
    lora_ids = torch.cat([torch.arange(L), torch.tensor([-1])]).to(
        args["slots"].device, torch.int32
    )
    active = torch.tensor([L], dtype=torch.int32)

    def settings(config):
        keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "NUM_WARPS",
                "NUM_STAGES", "SPLIT_K")  # fmt: skip
        defaults = (64, 64, 32, 8, 4, 3, 1)
        return [config.get(key, default) or default for key, default in zip(keys, defaults)]

    def call() -> None:
        op(
            args["y"], args["x"], args["lora_a"], args["lora_b"], args["topk_weights"],
            sorted_ids, expert_ids, post, args["slots"].to(torch.int32), case.rank, k,
            lora_ids, active, args["enabled"], *settings(shrink), *settings(expand),
            mul_routed_weight=case.by_pair,
        )  # fmt: skip

    return call


def run(source: Path, case: bench_moe.MoECase, op, bandwidth: float) -> dict:
    shrink, expand = configs(source, case)
    us, error, first, _ = bench_moe.measure(
        case, lambda args: vllm_call(op, case, args, shrink, expand)
    )
    floor = bench_moe.floor_bytes(case, first)
    return {
        "name": case.name,
        "projection": case.projection,
        "T": case.T,
        "loras": case.loras,
        "us": round(us, 3),
        "floor_bytes": floor,
        "of_copy_bandwidth": round(floor / (us * 1e-6) / (bandwidth * 1e12), 3),
        "relative_error": error,
        "one_block_per_pair": one_block_per_pair(case),
        "shrink_config": shrink,
        "expand_config": expand,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, required=True, help="the extracted release")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    op = load_op(args.vllm_src)
    bandwidth = bench.copy_bandwidth_tbps()
    records = []
    for case in bench_moe.default_cases():
        records.append(run(args.vllm_src, case, op, bandwidth))
        print(f"{case.name:34s} {records[-1]['us']:9.2f} µs", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        result = {
            "peer": "vLLM 0.33.0 fused_moe_lora (Triton), default configurations",
            "gpu": torch.cuda.get_device_name(),
            "copy_bandwidth_tbps": round(bandwidth, 3),
            "cases": records,
        }
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
