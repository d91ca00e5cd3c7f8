"""pyproject.toml and environment.yml must describe the same environment.

pip users install from pyproject.toml, conda users from environment.yml. These
tests read both files and check that they name the same packages (runtime
dependencies plus every extra) with the same version bounds, so that a package
added to, or re-pinned in, only one of them fails here instead of on somebody's
machine. Names are compared after normalisation: lower case, runs of ``-_.``
become ``-``, and conda's ``pytorch`` is pip's ``torch``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
ENVIRONMENT = ROOT / "environment.yml"

#: conda name -> pip name, for packages that the two ecosystems name differently.
CONDA_TO_PIP = {"pytorch": "torch"}
#: conda entries that are tooling, not project dependencies.
CONDA_ONLY = {"python", "pip"}

Specs = dict[str, frozenset[str]]  # normalised name -> set of version clauses


# --------------------------------------------------------------------------- #
# Normalisation
# --------------------------------------------------------------------------- #
def normalise_name(name: str) -> str:
    """``Sphinx_Book.Theme`` -> ``sphinx-book-theme``; ``pytorch`` -> ``torch``."""
    name = re.sub(r"[-_.]+", "-", name.strip().lower())
    return CONDA_TO_PIP.get(name, name)


def normalise_spec(spec: str) -> frozenset[str]:
    """``">=0.66, <0.69"`` -> ``{">=0.66", "<0.69"}`` (order and spaces do not matter)."""
    return frozenset(c.replace(" ", "") for c in spec.split(",") if c.strip())


_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def split_requirement(text: str) -> tuple[str, frozenset[str]]:
    """Split ``"numba>=0.66,<0.69"`` or conda's ``"numba >=0.66,<0.69"`` into name and spec."""
    text = text.split(";", 1)[0].strip()  # drop any environment marker
    match = _REQUIREMENT.match(text)
    if match is None:
        raise ValueError(f"cannot read requirement {text!r}")
    return normalise_name(match[1]), normalise_spec(match[2])


# --------------------------------------------------------------------------- #
# Reading the two files
# --------------------------------------------------------------------------- #
def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line)


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_environment_yml(text: str) -> dict:
    """Read the small subset of YAML that environment.yml uses.

    Top-level ``key: value`` pairs, top-level ``key:`` followed by ``- item``
    lines, and list items of the form ``- pip:`` that hold a nested list
    (returned as ``{"pip": [...]}``). Anything else raises ``ValueError``, so a
    change of format shows up here rather than as a silently wrong answer.
    """
    doc: dict = {}
    key = None  # top-level key whose list we are filling
    nested = None  # list under a "- name:" item, e.g. "- pip:"
    item_indent = -1  # indentation of the current top-level list's items
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw).rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        body = line.strip()
        if indent == 0:
            name, colon, value = body.partition(":")
            if not colon:
                raise ValueError(f"environment.yml:{lineno}: expected 'key:' in {raw!r}")
            key, nested = name.strip(), None
            if value.strip():
                doc[key], key = _unquote(value.strip()), None
            else:
                doc[key] = []
            continue
        if key is None or not body.startswith("- "):
            raise ValueError(f"environment.yml:{lineno}: expected a '- item' line: {raw!r}")
        value = body[2:].strip()
        if nested is not None and indent > item_indent:
            nested.append(_unquote(value))
        elif value.endswith(":"):
            item_indent, nested = indent, []
            doc[key].append({value[:-1].strip(): nested})
        else:
            item_indent, nested = indent, None
            doc[key].append(_unquote(value))
    return doc


def pyproject_groups(pyproject: dict) -> dict[str, Specs]:
    """``{"runtime": {...}, "test": {...}, ...}`` from a parsed pyproject.toml."""
    project = pyproject["project"]
    groups = {"runtime": project.get("dependencies", [])}
    groups.update(project.get("optional-dependencies", {}))
    return {group: dict(map(split_requirement, reqs)) for group, reqs in groups.items()}


def conda_packages(env: dict) -> Specs:
    """Every conda package in environment.yml except python, pip and the pip section."""
    specs: Specs = {}
    for item in env["dependencies"]:
        if isinstance(item, str):
            name, spec = split_requirement(item)
            if name not in CONDA_ONLY:
                specs[name] = spec
    return specs


def pip_section(env: dict) -> list[str]:
    for item in env["dependencies"]:
        if isinstance(item, dict) and "pip" in item:
            return item["pip"]
    return []


# --------------------------------------------------------------------------- #
# Comparisons (pure functions, so the tests below can also check the checks)
# --------------------------------------------------------------------------- #
def name_mismatches(groups: dict[str, Specs], conda: Specs) -> list[str]:
    """Packages that only one of the two files names."""
    pip_names = set().union(*groups.values())
    problems = [
        f"{n}: in pyproject.toml, missing from environment.yml" for n in pip_names - set(conda)
    ]
    problems += [
        f"{n}: in environment.yml, missing from pyproject.toml" for n in set(conda) - pip_names
    ]
    return sorted(problems)


