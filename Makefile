# Two user-facing targets: `make demo` and `make test` (and `make demo-tier2 ARGS=...` after
# `make test`: the demo against megatron-core 0.19.2; `make docs`: the documentation site into site/).
# Everything else is plumbing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TIER2  := .tier2/mcore019
PYTEST_ARGS ?=
ARGS ?=

.PHONY: demo demo-tier2 test test-long lint docs tier1 tier2 install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Second megatron tier: megatron-core 0.19.2 declares Python>=3.12, but its wheel runs on 3.11.
# It lives in its own folder, put first on PYTHONPATH only for the tier-2 test run.
$(TIER2)/.installed: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(TIER2) megatron-core==0.19.2 'triton==3.7.*'
	touch $@

# megatron 0.19 builds its own Lion and Muon with emerging-optimizers, a pure-Python wheel that also
# declares Python>=3.12; on 3.11 the CPU harness gives it the typing.override it imports.
$(TIER2)/.emerging-optimizers: $(TIER2)/.installed
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(TIER2) emerging-optimizers==0.3.0 absl-py==2.5.1
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/miles-lora-ckpt demo

# The demo against megatron-core 0.19.2 (megatron's own Lion and Muon), e.g. ARGS="--optimizer muon".
demo-tier2: $(TIER2)/.emerging-optimizers
	MILES_LORA_CKPT_TIER=mcore-0.19 PYTHONPATH=$(CURDIR)/$(TIER2) $(BIN)/miles-lora-ckpt demo $(ARGS)

# lint includes the documentation site: a broken link, an unknown anchor or a page missing from the
# nav fails `mkdocs build --strict` (mkdocs.yml; tests/test_docs.py checks the same and more). Never add
# --quiet: it drops the warnings that --strict counts, and a broken link would pass.
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mkdocs build --strict --site-dir $(CURDIR)/site

# The documentation site (docs/, mkdocs.yml) into site/.
docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict --site-dir $(CURDIR)/site

tier1: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

tier2: $(TIER2)/.emerging-optimizers
	MILES_LORA_CKPT_TIER=mcore-0.19 PYTHONPATH=$(CURDIR)/$(TIER2) $(BIN)/python -m pytest -q -m megatron $(PYTEST_ARGS)

test: lint tier1 tier2

# The long fuzz runs (tens of thousands of examples); not part of `make test`.
test-long: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m long --long $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .tier2 build site *.egg-info .pytest_cache
