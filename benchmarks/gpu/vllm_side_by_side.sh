#!/usr/bin/env bash
# Optional, after check.sh: the same offline-64 workload on vLLM's GPU build and on aiolm,
# one after the other on this GPU, and their ratio. Needs network access to PyPI for vLLM.
#
#   benchmarks/gpu/vllm_side_by_side.sh        (VENV: aiolm's environment, default .venv-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-gpu}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
TIMEOUT=${PART_TIMEOUT:-900}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi is not installed" >&2
    exit 2
fi
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    python3 -m venv "$VLLM_VENV" && "$VLLM_VENV/bin/pip" install -q vllm || {
        echo "skipped: vLLM could not be installed here"; exit 3; }
fi
# vLLM reads a Hugging Face folder: aiolm's converted copy of the embedded GGUF is one.
MODEL_DIR=$("$VENV/bin/python" -c "from aiolm.checkpoint.source import resolve_model; print(resolve_model(None).path)")
vllm=$(timeout "$TIMEOUT" "$VLLM_VENV/bin/python" benchmarks/peers/run_vllm.py "$MODEL_DIR" --dtype bfloat16 \
       --repeats 3 | tail -n 1)
aiolm=$(timeout "$TIMEOUT" "$VENV/bin/python" -m aiolm.cli bench throughput --device cuda --dtype bfloat16 \
        --attention-backend triton --repeats 3 --json | tail -n 1)
echo "vllm:  $vllm"
echo "aiolm: $aiolm"
"$VENV/bin/python" - "$vllm" "$aiolm" <<'PY'
import json, sys
v = json.loads(sys.argv[1].removeprefix("RESULT "))["output_tok_s"]
a = json.loads(sys.argv[2])["output_tok_s"]
print(f"offline-64 bfloat16: aiolm {a:.1f} tok/s, vllm {v:.1f} tok/s, ratio {a / v:.2f}x")
PY
