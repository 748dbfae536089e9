# Stride: `make train` runs the default job, `make test` the whole suite. Both set up .venv themselves.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEFAULT_CONFIG := trainers/configs/char_gpt.yaml
CONFIG ?= $(DEFAULT_CONFIG)
# Where prepared data sets live (the default job's data: $(DATA)/pystdlib).
DATA ?= data
STAMP := $(VENV)/.stride-installed
# The default job reads $(DATA)/pystdlib: its YAML names data/pystdlib, so another DATA is passed as overrides.
DATA_ARGS := $(if $(filter $(DEFAULT_CONFIG),$(CONFIG)),$(if $(filter data,$(DATA)),,data.train_path=$(DATA)/pystdlib/train data.val_path=$(DATA)/pystdlib/val))

.PHONY: venv train test test-fast test-system data bench docs clean help

help:
	@echo "make train   - set up .venv, prepare data/pystdlib, train $(CONFIG) on an embedded local Ray"
	@echo "make test    - set up .venv and test services, run the whole test suite"
	@echo "make test-fast - the tier without Ray, torchrun, servers or SLURM (about 2 minutes)"
	@echo "make test-system - the 500-step default job's quality (make train's full run, about 5 minutes)"
	@echo "make bench   - side-by-side benchmarks (benchmarks/run.py --quick)"

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. GPU users install their CUDA torch
# into .venv first (see README); `pip install torch==...` is then a no-op if the versions match.
$(STAMP): setup.cfg
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

venv: $(STAMP)

$(DATA)/pystdlib/train:
	$(PY) datasets/prepare.py pystdlib --out $(DATA)/pystdlib

$(DATA)/tabular/train:
	$(PY) datasets/prepare.py tabular --out $(DATA)/tabular

data: $(STAMP) $(DATA)/pystdlib/train $(DATA)/tabular/train

train: $(STAMP) $(DATA)/pystdlib/train
	$(PY) trainers/main.py --config $(CONFIG) $(DATA_ARGS) $(ARGS)
	@echo "Sample:  $(VENV)/bin/stride generate --run runs/char_gpt --prompt 'def ' --tokens 200"

# pytest's own script, not `python -m pytest`: that would put the checkout on sys.path, and its datasets/ would
# hide Hugging Face `datasets` (Stride is imported as the installed `stride` package).
# It ends with the 25 slowest tests and the suite's wall time and CPU-seconds (tests/conftest.py). The tests write
# nothing into the checkout: no bytecode caches (every process they start inherits the setting), no .pytest_cache.
TEST_ENV := PYTHONDONTWRITEBYTECODE=1
PYTEST := $(TEST_ENV) $(VENV)/bin/pytest -p no:cacheprovider
# Two streams (tests/conftest.py): the tests on the shared Ray head beside every other slow test; the fast tier fills
# in. PYTEST_ARGS="-n 0" runs one stream (longer) and adds the table of the 25 costliest tests.
test: $(STAMP)
	bash tests/setup_services.sh
	$(PYTEST) -n 2 --dist loadgroup -m "not system" $(PYTEST_ARGS)

# The tier to run while you work: no Ray, no torchrun, no servers, no SLURM.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not system" $(PYTEST_ARGS)

# The default job's 500 steps and the quality they reach (make test runs make train on a short run only).
test-system: $(STAMP)
	$(PYTEST) -m system $(PYTEST_ARGS)

# docs/configuration.md is generated from the config's field descriptions (a test fails when it is stale).
docs: $(STAMP)
	$(PY) -m stride.trainers.config_reader > docs/configuration.md

bench: $(STAMP)
	$(PY) benchmarks/run.py --quick

clean:
	rm -rf runs build *.egg-info
