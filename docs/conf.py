"""Sphinx configuration for the punica-numba documentation site.

The site is built from three sources:

* the Markdown pages in this folder (MyST);
* the notebooks in ``../notebooks``, rendered from their **stored outputs** (they are
  never executed here). They are copied into ``_generated/notebooks`` every time
  this file is read, so ``notebooks/`` stays the one place they live;
* the library's docstrings (autodoc + napoleon, Google style).

The benchmark page shows ``benchmarks/h200.json`` as a table, which this file also
writes into ``_generated`` (or a note that the benchmark has not been run yet).

Build it with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
GENERATED = DOCS / "_generated"
sys.path.insert(0, str(ROOT))  # autodoc imports punica_numba from this checkout

# The version, read from pyproject.toml (tomllib is not in Python 3.10's standard library).
_VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)

project = "punica-numba"
author = "the punica-numba authors"
copyright = "2026, the punica-numba authors"
release = version = _VERSION[1] if _VERSION else "unknown"

extensions = [
    "myst_nb",  # Markdown pages and notebooks (it brings myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# -- sources -------------------------------------------------------------------------------

exclude_patterns = [
    "_build",
    "_generated/*.md",  # included by other pages, not pages of their own
    "benchmarks/README.md",  # notes kept beside the data files; shown via _generated
    "**.ipynb_checkpoints",
]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Notebooks are shown with the outputs stored in them (from a GPU run); nothing runs here.
nb_execution_mode = "off"
nb_merge_streams = True

# -- the API reference -----------------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, so dataclass fields are not doubled


def _semantics_as_code(app, what, name, obj, options, lines) -> None:
    """Show each ``Semantics:`` block of a docstring verbatim, as a literal block.

    The project's docstrings carry pseudo-code with shapes under a ``Semantics:`` line
    (see STYLE.md); read as reStructuredText, its indentation would be taken for block
    quotes. ``Semantics::`` plus a blank line makes the indented block literal. Runs
    before napoleon, which leaves a ``Name::`` line alone.
    """
    out: list[str] = []
    block_indent: int | None = None  # indentation of the current Semantics header
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if block_indent is not None and line.strip() and indent <= block_indent:
            if out and out[-1].strip():
                out.append("")  # a literal block must end with a blank line
            block_indent = None
        if line.strip() == "Semantics:":
            out += [line.rstrip() + ":", ""]
            block_indent = indent
            continue
        out.append(line)
    lines[:] = out


#: Module-level constants that ``punica_numba`` re-exports -> the module that defines
#: them. Their ``#:`` doc comment lives there; autodoc, documenting the re-exported
#: name, would otherwise show the docstring of the value's type (``bool``).
REEXPORTED_DATA = {"punica_numba.SIMULATOR": "punica_numba._cuda"}


def _reexported_data_doc(app, what, name, obj, options, lines) -> None:
    if what != "data" or name not in REEXPORTED_DATA:
        return
    from sphinx.pycode import ModuleAnalyzer

    attr_docs = ModuleAnalyzer.for_module(REEXPORTED_DATA[name]).find_attr_docs()
    lines[:] = list(attr_docs[("", name.rsplit(".", 1)[1])])


def setup(app):
    app.connect("autodoc-process-docstring", _semantics_as_code, priority=100)
    app.connect("autodoc-process-docstring", _reexported_data_doc)


# -- HTML ----------------------------------------------------------------------------------

html_theme = "sphinx_book_theme"
html_title = "punica-numba"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
}


# -- generated pages -----------------------------------------------------------------------


def _copy_notebooks() -> None:
    """Mirror ``../notebooks/*.ipynb`` into ``_generated/notebooks`` (only what changed)."""
    target = GENERATED / "notebooks"
    target.mkdir(parents=True, exist_ok=True)
    sources = {p.name: p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    for stale in target.glob("*.ipynb"):
        if stale.name not in sources:
            stale.unlink()
    for name, source in sources.items():
        copy = target / name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copy2(source, copy)


def _benchmark_results() -> str:
    """Markdown for the benchmark page: the stored results, or a note that there are none."""
    results_path = DOCS / "benchmarks" / "h200.json"
    if not results_path.exists():
        return (
            "```{note}\nThe benchmark has not been run yet. On a machine with a GPU, run\n"
            "`python -m punica_numba bench --json docs/benchmarks/h200.json "
            "--plot docs/benchmarks/roofline.png` and rebuild the documentation.\n```\n"
        )
    results = json.loads(results_path.read_text())
    bandwidth = float(results["copy_bandwidth_tbps"])
    lines = [
        f"Measured on **{results['gpu']}** at commit `{results['commit']}`; copy bandwidth "
        f"measured at {bandwidth:.2f} TB/s. Times are device microseconds per call (median "
        "of CUDA-graph replays). *Floor* is the fewest bytes the op must move divided by "
        "the copy bandwidth; *of BW* is floor / time.",
        "",
        "| op | T | adapters | LoRAs | slices | rank | dtype | µs | floor µs | of BW "
        "| vLLM µs | torch gather+bmm µs |",
        "| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in results["cases"]:
        floor = case["bytes"] / (bandwidth * 1e6) if bandwidth else float("nan")
        vllm = case.get("vllm_us")
        slices = "/".join(str(w) for w in case.get("slices", [])) or str(case.get("hidden", ""))
        lines.append(
            f"| {case['op']} | {case['T']} | {case['lora_mode']} | {case.get('num_loras', '')} "
            f"| {slices} | {case['rank']} | {case['dtype']} | {case['us']:.1f} | {floor:.2f} "
            f"| {floor / case['us']:.0%} | {f'{vllm:.1f}' if vllm else ''} "
            f"| {case['torch_gather_bmm_us']:.1f} |"
        )
    overhead = results.get("host_overhead_us") or {}
    if overhead:
        lines += ["", "Host time of one eager call (µs, no CUDA graph):", ""]
        lines += ["| call | µs |", "| --- | ---: |"]
        lines += [f"| `{name}` | {value} |" for name, value in overhead.items()]
    if (DOCS / "benchmarks" / "roofline.png").exists():
        lines += [
            "",
            "```{figure} /benchmarks/roofline.png",
            ":alt: achieved bandwidth per case against the copy bandwidth",
            "",
            "Achieved bandwidth (fewest bytes / device time) per case, with vLLM's figures "
            "where the project's performance issue gives them.",
            "```",
        ]
    notes = DOCS / "benchmarks" / "README.md"
    if notes.exists() and "## Kernel versions" in notes.read_text():
        history = notes.read_text().split("## Kernel versions", 1)[1]
        lines += ["", "## Kernel versions", history.split("\n## ", 1)[0].rstrip()]
    return "\n".join(lines) + "\n"


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


GENERATED.mkdir(exist_ok=True)
_copy_notebooks()
_write_if_changed(GENERATED / "benchmark_results.md", _benchmark_results())
