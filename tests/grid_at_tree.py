"""``bench --grid`` with another version's kernels: this tree's grid, an older tree's ops.

The grid's targets ask for no case slower than the best of an earlier version (v29,
dab1d2e) and torch; but v29 predates the grid, so its own ``bench`` cannot run it. This runs
this tree's grid (its cases, pools, float64 checks and timing) with the older package's
``prepare_shrink``, ``prepare_expand``, ``LoRAKernelMeta``, ``config_name``,
``PunicaWrapperNumba`` and ``LoRAMapping`` in place of this tree's, and writes the grid's JSON
under the older commit, with ``"kernels_from"`` naming the tree, its commit and the harness's
commit. Its records compare with this tree's grid case by case: ``bench --grid --merge
PARTS... --against THAT.json``.

Here, where git is (the GPU machine has no history)::

    mkdir -p .trees/v29 && git archive dab1d2e punica_numba | tar -x -C .trees/v29

and then, on the GPU (``.trees`` carried beside the working tree)::

    python tests/grid_at_tree.py .trees/v29 --commit dab1d2e --part 1/3 --json grid_v29_1.json

Every option past the tree is ``bench --grid``'s. The older package is loaded as
``punica_numba_tree`` (its own imports are relative), beside this one. A version whose
``add_lora_linear`` takes ``lora_bias_stacked`` before ``scale`` (vLLM v0.8-v0.9's order, as
v29's does) is called with no bias.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
from collections import Counter
from pathlib import Path

NAME = "punica_numba_tree"
#: Calls made through the older package, by what was called (read by the tests).
CALLS: Counter = Counter()


def load_tree(tree: Path):
    """The package ``tree/punica_numba``, imported as :data:`NAME`."""
    root = tree / "punica_numba"
    if not (root / "__init__.py").is_file():
        raise FileNotFoundError(f"{tree} holds no punica_numba/__init__.py")
    spec = importlib.util.spec_from_file_location(
        NAME, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = package
    spec.loader.exec_module(package)
    return package


def _counted(name, function):
    def call(*args, **kwargs):
        CALLS[name] += 1
        return function(*args, **kwargs)

    return call


def _wrapper_class(old_wrapper):
    """The older ``PunicaWrapperNumba`` called as the grid calls this tree's:
    ``add_lora_linear(y, x, a, b, scale, slices)``."""
    base = old_wrapper.PunicaWrapperNumba
    takes_bias = "lora_bias_stacked" in inspect.signature(base.add_lora_linear).parameters

    class Wrapper(base):
        def add_lora_linear(self, y, x, a, b, scale, slices, **kwargs):
            CALLS["add_lora_linear"] += 1
            if takes_bias:
                return super().add_lora_linear(y, x, a, b, None, scale, slices, **kwargs)
            return super().add_lora_linear(y, x, a, b, scale, slices, **kwargs)

    return Wrapper


def use_tree(tree: Path, commit: str, harness: str | None = None) -> None:
    """Put the older tree's ops and wrapper where this tree's grid calls its own, and have
    the grid's JSON say where its kernels came from (``harness``: this tree's commit; by
    default git's HEAD)."""
    from punica_numba import bench
    from punica_numba import bench_grid as grid

    load_tree(tree)
    modules = ("ops", "meta", "launch", "wrapper", "mapping")
    old = {m: importlib.import_module(f"{NAME}.{m}") for m in modules}
    bench.prepare_shrink = _counted("prepare_shrink", old["ops"].prepare_shrink)
    bench.prepare_expand = _counted("prepare_expand", old["ops"].prepare_expand)
    bench.LoRAKernelMeta = old["meta"].LoRAKernelMeta
    bench.config_name = old["launch"].config_name
    grid.PunicaWrapperNumba = _wrapper_class(old["wrapper"])
    grid.LoRAMapping = old["mapping"].LoRAMapping
    kernels_from = {"tree": str(tree), "commit": commit, "harness": harness or bench._commit()}
    write = grid._write_json

    def write_json(result, path):
        write({**result, "kernels_from": kernels_from}, path)

    grid._write_json = write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tree", type=Path, help="a folder holding the older punica_numba/")
    parser.add_argument("--commit", required=True, help="the older tree's commit")
    parser.add_argument("--harness", help="this tree's commit (default: git's HEAD)")
    args, rest = parser.parse_known_args(argv)
    if "--merge" in rest:
        parser.error("--merge joins JSONs of any tree: run it as `bench --grid --merge`")
    use_tree(args.tree, args.commit, args.harness)
    from punica_numba import bench_grid as grid

    return grid.main([*rest, "--commit", args.commit])


if __name__ == "__main__":
    sys.exit(main())
