"""The README is the front door: its examples run, and it stays short.

* every ```` ```python ```` fenced block of ``README.md`` is executed, **each block on its
  own** in a fresh namespace (each is a complete example a reader may copy alone), on
  whatever the package runs on (Numba's CUDA simulator on a machine without a GPU). A
  block that raises, an ``assert`` in it that fails included, fails its test; the
  traceback points at the README's own line numbers;
* ``README.md`` is at most :data:`MAX_BYTES` bytes (what ``wc -c`` counts).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: The README's budget, in bytes as ``wc -c README.md`` counts them.
MAX_BYTES = 8_000
#: The fewest Python examples the README should show (the wrapper and the two ops).
MIN_BLOCKS = 2


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```` ```python ```` block, in order (1-based)."""
    blocks = []
    for match in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.S | re.M):
        first_line = text.count("\n", 0, match.start(1)) + 1
        blocks.append((first_line, match.group(1)))
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_shows_python_examples():
    assert len(BLOCKS) >= MIN_BLOCKS, (
        f"README.md shows {len(BLOCKS)} ```python blocks; the usage examples are missing"
    )


@pytest.mark.parametrize(
    "first_line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS]
)
def test_a_readme_example_runs(first_line, code):
    # Blank lines ahead of the code keep its line numbers the README's in a traceback.
    source = "\n" * (first_line - 1) + code
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(source, str(README), "exec"), namespace)


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_BYTES, f"README.md is {size} bytes, over its budget of {MAX_BYTES}"


def test_python_blocks_finds_each_block_and_its_line():
    """The extractor itself: two blocks, other fences ignored, line numbers 1-based."""
    text = "# t\n```python\na = 1\n```\n\n```\nnot python\n```\n```python\nb = 2\nc = 3\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n"), (10, "b = 2\nc = 3\n")]


def test_a_failing_block_fails():
    """What the example test does with a block that raises: the error reaches pytest."""
    [(line, code)] = python_blocks("x\n```python\nassert 1 + 1 == 3, 'wrong'\n```\n")
    with pytest.raises(AssertionError, match="wrong"):
        test_a_readme_example_runs(line, code)
