# Two user-facing targets: `make demo` and `make test` (and `make demo-tier2 ARGS=...` after
# `make test`: the demo against megatron-core 0.19.2; `make demo-bridge ARGS=--export-peft`: its PEFT
# export through the real Megatron-Bridge 0.6.2; `make demo-miles`: the Miles demo through the real
# miles-rl wheel; `make docs`: the documentation site into site/).
# Everything else is plumbing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TIER2  := .tier2/mcore019
TIER3  := .tier3/bridge
TIERMILES := .tier-miles/miles-rl-0.0.2
PYTEST_ARGS ?=
ARGS ?=

.PHONY: demo demo-tier2 demo-bridge demo-miles test test-long lint docs tier1 tier2 tier-bridge tier-miles install clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The plugin, then the harness (harness/: its own distribution, miles-lora-ckpt-harness, which `demo`,
# `bench` and the tests need), both editable.
$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml harness/pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q -e ./harness
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

# Bridge tier: the real Megatron-Bridge 0.6.2 (pure Python; declares Python>=3.12, runs on 3.11 with
# the three shims of the harness's sim/bridge_shims.py) on top of the 0.19.2 tier (it does not import with 0.16).
# Bridge pins transformers<=5.12.1 (5.24 lacks transformers.modeling_attn_mask_utils), so that
# transformers and its hub/tokenizer pins live in this folder too, first on PYTHONPATH for this tier only.
$(TIER3)/.installed: $(TIER2)/.emerging-optimizers
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(TIER3) megatron-bridge==0.6.2 \
		transformers==5.12.1 'huggingface-hub>=1.5,<2' tokenizers==0.22.2 httpx httpcore certifi sniffio omegaconf einops
	touch $@

# Real Miles: the `miles-rl` wheel (radixark Miles, pure Python) without its dependencies, in its own
# folder, put on PYTHONPATH only for the real-Miles test run (marker `realmiles`). What it imports that
# cannot be installed here is stood in by harness/miles_lora_ckpt_harness/realmiles/standins.py, inside the harness only.
$(TIERMILES)/.installed: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --target $(TIERMILES) miles-rl==0.0.2 six==1.17.0 pybase64==1.5.1 'triton==3.7.*'
	touch $@

# The wheel's own argument parsing imports SGLang's server-argument tree, whose model configs need the
# real pillow (image-processor registration) and dill at import time (the harness's realmiles/wheel_args.py).
$(TIERMILES)/.argparse: $(TIERMILES)/.installed
	$(BIN)/pip install -q --no-deps --target $(TIERMILES) pillow==13.0.0 dill==0.4.1
	touch $@

# Megatron-LM (and so the wheel's initialize.init) asserts numpy 1.x. The real-Miles test run puts
# numpy 1.26.4 first on PYTHONPATH (measured: torch 2.13, megatron-core 0.16.1 and transformers import
# and run with it), so init's assertion runs unchanged; the harness's realmiles/wheel_args.py: numpy_1_for_init.
TIERNUMPY1 := .tier-miles/numpy-1.26.4
$(TIERNUMPY1)/.installed: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --target $(TIERNUMPY1) numpy==1.26.4
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/miles-lora-ckpt demo

# The demo against megatron-core 0.19.2 (megatron's own Lion and Muon), e.g. ARGS="--optimizer muon".
demo-tier2: $(TIER2)/.emerging-optimizers
	MILES_LORA_CKPT_TIER=mcore-0.19 PYTHONPATH=$(CURDIR)/$(TIER2) $(BIN)/miles-lora-ckpt demo $(ARGS)

# The demo's PEFT export through the real Megatron-Bridge 0.6.2, e.g. ARGS="--export-peft".
demo-bridge: $(TIER3)/.installed
	MILES_LORA_CKPT_TIER=bridge PYTHONPATH=$(CURDIR)/$(TIER3):$(CURDIR)/$(TIER2) $(BIN)/miles-lora-ckpt demo $(ARGS)

# The demo through the real Miles wheel's modules, e.g. ARGS="--without-plugin".
demo-miles: $(TIERMILES)/.argparse
	MILES_LORA_CKPT_REAL_MILES=$(CURDIR)/$(TIERMILES) $(BIN)/miles-lora-ckpt demo --via miles --miles-shape miles-rl-0.0.2 $(ARGS)

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

# Only the tests marked `bridge` (the real Megatron-Bridge; they fail rather than skip in this tier).
tier-bridge: $(TIER3)/.installed
	MILES_LORA_CKPT_TIER=bridge PYTHONPATH=$(CURDIR)/$(TIER3):$(CURDIR)/$(TIER2) $(BIN)/python -m pytest -q -m bridge $(PYTEST_ARGS)

# Only the tests marked `realmiles` (the real miles-rl 0.0.2 wheel; the harness's realmiles/standins.py lists what is stood in).
tier-miles: $(TIERMILES)/.argparse $(TIERNUMPY1)/.installed
	MILES_LORA_CKPT_REAL_MILES=$(CURDIR)/$(TIERMILES) PYTHONPATH=$(CURDIR)/$(TIERNUMPY1) $(BIN)/python -m pytest -q -m realmiles $(PYTEST_ARGS)

test: lint tier1 tier2 tier-bridge tier-miles

# The long fuzz runs (tens of thousands of examples); not part of `make test`.
test-long: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m long --long $(PYTEST_ARGS)

# The GPU path (docs/testing.md#the-gpu-check), a few minutes on one GPU: bit-exact save and load on
# CUDA with NCCL as the default group, the async save's pinned side-stream copy, a training step's
# stall against DCP's async_save. Without CUDA it skips in one line; ARGS="--device cpu": the dry run.
gpu-check: $(VENV)/.installed
	PYTHONPATH=$(CURDIR) $(BIN)/python -m miles_lora_ckpt_harness.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) .tier2 .tier3 .tier-miles build site *.egg-info .pytest_cache
