"""The documentation: the site builds without a warning, and what it shows is current.

* ``sphinx-build -W`` builds the site (API reference from the docstrings, the
  notebooks from their stored outputs, the benchmark page) into a temporary folder;
* every notebook is a jupytext ``py:percent`` file paired with an ``.ipynb`` whose
  cells say the same, and opens with a title and "You will learn" bullets;
* the example on the "Testing your own kernels" page runs and passes.
"""

from __future__ import annotations

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
    exec(compile("\n".join(blocks), str(DOCS / "testing.md"), "exec"), namespace)
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    assert len(tests) == 2, "the example should define a shrink test and an expand test"
    try:
        for test in tests:
            test()  # hypothesis runs its examples here
    finally:
        tolerance.LARGEST_ERRORS.clear()
        tolerance.LARGEST_ERRORS.update(saved)
