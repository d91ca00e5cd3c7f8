"""The documentation: the site builds without a warning, and what it shows is current.

* ``sphinx-build -W`` builds the site (API reference from the docstrings, the
  notebooks from their stored outputs, the benchmark page) into a temporary folder;
* every notebook is a jupytext ``py:percent`` file paired with an ``.ipynb`` whose
  cells say the same, and opens with a title and "You will learn" bullets;
* the example on the "Testing your own kernels" page runs and passes;
* each probe kept beside the benchmark results (``docs/benchmarks/probes``) still builds
  against the package, and the r=64 traffic probe touches what it says it does.
"""

from __future__ import annotations

import importlib.util
import inspect
import linecache
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.py"))


def test_docs_build_without_warnings(tmp_path):
    # The docs extras (`pip install -e .[docs]`); a machine without them skips the build.
    pytest.importorskip("sphinx.cmd.build")
    pytest.importorskip("myst_nb")
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        "-d",
        str(tmp_path / "doctrees"),
        str(DOCS),
        str(tmp_path / "html"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"sphinx-build failed:\n{done.stdout}\n{done.stderr}"
    html = tmp_path / "html"
    for page in ("index", "installation", "api", "benchmarks", "testing"):
        assert (html / f"{page}.html").exists(), page
    for notebook in NOTEBOOKS:
        assert (html / "_generated" / "notebooks" / f"{notebook.stem}.html").exists(), notebook
    api = (html / "api.html").read_text()
    for name in (
        "lora_shrink",
        "lora_expand",
        "LoRAKernelMeta",
        "LoRAMapping",
        "convert_mapping",
        "PunicaWrapperNumba",
        "reference.add_lora_linear",
        "SIMULATOR",
    ):
        assert f'id="punica_numba.{name}"' in api, f"{name} is missing from the API reference"


@pytest.mark.parametrize("script", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_pairs_agree(script):
    jupytext = pytest.importorskip("jupytext")
    paired = script.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing: run `make notebooks`"
    text, stored = jupytext.read(script), jupytext.read(paired)

    def cells(notebook):
        return [(c.cell_type, c.source.strip()) for c in notebook.cells]

    assert cells(text) == cells(stored), (
        f"{script.name} and {paired.name} differ: run `jupytext --sync {script}` "
        "(or `make notebooks`)"
    )
    first = text.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "no title"
    assert "You will learn" in first.source, "the first cell must list what you will learn"


def test_every_ipynb_has_a_script():
    scripts = {p.stem for p in NOTEBOOKS}
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert notebook.stem in scripts, f"{notebook.name} has no paired .py script"


def test_the_testing_page_example_passes():
    """The code on docs/testing.md is a working use of the property checks."""
    from . import tolerance

    saved = dict(tolerance.LARGEST_ERRORS)  # the example's errors are not our kernels'
    page = (DOCS / "testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert blocks, "docs/testing.md shows no Python example"
    namespace: dict = {"__name__": "docs_testing_example"}
    # Under a name of its own in linecache, so that inspect.getsource finds the example's
    # code (hypothesis keys its example database on a test's source): under the page's
    # own path it read the page's Markdown, which may not even tokenize.
    source, filename = "\n".join(blocks), "<docs/testing.md: its Python blocks>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert len(tests) == 2, "the example should define a shrink test and an expand test"
    assert all(inspect.getsource(t) in source for t in tests), "hypothesis reads a test's source"
    try:
        for test in tests:
            test()  # hypothesis runs its examples here
    finally:
        tolerance.LARGEST_ERRORS.clear()
        tolerance.LARGEST_ERRORS.update(saved)


PROBE_DIR = DOCS / "benchmarks" / "probes"
#: Every probe; ``_shared.py`` holds what they share, and is no probe.
PROBES = sorted(p for p in PROBE_DIR.glob("*.py") if not p.name.startswith("_"))


def _probe_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"probe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(PROBE_DIR))  # as when run as a script: ``from _shared import ...``
    try:
        spec.loader.exec_module(module)  # imports only: a probe runs from main()
    finally:
        sys.path.remove(str(PROBE_DIR))
    return module


@pytest.mark.parametrize("path", PROBES, ids=lambda p: p.name)
def test_a_benchmark_probe_imports_and_builds_its_kernels(path):
    module = _probe_module(path)
    assert callable(module.main)
    for flags in module.VARIANTS.values():
        assert module.build(*flags) is not None


def test_the_r64_traffic_probe_stores_its_tiles_rows_of_its_column_group():
    """One block (tile 0, column group 0) of the probe in the kernel's pattern changes the
    first word of each 16-byte piece of its 16 token rows in the group's 64 columns (words
    0-15 of a row), and nothing else. On the GPU only: Numba's simulator has no
    ``cuda.syncwarp``, which the probe's kernels call."""
    import torch

    from punica_numba._cuda import SIMULATOR, device_of, kernel_array

    if SIMULATOR:
        pytest.skip("the probe's kernels call cuda.syncwarp, which the simulator lacks")

    module = _probe_module(PROBE_DIR / "r64_expand_traffic.py")
    device = device_of()
    gen = torch.Generator().manual_seed(3)
    bw = torch.randint(-(2**62), 2**62, (module.TILES, 4096, 16), generator=gen).to(device)
    out = torch.randint(-(2**62), 2**62, (256, 1024), generator=gen).to(device)
    tile_rows = torch.randperm(256, generator=gen).reshape(module.TILES, 16).to(torch.int32)
    slots = torch.arange(module.TILES, dtype=torch.int32)
    sink = torch.zeros(1, dtype=torch.int64)
    before = out.clone()
    args = [bw, out, tile_rows.to(device), slots.to(device), sink.to(device)]
    module.build(*module.VARIANTS["kernel_b_kernel_out_table"])[(1, 1, 1), 32](
        *[kernel_array(a) for a in args], 0
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    changed = (out != before).cpu()
    want = torch.zeros_like(changed)
    want[tile_rows[0].long().unsqueeze(1), torch.arange(0, 16, 2)] = True
    assert torch.equal(changed, want)
