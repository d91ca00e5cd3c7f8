# punica-numba developer commands. `make` alone lists them.
# Everything runs inside .venv, created from pyproject.toml on first use.

PYTHON ?= python3
# Worker processes for the test suite and the notebooks (pytest-xdist). On the simulator
# every CUDA thread is a Python thread, so each worker keeps one CPU busy; 2 fits CI's
# machine.
WORKERS ?= 2
VENV   := .venv
STAMP  := $(VENV)/.stamp
BIN    := $(VENV)/bin

.DEFAULT_GOAL := help
.PHONY: help venv test demo docs notebooks lint clean distclean

help:
	@echo "punica-numba make targets:"
	@echo "  make venv       create or reuse .venv and install the project with its test extra"
	@echo "  make test       ruff, the pytest + hypothesis suite (HYPOTHESIS_PROFILE, default ci;"
	@echo "                  it builds the docs too), then every notebook under nbmake"
	@echo "  make demo       run the demo (python -m punica_numba demo)"
	@echo "  make docs       build the documentation site into docs/_build/html (warnings are errors)"
	@echo "  make notebooks  sync each notebooks/*.py with its .ipynb, then re-execute the .ipynb"
	@echo "                  in place so that it stores fresh outputs (GPU outputs on a GPU)"
	@echo "  make lint       ruff check only"
	@echo "  make clean      remove caches and build output (keeps .venv)"
	@echo "  make distclean  clean, and remove .venv too"
	@echo "Variables: PYTHON=$(PYTHON) (interpreter that creates .venv, Python >= 3.10),"
	@echo "           WORKERS=$(WORKERS) (processes the tests and notebooks are spread over; 0: none)"

venv: $(STAMP)

# Re-install only when pyproject.toml is newer than the stamp.
$(STAMP): pyproject.toml
	@if [ ! -x $(BIN)/python ]; then \
		echo "creating $(VENV) with $(PYTHON)"; \
		$(PYTHON) -m venv $(VENV) || { \
			echo "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu the venv module" \
			     "lives in the python3-venv package; or pass PYTHON=/path/to/python3.1x." >&2; \
			rm -rf $(VENV); exit 1; }; \
	fi
	$(BIN)/python -m pip install --no-compile -e '.[test]'
	@# pip writes each module's bytecode one file at a time (about 45 s of a fresh CI run);
	@# compileall shares that over every core. (Some packages ship files of Python 2
	@# syntax that neither can compile: its status is ignored, as pip ignores them.)
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	@touch $(STAMP)

test: venv
	$(BIN)/ruff check .
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest -n $(WORKERS)
	$(BIN)/python -m pytest --nbmake -n $(WORKERS) notebooks/

# The notebooks are jupytext py:percent files (what you edit) paired with .ipynb copies
# (what readers and the docs see, with stored outputs); notebooks/jupytext.toml pairs them.
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.py))

# `jupytext --sync` carries the newer side of each pair to the other (keeping outputs);
# executing rewrites the .ipynb, and the second sync records that the pair agrees.
notebooks: venv
	$(BIN)/jupytext --sync $(NOTEBOOKS)
	$(BIN)/jupyter execute --inplace --timeout=600 $(NOTEBOOKS:.py=.ipynb)
	$(BIN)/jupytext --sync $(NOTEBOOKS)

docs: venv
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html
	@echo "open docs/_build/html/index.html"

demo: venv
	$(BIN)/python -m punica_numba demo

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build dist docs/_build docs/_generated *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -name .ipynb_checkpoints -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
