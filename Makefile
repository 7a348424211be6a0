# The two set-up commands of the README. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test

demo: $(STAMP)
	$(BIN)/python -m lmuscale.sweep sweeps/demo.py

# Two pytest workers, each taking whole test files (module fixtures are built once): many
# tests wait on subprocesses or compile on one core, so two workers overlap them.
# scripts/slurm/install.sh installs slurm-wlm and munge (as root, with apt-get) for the SLURM
# tests; where it cannot, it says so and those tests skip. The 15 slowest tests are listed
# at the end, to keep the suite within CI's time budget.
test: $(STAMP)
	bash scripts/slurm/install.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "lmuscale needs Python >= 3.11: run with PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)
