"""What the probes beside this file share (not a probe itself: the tests build every other file
here as one).

* :func:`ptx_statement`: one PTX statement as an intrinsic (GPU only), the package's own
  (``punica_numba.kernels.dependent_launch``), passed on;
* :func:`op_launches`: the benchmark's argument sets for a case, and the op's own launch on any
  of them, recorded by wrapping ``ops.launching.launcher_of``, so that a probe's kernels can
  be run on exactly the op's arguments and grid;
* :func:`timed_against_the_op`: each variant's µs per call, timed as the benchmark times the
  op, with the op itself timed halfway through and at the end.

A probe imports them as ``from _shared import ...``: run as a script, a probe's directory
leads ``sys.path``.
"""

import torch

from punica_numba import ops
from punica_numba.bench import _argument_set, _slots, pool_size, run_case, time_calls
from punica_numba.kernels.dependent_launch import ptx_statement
from punica_numba.meta import LoRAKernelMeta
from punica_numba.ops import launching

__all__ = ["op_launches", "ptx_statement", "timed_against_the_op"]


def op_launches(case):
    """``(slots, sets, run_op)`` for an expand ``case`` on the GPU: each token's slot and the
    benchmark's argument sets (seed 0, as ``bench.run_case`` makes them, enough to fill twice the
    L2), and ``run_op(a)``, which runs the op on the argument set ``a`` (adding into its output)
    and returns its launch as ``(grid, arguments)``. Wraps ``ops.launching.launcher_of`` for the
    rest of the process."""
    gen = torch.Generator().manual_seed(0)
    slots = _slots(case, gen)
    meta = LoRAKernelMeta.make(case.num_loras, case.T, "cuda")
    meta.prepare_tensors(slots.to("cuda"))
    sets = [_argument_set(case, gen, "cuda") for _ in range(pool_size(case.floor_bytes()))]
    launches, real = [], launching.launcher_of

    def recording(kernel):  # the op's launches: (grid, arguments)
        inner = real(kernel)

        def launch(grid, threads, args):
            launches.append((grid, args))
            inner(grid, threads, args)

        return launch

    def run_op(a):
        launches.clear()
        ops.prepare_expand(
            a["x"], a["weights"], a["out"], *meta.meta_args(case.T), offset_start=0, add_inputs=True
        )()
        return launches[-1]

    launching.launcher_of = recording
    return slots, sets, run_op


def timed_against_the_op(case, names, calls_of, rnd: int) -> dict:
    """µs per call of each variant in ``names`` (``calls_of(name)``: its list of calls, timed by
    ``bench.time_calls``), the order rotated by ``rnd``; the op (``bench.run_case``) timed
    halfway through (``"op"``) and at the end (``"op_end"``)."""
    us = {}
    names = names[rnd % len(names) :] + names[: rnd % len(names)]
    for i, name in enumerate(names):
        if i == len(names) // 2:
            us["op"] = run_case(case)["us"]
        us[name] = time_calls(calls_of(name))
    us["op_end"] = run_case(case)["us"]
    return us
