"""Dependent launches: every kernel waits for the one before it before it touches memory.

With a programmatic dependent launch (``_cuda.dependent_launch``) a kernel may start
before the kernel ahead of it on the stream has finished; it is correct only because
its first act is ``griddepcontrol.wait`` (:mod:`punica_numba.kernels.dependent_launch`).
These tests pin that down:

1. in the source, on any machine: every ``@jit_kernel`` function's first statement is
   ``begin()``, bound in its builder to ``prologue()``, but for the tensor-core expand's
   asking ahead before it (``if ASK_AHEAD: let_next(); ask_for_the_tile(...)``: the next
   launch let go, and L2 asked for lines; then its words of B loaded and, with no tile,
   the block gone: :mod:`punica_numba.kernels.expand_mma`, "B before the wait"), after
   only its thread-private arrays and numbers are made;
2. on the simulator: no dependent launch, and ``begin()`` does nothing;
3. on the GPU: the switch says yes on sm_90 and newer; both launch paths ask for it;
   each kind of kernel, as compiled, waits before its first load or store of memory,
   but for a build that asks ahead, which before the wait only loads (its tile table
   and B) and prefetches;
   and with ``PUNICA_NUMBA_DEPENDENT_LAUNCH=0`` (in a fresh process) the kernels and
   launches are ordinary ones that give the same bits.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import types
from unittest import mock

import pytest
import torch

from punica_numba import _cuda, kernels, ops
from punica_numba.kernels import dependent_launch as prologue_module
from punica_numba.launch import force_launch_config, launch_configs
from punica_numba.ops import launching, moe_dense
from punica_numba.ops import moe as moe_ops

from .op_cases import Problem, ShrinkCase, check_expand, check_shrink, serving_expand_case
from .test_moe import _named_result, _one_block_call, check_against_reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = pathlib.Path(kernels.__file__).parent

#: The modules that hold a kernel (a ``@jit_kernel`` function), one kernel each.
KERNEL_MODULES = {
    "expand",
    "expand_lanes",
    "expand_mma",
    "expand_mma_staged",
    "expand_tiled",
    "moe_claims",
    "moe_expand",
    "moe_expand_columns",
    "moe_expand_mma",
    "moe_expand_outer",
    "moe_fused",
    "moe_idle_rows",
    "moe_shrink",
    "moe_shrink_mma",
    "moe_shrink_split",
    "moe_shrink_tiled",
    "moe_pairs",
    "moe_tiles",
    "shrink",
    "shrink_mma",
    "shrink_mma_cluster",
    "shrink_mma_joint",
    "shrink_mma_split",
    "shrink_mma_staged",
    "shrink_mma_staged_split",
    "shrink_split",
    "shrink_token",
}

# -- 1. in the source ---------------------------------------------------------------------


def _is_jit_kernel(decorator: ast.expr) -> bool:
    call = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(call, ast.Name) and call.id == "jit_kernel"


def _is_plain_kernel(decorator: ast.expr) -> bool:
    """Whether ``decorator`` makes a kernel without :func:`jit_kernel`: ``@cuda.jit`` with
    no ``device=True``."""
    call = decorator.func if isinstance(decorator, ast.Call) else decorator
    if ast.unparse(call) != "cuda.jit":
        return False
    keywords = decorator.keywords if isinstance(decorator, ast.Call) else []
    return not any(k.arg == "device" and ast.unparse(k.value) == "True" for k in keywords)


def _calls(statement: ast.stmt, name: str) -> bool:
    """Whether ``statement`` is the bare call ``name()``."""
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Name)
        and statement.value.func.id == name
        and not statement.value.args
        and not statement.value.keywords
    )


def _binds_prologue(statement: ast.stmt) -> bool:
    """Whether ``statement`` is ``begin = prologue()``."""
    return (
        isinstance(statement, ast.Assign)
        and [ast.unparse(t) for t in statement.targets] == ["begin"]
        and ast.unparse(statement.value) == "prologue()"
    )


def _is_call_of(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) == name


def _is_private(statement: ast.stmt) -> bool:
    """Whether ``statement`` makes only a thread's own values: ``name =
    cuda.local.array(...)`` or ``name = int64(<number>)``."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return False
    value = statement.value
    if _is_call_of(value, "cuda.local.array"):
        return True
    if not (_is_call_of(value, "int64") and len(value.args) == 1):
        return False
    try:
        return isinstance(ast.literal_eval(value.args[0]), int)
    except ValueError:  # not a literal: it may read memory
        return False


