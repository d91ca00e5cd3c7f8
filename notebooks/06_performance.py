# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 6. Performance: the roofline, device time and host time
#
# A multi-LoRA layer does little arithmetic on a lot of weights, so its speed limit
# is memory traffic, and at decode sizes even that is tiny: the real cost is often
# the host's work to launch the kernels. This notebook sets the two limits side by
# side and then reads the benchmark measured on an H200.
#
# **You will learn**
#
# - how to count the fewest bytes shrink and expand must move, and turn them into a
#   time floor at the H200's copy bandwidth (4.2 TB/s);
# - why both ops sit far on the memory-bound side of the roofline;
# - where the microseconds of a Numba launch go on the host, and how to measure the
#   host time of a `lora_shrink` call yourself;
# - how to read the benchmark (`docs/benchmarks/h200.json`): device time against the
#   floor, against vLLM's Triton kernels and against torch's gather + `bmm`.

# %%
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import punica_numba
from punica_numba import LoRAKernelMeta, lora_shrink, reference
from punica_numba.bench import Case
from punica_numba.ops import prepare_shrink

SIMULATOR = punica_numba.SIMULATOR
DEVICE = torch.device("cpu") if SIMULATOR else torch.device("cuda")
COPY_BANDWIDTH = 4.2e12  # bytes/s: a device-to-device copy on an H200
PEAK_BF16 = 989e12  # flop/s: the H200's dense bf16 tensor-core peak (NVIDIA's data sheet)
print(f"{'simulator' if SIMULATOR else torch.cuda.get_device_name()}")