def spec_mismatches(groups: dict[str, Specs], conda: Specs) -> list[str]:
    """Packages whose version bounds differ between the two files (or between extras)."""
    problems = []
    for name in sorted(set().union(*groups.values()) & set(conda)):
        pip_specs = {group: specs[name] for group, specs in groups.items() if name in specs}
        for group, spec in pip_specs.items():
            if spec != conda[name]:
                problems.append(
                    f"{name}: pyproject.toml [{group}] says {','.join(sorted(spec)) or 'any'}, "
                    f"environment.yml says {','.join(sorted(conda[name])) or 'any'}"
                )
    return problems


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def env() -> dict:
    return parse_environment_yml(ENVIRONMENT.read_text(encoding="utf-8"))


def test_environment_header(env):
    assert env["name"] == "punica-numba"
    assert env["channels"] == ["conda-forge", "nodefaults"]


def test_both_files_name_the_same_packages(pyproject, env):
    problems = name_mismatches(pyproject_groups(pyproject), conda_packages(env))
    assert problems == [], "\n".join(problems)


def test_runtime_pins_agree(pyproject, env):
    groups = pyproject_groups(pyproject)
    runtime = {"runtime": groups["runtime"]}
    conda = conda_packages(env)
    missing = sorted(set(groups["runtime"]) - set(conda))
    assert missing == [], f"runtime dependencies missing from environment.yml: {missing}"
    problems = spec_mismatches(runtime, conda)
    assert problems == [], "\n".join(problems)


def test_extra_bounds_agree(pyproject, env):
    problems = spec_mismatches(pyproject_groups(pyproject), conda_packages(env))
    assert problems == [], "\n".join(problems)


def test_python_version_agrees(pyproject, env):
    conda_python = [
        split_requirement(item)[1]
        for item in env["dependencies"]
        if isinstance(item, str) and split_requirement(item)[0] == "python"
    ]
    assert conda_python == [normalise_spec(pyproject["project"]["requires-python"])]


def test_pip_section_installs_the_project_with_every_extra(pyproject, env):
    editable = [line for line in pip_section(env) if line.startswith("-e ")]
    assert len(editable) == 1, f"expected one '-e .[...]' line, got {pip_section(env)}"
    match = re.fullmatch(r"-e\s+\.\[([^\]]*)\]", editable[0])
    assert match, f"expected '-e .[extra,...]', got {editable[0]!r}"
    extras = {normalise_name(e) for e in match[1].split(",") if e.strip()}
    assert extras == set(pyproject["project"]["optional-dependencies"])


# The comparisons must be able to fail: feed them deliberately broken copies.
def _broken_copy(env_text: str, old: str, new: str) -> dict:
    assert old in env_text, f"test setup: {old!r} not found in environment.yml"
    return parse_environment_yml(env_text.replace(old, new, 1))


def test_a_package_in_one_file_only_is_caught(pyproject):
    text = ENVIRONMENT.read_text(encoding="utf-8")
    extra = _broken_copy(text, "  - safetensors", "  - rich\n  - safetensors")
    assert name_mismatches(pyproject_groups(pyproject), conda_packages(extra)) == [
        "rich: in environment.yml, missing from pyproject.toml"
    ]
    missing = _broken_copy(text, "  - safetensors", "  # - safetensors")
    assert name_mismatches(pyproject_groups(pyproject), conda_packages(missing)) == [
        "safetensors: in pyproject.toml, missing from environment.yml"
    ]


def test_a_changed_pin_is_caught(pyproject):
    text = ENVIRONMENT.read_text(encoding="utf-8")
    loose = _broken_copy(text, "pytorch >=2.4,<2.14", "pytorch >=2.4")
    problems = spec_mismatches(pyproject_groups(pyproject), conda_packages(loose))
    assert len(problems) == 1 and problems[0].startswith("torch: ")


def test_parser_reads_the_formats_we_use():
    text = (
        "name: x  # comment\n"
        "channels:\n  - a\n"
        "dependencies:\n  - 'q >=1'\n  - pip:\n      - -e .[t]\n"
    )
    assert parse_environment_yml(text) == {
        "name": "x",
        "channels": ["a"],
        "dependencies": ["q >=1", {"pip": ["-e .[t]"]}],
    }
    with pytest.raises(ValueError):
        parse_environment_yml("dependencies:\n  numpy\n")


def test_the_wheel_ships_the_tuner_and_its_tables(tmp_path):
    """The wheel holds every file under the package (hatchling's default): the tuner, the
    folder of tuned tables and every table in it, which the launcher reads at run time."""
    pytest.importorskip("hatchling")
    import subprocess
    import zipfile

    command = [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {"punica_numba/configs/README.md", "punica_numba/tuning/table.py"}
    wanted |= {f"punica_numba/configs/{t.name}" for t in (ROOT / "punica_numba/configs").glob("*")}
    assert wanted <= names, sorted(wanted - names)