def _asks_ahead(statement: ast.stmt) -> bool:
    """Whether ``statement`` is the tensor-core expand's asking ahead: ``if ASK_AHEAD:``
    with ``let_next()`` first, then only a call of ``ask_for_the_tile``, B loaded by
    ``name = load_b_before_the_wait(...)``, and ``if ...: return``."""
    if not (
        isinstance(statement, ast.If)
        and ast.unparse(statement.test) == "ASK_AHEAD"
        and not statement.orelse
        and statement.body
        and _calls(statement.body[0], "let_next")
    ):
        return False
    for step in statement.body[1:]:
        asks = isinstance(step, ast.Expr) and _is_call_of(step.value, "ask_for_the_tile")
        loads_b = isinstance(step, ast.Assign) and _is_call_of(step.value, "load_b_before_the_wait")
        leaves = (
            isinstance(step, ast.If)
            and not step.orelse
            and len(step.body) == 1
            and isinstance(step.body[0], ast.Return)
            and step.body[0].value is None
        )
        if not (asks or loads_b or leaves):
            return False
    return True


def kernels_without_prologue(source: str) -> tuple[list[str], int]:
    """The ``@jit_kernel`` functions in ``source`` whose first statement is not ``begin()``
    (nor, after thread-private values, asking ahead, then ``begin()``) or whose builder
    does not bind ``begin = prologue()`` before them, and every kernel made by a plain
    ``@cuda.jit``; and how many kernels there are in all."""
    wrong, found = [], 0
    for builder in ast.walk(ast.parse(source)):
        if not isinstance(builder, ast.FunctionDef):
            continue
        bound = False
        for statement in builder.body:
            bound = bound or _binds_prologue(statement)
            if isinstance(statement, ast.FunctionDef) and any(
                _is_plain_kernel(d) for d in statement.decorator_list
            ):
                found += 1
                wrong.append(statement.name)
            elif isinstance(statement, ast.FunctionDef) and any(
                _is_jit_kernel(d) for d in statement.decorator_list
            ):
                found += 1
                body = list(statement.body)
                while body and _is_private(body[0]):
                    body.pop(0)
                if body and _asks_ahead(body[0]):
                    body.pop(0)
                if not (bound and body and _calls(body[0], "begin")):
                    wrong.append(statement.name)
    return wrong, found


def test_every_kernel_begins_with_the_prologue():
    """Each kernel module holds one kernel, and its first statement is ``begin()``."""
    for name in sorted(KERNEL_MODULES):
        wrong, found = kernels_without_prologue((KERNELS / f"{name}.py").read_text())
        assert found == 1, (name, found)
        assert wrong == [], name
    for path in KERNELS.glob("*.py"):  # and no kernel lives anywhere else
        if path.stem not in KERNEL_MODULES:
            assert kernels_without_prologue(path.read_text())[1] == 0, path.name


def test_the_source_check_sees_a_kernel_that_reads_first():
    """The check above fails a kernel that reads before ``begin()``, or has none bound, or
    is a plain ``@cuda.jit`` kernel."""
    kernel = """
def build():
    begin = prologue()

    @jit_kernel(32)
    def k(x):
        {body}
    return k
"""
    assert kernels_without_prologue(kernel.format(body="begin()\n        x[0] = 1")) == ([], 1)
    assert kernels_without_prologue(kernel.format(body="x[0] = 1\n        begin()")) == (["k"], 1)
    unbound = kernel.replace("begin = prologue()", "begin = something()")
    for plain in ("@cuda.jit", "@cuda.jit(device=False)", "@cuda.jit(cache=True)"):
        made = kernel.replace("@jit_kernel(32)", plain).format(body="begin()")
        assert kernels_without_prologue(made) == (["k"], 1), plain
    device = kernel.replace("@jit_kernel(32)", "@cuda.jit(device=True)")
    assert kernels_without_prologue(device.format(body="x[0] = 1")) == ([], 0)
    assert kernels_without_prologue(unbound.format(body="begin()")) == (["k"], 1)
    ask = "if ASK_AHEAD:\n            let_next()\n            ask_for_the_tile(x)\n        "
    assert kernels_without_prologue(kernel.format(body=ask + "begin()")) == ([], 1)
    reads = ask.replace("let_next()", "x[0] = 1")
    assert kernels_without_prologue(kernel.format(body=reads + "begin()")) == (["k"], 1)
    assert kernels_without_prologue(kernel.format(body=ask + "x[0] = 1")) == (["k"], 1)
    private = "b = cuda.local.array(4, int64)\n        s = int64(-1)\n        "
    b = "s = load_b_before_the_wait(b, x)\n            if s == -1:\n                return\n"
    ask_b = ask.replace("ask_for_the_tile(x)\n", "ask_for_the_tile(x)\n            " + b)
    taken = kernels_without_prologue(kernel.format(body=private + ask_b + "begin()"))
    assert taken == ([], 1)
    stores = ask_b.replace("return", "x[0] = 1")
    assert kernels_without_prologue(kernel.format(body=stores + "begin()")) == (["k"], 1)
    reads_first = "s = x[0]\n        " + ask_b + "begin()"
    assert kernels_without_prologue(kernel.format(body=reads_first)) == (["k"], 1)
    not_private = private.replace("int64(-1)", "int64(x[0])")
    assert kernels_without_prologue(kernel.format(body=not_private + ask_b + "begin()")) == (
        ["k"],
        1,
    )