def table(header, rows):
    """A Markdown table from a header and rows of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return Markdown("\n".join(lines))


# %% [markdown]
# ## The fewest bytes
#
# Whatever the kernel, shrink must read `x` once and each **active** adapter's `A` once
# per slice, and write the fp32 buffer; expand must read the buffer and each active
# adapter's `B` once, and read and write its part of the output (it adds into it):
#
# ```
# shrink: e*T*H + n*S*r*H*e + 4*S*T*r              e: bytes per element (2 for bf16)
# expand: 4*S*T*r + n*sum(N_s)*r*e + 2*e*T*sum(N_s)  n: active adapters
# ```
#
# The benchmark (`punica_numba.bench`) counts the same bytes; the formulas below must
# agree with its `Case.floor_bytes` on every kind of case.


# %%
def floor_bytes(op, T, n, H, r, slices, e=2):
    S, N = len(slices), sum(slices)
    if op == "shrink":
        return e * T * H + n * S * r * H * e + 4 * S * T * r
    return 4 * S * T * r + n * N * r * e + 2 * e * T * N


for op in ("shrink", "expand"):
    for T, mode in ((1, "identical"), (64, "distinct"), (4096, "uniform")):
        for rank, slices in ((16, [4096]), (16, [4096, 1024, 1024]), (64, [4096])):
            case = Case(op, T, mode, 4096, rank, "bf16", slices)
            mine = floor_bytes(op, T, case.num_loras, 4096, rank, slices)
            assert mine == case.floor_bytes(), (case, mine, case.floor_bytes())
print("the formulas agree with punica_numba.bench.Case.floor_bytes on 18 cases")

# %% [markdown]
# ## The roofline
#
# A kernel is limited either by arithmetic (peak flop/s) or by memory traffic
# (bandwidth × flops per byte). Shrink and expand do `2 * T * r * sum(widths)` flops on
# the bytes above: a few flops per byte at most, while the H200's tensor cores need
# about 989e12 / 4.2e12 ≈ 235 flops per byte to be the limit. Every LoRA shape of a
# serving step sits far left of that ridge, so its floor is simply `bytes / 4.2 TB/s`.

# %%
shapes = [(T, mode) for T in (1, 16, 64, 256, 1024, 4096) for mode in ("identical", "distinct")]
fig, ax = plt.subplots(figsize=(7, 4))
intensity = torch.logspace(-1, 3.5, 200)
ax.loglog(
    intensity,
    torch.minimum(torch.tensor(PEAK_BF16), COPY_BANDWIDTH * intensity) / 1e12,
    "k-",
    label="H200 roof: min(peak, 4.2 TB/s × intensity)",
)
points = []
for op, marker in (("shrink", "o"), ("expand", "s")):
    for T, mode in shapes:
        case = Case(op, T, mode, 4096, 16, "bf16", [4096])
        flops = 2 * T * 16 * 4096
        points.append((op, T, mode, flops / case.floor_bytes()))
    xs = [p[3] for p in points if p[0] == op]
    ax.loglog(xs, [COPY_BANDWIDTH * i / 1e12 for i in xs], marker, label=f"{op}, H=4096, r=16")
ax.axvline(PEAK_BF16 / COPY_BANDWIDTH, color="grey", ls=":", label="ridge point")
ax.set_xlabel("arithmetic intensity (flop / byte)")
ax.set_ylabel("attainable TFLOP/s")
ax.legend(fontsize=8)
plt.show()
assert max(p[3] for p in points) < PEAK_BF16 / COPY_BANDWIDTH / 10, "all far left of the ridge"

# %% [markdown]
# The floors, for the benchmark's token counts (H = 4096, rank 16, one slice, bf16):

# %%
rows = []
for T, mode in (
    (1, "identical"),
    (16, "distinct"),
    (64, "distinct"),
    (256, "distinct"),
    (256, "identical"),
    (4096, "uniform"),
    (4096, "identical"),
):
    row = [T, mode]
    for op in ("shrink", "expand"):
        case = Case(op, T, mode, 4096, 16, "bf16", [4096])
        nbytes = case.floor_bytes()
        row += [f"{nbytes / 1e6:.2f}", f"{nbytes / COPY_BANDWIDTH * 1e6:.2f}"]
    rows.append(row)
display(
    table(["T", "adapters", "shrink MB", "shrink floor µs", "expand MB", "expand floor µs"], rows)
)
assert float(rows[0][3]) < 0.1 and float(rows[0][5]) < 0.1  # one decode token: ~0.03 µs

# %% [markdown]
# ## Host time: where a launch's microseconds go
#
# A decode step's shrink needs well under a microsecond of memory traffic. Launching
# a Numba kernel from Python costs much more, on the host, before the GPU sees
# anything. Measured on the H200's host (`../shared/NUMBA.md` §4, host µs per launch
# of a tiny kernel, 4 tensors + 2 ints on an external stream):
#
# | path | µs per launch |
# | --- | ---: |
# | torch `y.add_(1)`, for scale | 10.5 |
# | Numba dispatcher, lazy `@cuda.jit`, torch tensors | 143 |
# | Numba dispatcher, explicit signature, torch tensors | 83 |
# | explicit signature, tensors pre-wrapped (`cuda.as_cuda_array`) | 57 |
# | `cuda.core.launch` with raw parameters | 6.5 |
# | one replay of a CUDA graph holding the kernel | 4.65 |
# | a CUDA graph of 20 launches: replay vs eager | 3.2 vs 1300 (per 20) |
#
# The dispatcher types every argument and converts every tensor (DLPack) on every
# call; the library pays that once per argument-type combination and then launches
# through `cuda.core` with raw parameters. On top come the op's own argument checks in
# Python. Below, the host time of one `lora_shrink` call, split into the checks
# (`prepare_shrink`), a call that has nothing to launch (no token has an adapter), and
# the full call. On a GPU the full call is not synchronised, so it measures only the
# host; the device time comes from replaying 20 calls captured in a CUDA graph.
#
# On the simulator the "launch" runs the kernel itself, in Python threads, so the
# full call's time there is simulation time and says nothing about a GPU.

# %%
T, H, R, L = (4, 16, 4, 4) if SIMULATOR else (16, 4096, 16, 16)  # decode: 16 tokens
gen = torch.Generator().manual_seed(0)
x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(DEVICE)
A = (torch.randn(L, R, H, generator=gen) * H**-0.5).to(torch.bfloat16).to(DEVICE)
slots = (torch.arange(T) % L).to(DEVICE)  # every token on its own adapter
meta = LoRAKernelMeta.make(L, T, DEVICE)
meta.prepare_tensors(slots)
no_lora_meta = LoRAKernelMeta.make(L, T, DEVICE)
no_lora_meta.prepare_tensors(torch.full((T,), -1, device=DEVICE))
out = torch.zeros(1, T, R, device=DEVICE)


def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


def host_us(fn, calls):
    fn()  # compile / warm up
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


calls = 5 if SIMULATOR else 500
out.zero_()
timings = {
    "checks only (prepare_shrink)": host_us(
        lambda: prepare_shrink(x, [A], out, *meta.meta_args(T), 1.0), calls
    ),
    "no token has an adapter (nothing launched)": host_us(
        lambda: lora_shrink(x, [A], out, *no_lora_meta.meta_args(T), 1.0), calls
    ),
}
out.zero_()
timings["full call: checks + launch"] = host_us(
    lambda: lora_shrink(x, [A], out, *meta.meta_args(T), 1.0), calls
)
launches = calls + 1  # the warm-up call launched too

if not SIMULATOR:  # device time: 20 calls captured in a graph, replays timed with events
    buf = torch.zeros(1, T, R, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lora_shrink(x, [A], buf, *meta.meta_args(T), 1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(20):
            lora_shrink(x, [A], buf, *meta.meta_args(T), 1.0)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    timings["device time per call (graph replay)"] = begin.elapsed_time(end) * 1e3 / 200

where = "simulator (CPU): these are simulation times" if SIMULATOR else "GPU host"
display(Markdown(f"**{where}**, T={T}, H={H}, r={R}, {L} adapters, bf16"))
display(table(["what", "µs per call"], [(k, f"{v:,.1f}") for k, v in timings.items()]))

# Check after timing: the buffer accumulated `launches` identical shrinks.
want = reference.lora_shrink(x, [A], torch.zeros(1, T, R, device=DEVICE), slots, 1.0)
err = (out.double() - launches * want).abs().max() / (launches * want).abs().max()
# (fp32 adds of the same value, `launches` times, err by up to ~launches/2 roundings)
assert err < 1e-4, f"after {launches} accumulating calls the buffer is off by {err:.2e}"
print(f"after {launches} calls the buffer holds {launches}× the reference shrink")

# %% [markdown]
# ### A layer call that comes again
#
# A serving engine makes the same calls step after step: the same weights, the same
# activation and output buffers. So the wrapper records the launches of an
# `add_lora_linear` call the second time its tensors come at the same addresses, and
# from then on replays them while everything they depend on is as it was
# (`punica_numba._cuda.LaunchRecord`). The arguments are still checked on every call;
# a replay skips the heuristic and the description of every argument, and the
# launches themselves are made ready once. Numba passes an array as `5 + 2 * ndim` raw
# parameters, about 70 per launch here, and `cuda.core.launch` converts each of them on
# every call; a `ReadyLaunch` keeps them laid out in memory as the driver reads them
# (an array of pointers), so a launch is one `cuLaunchKernel`. On the H200's host
# (the runs behind v13, af0d6fb, run R1) replaying the shrink and the
# expand took 10.2 µs that way against 58.1 µs through `cuda.core.launch`, and the whole
# eager call 25 µs, of which 13 µs are the checks and the replay key. Since v23 the
# replay goes as one CUDA graph of those ready launches (below, after the benchmark).

# %% [markdown]
# ## The benchmark on an H200
#
# `python -m punica_numba bench --json docs/benchmarks/h200.json --plot
# docs/benchmarks/roofline.png` checks every case against the float64 reference, then
# times it: a pool of argument sets larger than the 60 MB L2 cache is captured in one
# CUDA graph, replays are timed with CUDA events, and the median **device** time per
# call is reported. The same is done for torch's gather + `bmm`. The bandwidth column
# divides the fewest bytes by that time. The table below is read from the stored file;
# it was measured at the commit it names, which may be older than this notebook.

# %%
root = next(
    (p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists()),
    Path(punica_numba.__file__).resolve().parents[1],
)
results_path = root / "docs" / "benchmarks" / "h200.json"
results = json.loads(results_path.read_text()) if results_path.exists() else None

if results is None:
    display(
        Markdown(
            "**The benchmark has not been run yet.** On a GPU, run\n\n"
            "`python -m punica_numba bench --json docs/benchmarks/h200.json "
            "--plot docs/benchmarks/roofline.png`\n\nand execute this notebook again."
        )
    )
else:
    bandwidth = results["copy_bandwidth_tbps"] * 1e12
    rows = []
    for c in results["cases"]:
        floor = c["bytes"] / bandwidth * 1e6
        vllm = c.get("vllm_us")
        rows.append(
            (
                c["op"],
                c["T"],
                c["lora_mode"],
                c["num_loras"],
                "/".join(map(str, c.get("slices", []))),
                c["rank"],
                f"{c['us']:.1f}",
                f"{floor:.2f}",
                f"{floor / c['us']:.0%}",
                f"{vllm:.1f}" if vllm else "",
                f"{c['us'] / vllm:.2f}" if vllm else "",
                f"{c['torch_gather_bmm_us']:.1f}",
            )
        )
        case = Case(
            c["op"],
            c["T"],
            c["lora_mode"],
            c["hidden"],
            c["rank"],
            c["dtype"],
            c.get("slices") or [c["hidden"]],
        )
        assert c["bytes"] == case.floor_bytes(), f"bytes of {c} do not match the formula"
        assert c["us"] > 0.8 * floor, f"{c} beats the copy bandwidth: a timing error?"
    display(
        Markdown(
            f"**{results['gpu']}**, commit `{results['commit']}`, measured copy bandwidth "
            f"{results['copy_bandwidth_tbps']:.2f} TB/s. Times in µs of device time per call."
        )
    )
    display(
        table(
            [
                "op",
                "T",
                "mode",
                "LoRAs",
                "slices",
                "r",
                "µs",
                "floor µs",
                "of BW",
                "vLLM µs",
                "× vLLM",
                "torch µs",
            ],
            rows,
        )
    )
    overhead = results.get("host_overhead_us", {})
    display(table(["host time per eager call", "µs"], [(k, v) for k, v in overhead.items()]))
    decode = [c["us"] for c in results["cases"] if c["T"] <= 64]
    print(
        f"decode cases (T <= 64): device time {min(decode):.1f} .. {max(decode):.1f} µs; "
        f"eager host time per call: {', '.join(f'{k} {v} µs' for k, v in overhead.items())}"
    )

# %% [markdown]
# The same numbers as a picture: for each case, the bandwidth reached (fewest bytes
# divided by device time) by our kernels, by vLLM's Triton kernels where the project's
# performance issue gives a figure, and by torch's gather + `bmm`, against the copy
# bandwidth.

# %%
if results is not None:
    cases = results["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.16 * len(cases) + 2), sharex=True)
    for ax, op in zip(axes, ("shrink", "expand")):
        mine = [c for c in cases if c["op"] == op]
        labels = [
            f"T={c['T']} {c['lora_mode']} {'/'.join(map(str, c['slices']))} r{c['rank']}"
            for c in mine
        ]
        y = range(len(mine))
        for offset, key, name in (
            (-0.27, "us", "punica-numba"),
            (0, "vllm_us", "vLLM Triton"),
            (0.27, "torch_gather_bmm_us", "torch gather + bmm"),
        ):
            tbps = [c["bytes"] / c[key] / 1e6 if c.get(key) else 0 for c in mine]
            ax.barh([i + offset for i in y], tbps, height=0.27, label=name)
        ax.axvline(results["copy_bandwidth_tbps"], color="k", ls="--", label="copy bandwidth")
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(op)
        ax.set_xlabel("fewest bytes / device time (TB/s)")
    axes[1].legend(fontsize=7, loc="lower right")
    plt.tight_layout()
    plt.show()
    assert all(c["bytes"] / c["us"] / 1e6 < 1.25 * results["copy_bandwidth_tbps"] for c in cases)
else:
    print("no benchmark results yet: nothing to plot")

# %% [markdown]
# ## Decode: a chain of trips to memory
#
# With one token the bytes take nanoseconds (the floor column), yet every kernel takes
# 2.4 to 3.1 µs. On the H200 an empty kernel costs about 0.6 µs a launch in this timing,
# and each load that waits for an earlier one adds a trip to memory. So the work at
# decode is to make the chain short, and the SASS (the GPU's machine code, from
# `cuobjdump` or `nvdisasm`) shows where it is long:
#
# - **one trip for the tile**: a block reads its tile's slot, position, rows and first
#   token as one 16-byte load (`kernels.segments.read_tile`); read as four loads,
#   the block waited for the slot, then issued the other three;
# - **the tokens with the tile**: a tensor-core expand block finds its 16 tokens in a
#   row of their own (`kernels.segments.tile_tokens`), loaded with its table row
#   rather than after it (64 tokens over 8 LoRAs: 3.61 -> 3.39 µs);
# - **loads in the order of what they wait for**: B needs only the slot, the old
#   outputs only the tokens; written after the buffer, ptxas issued them only after
#   the buffer had arrived (`kernels.expand_mma`, "Order of the loads");
# - **no division before the first load**: `range(start, stop, step)` with a step known
#   only at run time makes Numba compute the trip count with a 64-bit division routine;
#   a kernel whose grid has a block for every rank group steps by a constant instead
#   (`kernels.shrink`, "One pass": T=1 2.80 -> 2.62 µs);
# - **no checks the shapes make needless**: where every slice's width is a multiple of a
#   warp's 64 columns, the tensor-core expand is built without clamping to the slice's
#   end (`kernels.expand_mma`, "Whole column groups": 808 -> 576 instructions).
#
# Each was measured against the version before it on the same machine
# (the runs behind v14 to v16, 917c232 to ed605b5); none
# changes a sum, so the results are the same bits.
#
# How short can the chain get? Probe kernels of 256 threads timed the same way
# (the runs behind v17, 7968263, "replay_floor"): an empty kernel takes 0.5-0.7 µs, one
# entry of a table and then one word a thread 1.6-1.7 µs, 8 words a thread (8 KB a block)
# 2.1-2.2 µs, and summing them over the block 2.2-2.3 µs. A one-token shrink follows
# that chain with three times those bytes and takes 2.7-3.2 µs.
#
# A shorter chain is not always a faster kernel. At r=64 with 16 tokens per LoRA the
# tensor-core expand loads B a trip late (its 32 words a lane do not fit beside the
# rest), and two ways of moving B forward both lost on the H200
# (the runs behind v18, 15f8e08): two warps each taking half the rank, so that each could
# load its half of B at once, ran 2.4 times the instructions (each warp still finds its
# rows, forms its buffer fragments and rounds its outputs) and took 9.9 µs against 7.7;
# asking L2 for B's rows right after the table took 8.7-8.9 µs. Nsight Compute says what
# the chain hid: the 1,024 one-warp blocks are a single wave that fills 13 % of the SMs'
# warp slots, and the time is latency on that few warps.
#
# What did move it was fewer, wider loads. A dot product does not care in which order
# its k come, only that both operands agree, so each lane takes four neighbouring rank
# elements per step, and the buffer and B come 16 bytes at a time: at r=64 a lane's 64
# loads become 24. At r=64 that took 256 tokens over 16 LoRAs from 7.7 to 7.3 µs and
# 4096 over 64 from 40.5 to 33.0 (v19, aea8fd8; `kernels.expand_mma`, "The
# rank in a lane's order"); copying B to shared memory with `cp.async`, which holds no
# register, had lost (8.1 µs).
#
# One more thing to know when timing small kernels: in a process, the first three CUDA
# graphs ran them about 0.35 µs per call faster than every graph from the fourth capture
# on, the first graph included, and torch's own kernels alike (v19 and v20,
# `docs/benchmarks/lab_notes.md`, "The first graphs of a process"; the cause is not
# known). A serving process captures many graphs, so since v20 the benchmark makes eight
# captures of its own before it times anything (`bench.settle_graphs`). Its first two
# cases, the one-token shrink and expand at r=16, which earlier runs timed in the fast
# window, now take 3.0 and 2.8 µs, not 2.7 and 2.4; a probe kernel with the same two
# trips to memory takes 2.9 µs timed the same way, the floor of any kernel that reads a
# table entry before its weights. A/B comparisons stay fair when every process runs the
# same cases in the same order.
#
# So the one-token kernels had to lose a trip, and with one LoRA in the weight stacks
# (vLLM's default `max_loras` is 1) they can: the weights are known before the slot. A
# block built for one slot takes the token of its own index, loads its activations and
# slot 0's weights together with the token's slot, and tests the slot only where it
# stores (`kernels.shrink`, "One slot"). Where the test sits matters as much as the
# idea: as an early exit, the compilers made every load wait for it (the SASS says so
# before any GPU time is spent). In v21's run the one-token shrink took 2.80 µs and the
# expand 2.20 (at 05bd69a).
#
# One trip, and the shrink still took 0.6 µs more than the expand of the same bytes. A
# probe that loaded the same rows with a handful of instructions took 2.08 µs
# (the runs behind v22, f2fd963): the row kernel, built for tiles, rank groups and rows of
# any length, ran about 200 instructions of index work before its first load, in each of
# a block's 8 warps. The one-token shrink (`kernels.shrink_token`) does only what one
# token of one slot needs, with the row's length compiled in: 48 instructions before its
# first load, the same products in the same order, so the same bits. It takes 2.16 µs in
# v22's run, and the tensor-core expand, loading under one slot too, takes 256 tokens on
# one LoRA in 3.83; since v23 one warp covers 128 columns there (half the blocks), 3.70
# in v23's run, and since v24 four such warps a block with one slice, 3.72 in v24's run on
# a slower machine, 3.55 in v25's (the tables above).
#
# Not every miss is a chain of trips, and fewer trips are not always faster. The r=64
# expand at 16 tokens per LoRA loaded B (8 KB a warp, from DRAM) first and the buffer's
# rows (mostly in L2) after it, all in one trip; since v25 it asks for the buffer first,
# and the kernel went from about 7.2 µs to 6.8 (v25, 8c9aed9): loads that
# would hit L2 no longer queue behind loads from DRAM. With additions in place of its
# tensor-core products it was no faster, and probes that made only its loads and stores
# took 5.7 µs at best, the 5.7 wanted. The roofline's floor counts bytes; how the bytes are
# cut up and in what order they are asked for counts too.
#
# Hopper's copy engine (`cp.async.bulk`) brings bytes into shared memory without holding a
# register for them; in such a probe B came that way, at 5.7 µs. In the kernel it lost,
# 7.4 µs with one copy a warp (at 73063e8, before v26): the probe had beaten
# a chain of its own making, while the kernel's loads were already in flight together, and
# the copy engine waits longer for B than the lanes' loads do. What is left is the chain
# itself. With almost no bytes an expand at r=64 took about 2.5 µs (one token), so the 5.7
# wanted left at most 3.2 µs for the kernel's 12.6 MB: 3.9 TB/s, 95 % of the copy bandwidth.
#
# Part of those 2.5 µs is the launch. On a stream the next kernel starts only once the one
# ahead has finished; Hopper can launch it sooner (a *dependent launch*), once the blocks of
# the one ahead have ended, if it then waits for that kernel before it touches memory. v26
# does so: every kernel's first statement is `begin()`, which on sm_90 is the one PTX
# instruction `griddepcontrol.wait` (`kernels/dependent_launch.py`), and every launch asks
# for it (`punica_numba.dependent_launch()` says whether it does). The results cannot
# change: nothing is read or written before the wait. The one-token expand at r=64 then
# takes 2.0 µs, and the r=64 expand at 16 tokens per LoRA 6.1 (its bound: 3.4 TB/s, 81 % of
# the copy bandwidth). A kernel may also say `griddepcontrol.launch_dependents`, to let the
# next kernel be launched even sooner, while its own blocks still run; measured, that lost
# up to 41 %. The cell below reads the committed A/B (one process per setting, two rounds).

# %%
ab_path = root / "docs" / "benchmarks" / "h200_dependent_launch_ab.json"
ab = json.loads(ab_path.read_text())
settings = {"ordinary": "ordinary", "trigger-first": "said first", "wait-only": "wait only"}
by_setting = {}
for run in ab["rounds"]:
    by_setting.setdefault(settings[run["tag"].split()[0]], []).append(run["us"])
print(f"{'case (op:T:mode:r:widths)':40}" + "".join(f"{name:>18}" for name in by_setting))
for case in ab["rounds"][0]["us"]:
    spread = ["/".join(f"{rounds[case]:.2f}" for rounds in runs) for runs in by_setting.values()]
    print(f"{case:40}" + "".join(f"{cell:>18}" for cell in spread))
print(
    "this process launches its kernels as dependent launches:",
    punica_numba.dependent_launch(),
)

# %% [markdown]
#
# With the launch shorter, what keeps that r=64 expand at 6.1 µs? A probe that makes exactly
# its loads and stores, every one of a lane's in flight before the first is used, in its
# grid and with the dependent launch (`docs/benchmarks/probes/r64_expand_traffic.py`), takes
# 5.0-5.1 µs (at ab28dfa, v26's kernels): the memory fits under the 5.7 wanted.
# (The probes of v24-v25 had let the compiler fold each word as it arrived, so that only a
# few were in flight: they timed a chain of their own.) What is left is the work after the
# last load: the tensor-core products (two `mma` a tile, to keep 16 bits of each fp32
# buffer element), the rounding and the stores, which every warp of the one wave runs at
# once, when the stream ends. Multiplying only the buffer's high halves (half the products;
# not the op's precision) took 0.3-0.5 µs off; starting some blocks later, or multiplying and
# storing half a warp's columns before the rest arrived, did not let the products run under
# the stream. The machine code says why: each instruction carries in its last bits which of
# six scoreboards its result sets and which ones it waits for, and in the H200's code all 28
# of a warp's loads set the same one, which its first split waits for, so no product starts
# before the warp's last load has landed (after v26; `docs/benchmarks/lab_notes.md`).
# `cp.async` copies to shared memory complete in groups that a warp can wait for one at a
# time; with B staged that way, the best of 26 forms tied the kernel: the route through
# shared memory cost about what the earlier start saved
# (`docs/benchmarks/probes/r64_expand_staged.py`). Faster products did not help either:
# Hopper's warpgroup instruction `wgmma`, with B's rows as its register operand and the split
# buffer in shared memory, gave outputs as accurate as the kernel's but took 0.1-0.3 µs longer
# in the best form measured (after v26, `docs/benchmarks/probes/r64_expand_wgmma.py`). One
# more lesson for reading compiled code: the H200 machine compiled this kernel to other PTX
# than a CPU machine did from the same source (all loads first, 160 registers, against a split
# of the buffer between them, 144), so a kernel's schedule is read from the cubin the GPU's
# machine made.
#
# What did help was to overlap the calls instead of the work inside one (v27,
# e40f18a). While one call's last blocks multiply and store, DRAM idles,
# because the next call's loads leave only after its wait. So the tensor-core expand *asks
# ahead*: it says `launch_dependents` first, so the next call's blocks are placed beside its
# own while they run, and before their wait those blocks ask L2 for the lines they will load
# (`prefetch`, `kernels/l2_prefetch.py`). A prefetch puts nothing in a register, so a stale
# address read before the wait costs bandwidth, never a wrong result. Each half alone had
# tied or lost; together they took this row from 6.14-6.46 to 5.73-5.93 µs in A/B runs, and
# 5.93 in v27's benchmark: still 0.23 over the 5.7 wanted. With three slices, or on one LoRA,
# the same lost, so only launches of one slice read from the tile table, of up to 256
# tokens (the most measured), ask ahead. What each block asks for matters too: every column
# group of a tile reads the same buffer rows, and when all 64 asked for them the r=16 expand
# was slower than when one group in eight does (v28, 46f9381: 256 over 16 LoRAs 3.84 ->
# 3.38 µs in the benchmark); this row tied (5.84).
#
# The last step used the time that asking ahead had made (v29,
# dab1d2e). A block placed early now waits for microseconds before its
# wait returns, and it already knew its slot there: so it loads its rows of B into the
# registers that hold them anyway, and a block whose table row has no tile leaves without
# waiting at all. That is safe only because nothing still running can be writing B or the
# table: of this package's kernels, only these expands say `launch_dependents`, and they
# write only their outputs (a caller's own kernel just ahead that said it early, and wrote
# the weights, would break that: the module's note says so). A trial before v26 had tried loads
# before the wait and found they saved little, when a block had almost no time before its
# wait; the same idea paid once the launches overlapped. The row went to 5.35-5.61 µs in
# A/B runs (5.77-6.02 before) and 5.58 in v29's benchmark, under the 5.7 wanted; the r=64
# expand at 64 over 8 LoRAs from about 3.7 to 3.3.

# %% [markdown]
#
# The host has its chain too. An eager call that repeats on the same tensors is replayed
# from a record of its launches, laid out once; v23 captures those launches once as a
# CUDA graph and runs it with one driver call (2.8-4.9 µs of host time on the H200's
# host, where the two launches took 12-15), and keeps the small fp32 buffer of a call
# that gives none instead of allocating it each time. Inside a caller's own capture the
# launches still go one by one, so the caller's graph holds them
# (`_cuda.LaunchRecord.replay`). What is left, 16-34 µs a call in v23's to v26's runs, is
# the Python of the checks, which some of that host's processes run at half speed.

# %% [markdown]
# ## Reading it
#
# - At **decode sizes** (T ≤ 64) the floor is well under a microsecond for a few
#   adapters; a measured time of several microseconds there is latency (too few
#   blocks, dependent loads, the launch itself), not bandwidth.
# - At **prefill sizes** (T = 4096) the floor is tens of microseconds, and the fraction
#   of the copy bandwidth reached measures how well the kernel streams its operands.
# - Compare the **host** time of an eager call with the **device** times of the decode
#   cases (the line printed under the tables): when the host takes longer, the GPU
#   waits for Python, and only capturing the LoRA layers in a CUDA graph (notebook 5)
#   lets a faster kernel show.
