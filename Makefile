# punica-numba developer commands. `make` alone lists them.
# Everything runs inside .venv, created from pyproject.toml on first use.

PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.stamp
BIN    := $(VENV)/bin

.DEFAULT_GOAL := help
.PHONY: help venv test demo lint clean distclean

help:
	@echo "punica-numba make targets:"
	@echo "  make venv       create or reuse .venv and install the project with its test extra"
	@echo "  make test       ruff, then the pytest + hypothesis suite (HYPOTHESIS_PROFILE, default ci)"
	@echo "  make demo       run the demo (python -m punica_numba demo)"
	@echo "  make lint       ruff check only"
	@echo "  make clean      remove caches and build output (keeps .venv)"
	@echo "  make distclean  clean, and remove .venv too"
	@echo "Variables: PYTHON=$(PYTHON) (interpreter that creates .venv, Python >= 3.10)"

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
	$(BIN)/python -m pip install -e '.[test]'
	@touch $(STAMP)

test: venv
	$(BIN)/ruff check .
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(BIN)/python -m pytest

demo: venv
	$(BIN)/python -m punica_numba demo

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build dist docs/_build *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -name .ipynb_checkpoints -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
