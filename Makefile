# Stride: `make train` runs the default job, `make test` the whole suite. Both set up .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
CONFIG ?= trainers/configs/char_gpt.yaml
STAMP := $(VENV)/.stride-installed

.PHONY: venv train test test-fast data bench docs clean help

help:
	@echo "make train   - set up .venv, prepare data/pystdlib, train $(CONFIG) on an embedded local Ray"
	@echo "make test    - set up .venv and test services, run the whole test suite"
	@echo "make test-fast - the tier without Ray, servers or SLURM (minutes)"
	@echo "make bench   - side-by-side benchmarks (benchmarks/run.py --quick)"

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. GPU users install their CUDA torch
# into .venv first (see README); `pip install torch==...` is then a no-op if the versions match.
$(STAMP): setup.cfg
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

venv: $(STAMP)

data/pystdlib/train:
	$(PY) datasets/prepare.py pystdlib --out data/pystdlib

data/tabular/train:
	$(PY) datasets/prepare.py tabular --out data/tabular

data: $(STAMP) data/pystdlib/train data/tabular/train

train: $(STAMP) data/pystdlib/train
	$(PY) trainers/main.py --config $(CONFIG) $(ARGS)
	@echo "Sample:  $(PY) trainers/generate.py --run runs/char_gpt --prompt 'def ' --tokens 200"

# pytest's own script, not `python -m pytest`: that would put the checkout on sys.path, and its datasets/ would
# hide Hugging Face `datasets` (Stride is imported as the installed `stride` package).
test: $(STAMP)
	bash tests/setup_services.sh
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The tier to run while you work: no Ray, no servers, no SLURM (a few minutes).
test-fast: $(STAMP)
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

# docs/configuration.md is generated from the config's field descriptions (a test fails when it is stale).
docs: $(STAMP)
	$(PY) -m stride.trainers.config > docs/configuration.md

bench: $(STAMP) data
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf runs build *.egg-info