# -- 2. on the simulator ------------------------------------------------------------------


@pytest.mark.skipif(not _cuda.SIMULATOR, reason="the simulator's answer")
def test_the_simulator_launches_the_ordinary_way():
    assert _cuda.dependent_launch() is False
    assert prologue_module.prologue() is prologue_module._nothing


# -- 3. on the GPU ------------------------------------------------------------------------

#: The instructions of a kernel's PTX that may touch memory another kernel sees: global or
#: generic addresses, not the kernel's parameters, its threads' own local memory (where
#: LLVM may zero a local array before the wait) or its block's shared memory.
#: A memory instruction at the start of a line, or of a statement in an inline-asm block
#: (``{ prefetch.global.L2 [%rd5]; }``), guarded by a predicate or not (``@%p1 ld...``):
#: any state space but the kernel's own.
_MEMORY = re.compile(
    r"(?:^|[{;])\s*(?:@!?%?\w+\s+)?((ld|st|atom|red|cp|prefetch)\.(?!param|local|shared))"
)


def memory_before_wait(ptx: str) -> list[str]:
    """The instructions of a kernel's PTX, from its ``.entry``, that touch memory before
    its ``griddepcontrol.wait`` (each from its opcode to the end of its line); all of them
    when there is none."""
    early = []
    for line in ptx[ptx.index(".entry") :].splitlines():
        if line.strip() == "griddepcontrol.wait;":
            return early
        early += [line[m.start(1) :].strip() for m in _MEMORY.finditer(line)]
    return early or ["(no griddepcontrol.wait)"]


def test_the_ptx_check_sees_a_load_before_the_wait():
    good = ".entry k(\n)\n{\n\tld.param.u64 %rd1, [p];\n\tgriddepcontrol.wait;\n"
    good += "\tld.global.u32 %r1, [%rd1];\n}"
    assert memory_before_wait(good) == []
    wait = "\tgriddepcontrol.wait;"
    early = good.replace(wait, "\tld.global.u32 %r2, [%rd1];\n" + wait)
    assert memory_before_wait(early) == ["ld.global.u32 %r2, [%rd1];"]
    generic = good.replace(wait, "\tst.u32 [%rd1], %r2;\n" + wait)
    assert memory_before_wait(generic) == ["st.u32 [%rd1], %r2;"]
    own = good.replace(wait, "\tst.local.v2.u64 [%rd2], {%rd3, %rd3};\n" + wait)
    assert memory_before_wait(own) == []
    inline = good.replace(wait, "\t{ prefetch.global.L2 [%rd1]; }\n" + wait)
    assert memory_before_wait(inline) == ["prefetch.global.L2 [%rd1]; }"]
    guarded = good.replace(wait, "\t@%p1 ld.global.nc.u32 %r2, [%rd1];\n" + wait)
    assert memory_before_wait(guarded) == ["ld.global.nc.u32 %r2, [%rd1];"]
    assert memory_before_wait(good.replace(wait, "")) != []


@contextlib.contextmanager
def recorded_launchers():
    """Within it, every launcher that ``ops`` takes for a kernel is noted in the list it
    gives (a launcher's ``kernels`` are what its launches ran)."""
    made, real = [], launching.launcher_of

    def recorded(kernel):
        made.append(real(kernel))
        return made[-1]

    # (ops.moe and ops.moe_dense import it by name)
    launching.launcher_of = moe_ops.launcher_of = moe_dense.launcher_of = recorded
    try:
        yield made
    finally:
        launching.launcher_of = moe_ops.launcher_of = moe_dense.launcher_of = real


def _one_of_each_kernel() -> None:
    """Run a shrink and an expand under every launch configuration of the GPU's table, a
    one-token shrink on a stack of one LoRA (the one-token kernel), and the MoE op of every
    version on both projections (version 4 also on bf16, which its kernels take), each
    checked."""
    problem = Problem(slots=[0, 1] * 16, prepared=32, num_loras=2, seed=5)
    for config in launch_configs("shrink"):
        case = ShrinkCase(problem, 512, 16, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
        with force_launch_config("shrink", config):
            check_shrink(ops.lora_shrink, case)
    for config in launch_configs("expand"):
        rank = 32 if config.staged else 16  # (a staged expand takes whole chunks of 32)
        with force_launch_config("expand", config):
            check_expand(ops.lora_expand, serving_expand_case(problem, rank, [512, 128]))
            if config.kernel == "mma":  # one slice: the builds that ask ahead
                check_expand(ops.lora_expand, serving_expand_case(problem, rank, [512]))
    one = Problem(slots=[0], prepared=1, num_loras=1, seed=6)
    check_shrink(
        ops.lora_shrink,
        ShrinkCase(one, 512, 16, 1, 0, torch.bfloat16, torch.float32, 0.5, False),
    )
    for version in moe_ops.VERSIONS:
        for mul_routed_weight in (False, True):
            _named_result(mul_routed_weight, version=version)
    # Version 6's outer-product expand takes full blocks only (OUTER_EXPAND_FROM_PAIRS pairs
    # a block on average); the named call's are not, so here it takes it at any fill.
    with mock.patch.object(moe_ops, "OUTER_EXPAND_FROM_PAIRS", 0):
        for mul_routed_weight in (False, True):
            _named_result(mul_routed_weight, version=6)
    # Version 14's table of claimed rows is its pairs path's, past its one launch (which takes
    # the named call's 6 pairs): here it takes them on that path.
    with mock.patch.object(moe_ops, "ONE_LAUNCH_TO_PAIRS", 0):
        for mul_routed_weight in (False, True):
            _named_result(mul_routed_weight, version=14)
    for projection in ("w13", "w2"):  # version 4's own kernels need bf16 rows of words
        case, d, blocks = _one_block_call(
            torch.bfloat16, rank=16, K=32, N=8, B=16, projection=projection, offset=0
        )
        y, before = d["y"], d["y"].clone()
        moe_ops.fused_moe_lora(
            y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
            block_size=16, mul_routed_weight=case.mul, version=4,
        )  # fmt: skip
        check_against_reference(case, y, d, before)


def _module_of(kernel) -> str:
    return kernel.py_func.__module__.rsplit(".", 1)[-1]


@pytest.mark.gpu
def test_the_switch_and_both_launch_paths_ask_for_a_dependent_launch():
    capability = torch.cuda.get_device_capability()
    wanted = capability >= (9, 0) and os.environ.get("PUNICA_NUMBA_DEPENDENT_LAUNCH") != "0"
    assert _cuda.dependent_launch() is wanted
    eager = _cuda._core_launch_config((3, 1, 1), 64)
    assert eager.programmatic_stream_serialization is wanted
    if wanted:
        kernel = types.SimpleNamespace(handle=0)  # (a ReadyLaunch reads its handle)
        config = _cuda._launch_ex_config(_cuda.ReadyLaunch((3, 2, 1), 64, kernel, []))
        assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
        assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (64, 1, 1)
        assert config.numAttrs == 1
        (attribute,) = config.attrs
        assert attribute.value.programmaticStreamSerializationAllowed == 1
        assert attribute.id.name == "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
        # A launch in clusters asks for their shape too, after the dependent launch.
        config = _cuda._launch_ex_config(_cuda.ReadyLaunch((3, 2, 4), 64, kernel, [], 4))
        assert config.numAttrs == 2
        serialization, shape = config.attrs
        assert shape.id.name == "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION"
        dims = shape.value.clusterDim
        assert (dims.x, dims.y, dims.z) == (1, 1, 4)


@pytest.mark.gpu
def test_every_kind_of_kernel_waits_before_it_touches_memory():
    """The compiled PTX of each kernel that ran: the wait comes before every load and
    store (a dependent launch may start it before the kernel ahead has finished)."""
    if not _cuda.dependent_launch():
        pytest.skip("no dependent launch on this GPU or in this environment")
    capability = torch.cuda.get_device_capability()
    seen, asked = set(), 0
    with recorded_launchers() as launchers:
        _one_of_each_kernel()
    for launcher in launchers:
        for kernel in launcher.kernels.values():
            ptx = kernel.inspect_asm(capability)
            early = memory_before_wait(ptx)
            seen.add(_module_of(kernel))
            if "launch_dependents" in ptx:  # asking ahead: loads and prefetches only
                assert _module_of(kernel) == "expand_mma", kernel.py_func
                assert all(_ASKING.match(line) for line in early), early
                asked += 1
                continue
            # Nor does any other let the next kernel start early (kernels.dependent_launch)
            assert early == [], kernel.py_func
    assert seen == KERNEL_MODULES
    assert asked > 0  # a build that asks ahead was among them


#: What a kernel that asks ahead may do to memory before its wait: load (its tile table,
#: for the addresses it asks for, and its words of B, through global or generic addresses)
#: and prefetch. No store, atomic or copy.
_ASKING = re.compile(r"^(ld\.|prefetch\.global\.L2 |cp\.async\.bulk\.prefetch\.L2\.)")


#: Run in a fresh process, under the environment it was given (``report_fixed_calls``).
_FIXED_CALLS = (
    "import sys; from tests.test_dependent_launch import report_fixed_calls as r; r(sys.argv[1])"
)


def report_fixed_calls(path: str) -> None:
    """Make :func:`fixed_calls`, save their results at ``path``, and print what the switch
    says, how many kernels ran, whether any of them has griddepcontrol in its PTX, and
    whether the eager launch asks for a dependent launch."""
    buffer, out, launchers = fixed_calls()
    torch.save((buffer.cpu(), out.cpu()), path)
    capability = torch.cuda.get_device_capability()
    unique = {id(launcher): launcher for launcher in launchers}.values()
    ptx = [k.inspect_asm(capability) for launcher in unique for k in launcher.kernels.values()]
    eager = _cuda._core_launch_config((1, 1, 1), 32)
    said = {
        "switch": _cuda.dependent_launch(),
        "kernels": len(ptx),
        "griddepcontrol": any("griddepcontrol" in p for p in ptx),
        "eager": eager.programmatic_stream_serialization,
    }
    print(json.dumps(said))


def fixed_calls():
    """A shrink of 64 tokens on 8 LoRAs into a buffer, then an expand of it, each launched
    twice (the second launch by raw parameters, after the first compiled); return the
    buffer, the output and the launchers used."""
    from punica_numba.meta import LoRAKernelMeta

    gen = torch.Generator().manual_seed(11)
    slots = torch.randint(0, 8, (64,), generator=gen).cuda()
    meta = LoRAKernelMeta.make(8, 64, "cuda")
    meta.prepare_tensors(slots)
    x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    a = torch.randn(8, 16, 1024, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(8, 1024, 16, generator=gen).to("cuda", torch.bfloat16)
    old = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    with recorded_launchers() as launchers:
        for _ in range(2):
            buffer = torch.zeros(1, 64, 16, device="cuda")
            ops.lora_shrink(x, [a], buffer, *meta.meta_args(64), 0.5)
            out = old.clone()
            ops.lora_expand(buffer, [b], out, *meta.meta_args(64), add_inputs=True)
    torch.cuda.synchronize()
    return buffer, out, launchers


@pytest.mark.gpu
def test_the_environment_turns_it_off_with_the_same_bits(tmp_path):
    """``PUNICA_NUMBA_DEPENDENT_LAUNCH=0``, read by a fresh process: ordinary kernels and
    launches, and the same bits as this process's launches give."""
    results = {}
    for setting in ("0", "1"):
        env = dict(os.environ, PUNICA_NUMBA_DEPENDENT_LAUNCH=setting)
        saved = tmp_path / f"{setting}.pt"
        run = subprocess.run(
            [sys.executable, "-c", _FIXED_CALLS, str(saved)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        said = json.loads(run.stdout.strip().splitlines()[-1])
        on = setting == "1" and torch.cuda.get_device_capability() >= (9, 0)
        assert said == {"switch": on, "kernels": 2, "griddepcontrol": on, "eager": on}, said
        results[setting] = torch.load(saved)
    buffer, out, _ = fixed_calls()  # and this process, under its own setting
    for got in results.values():
        assert torch.equal(got[0], buffer.cpu()) and torch.equal(got[1], out.cpu())
