#!/usr/bin/env bash
# The whole GPU check in one call of the lent machine (a call runs at most 10 minutes): the GPU suite, then
# bench_gpu.py one model at a time, each part under its own time limit so that a slow or failing part leaves
# the others' results. Everything it prints also goes to $OUT/gpu_check.log, and each
# model's figures to $OUT/bench_gpu_<model>.json.
#
#   make gpu-wheels                                   # here, with network: the wheels the machine lacks, in .whl/
#   bash benchmarks/gpu_check.sh                      # there: run with carry [".whl"]
#   TEST_SECONDS=120 BENCH_MODELS=qwen2.5-0.5b bash benchmarks/gpu_check.sh
#   PROFILE_MODELS=qwen2.5-0.5b bash benchmarks/gpu_check.sh   # and where each phase's device time goes
#   HOST_SECONDS=70 WEIGHTS_SECONDS=300 bash benchmarks/gpu_check.sh   # and bench_host.py, bench_weights.py on CUDA
#
# Without a GPU it runs too (the suite skips, the bench fails at once): a check of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
PY=${GPU_PY:-python3}
START=$(date +%s)
TOTAL_SECONDS=${TOTAL_SECONDS:-560}  # the whole call: the device tool stops a command at 600 s
TEST_SECONDS=${TEST_SECONDS:-240}  # the suite (0: not run); the benchmark gets the rest of the total
BENCH_MODELS=${BENCH_MODELS-qwen2.5-0.5b llama-3.2-1b smollm2-135m}  # the goals' shapes first; '' for none
BENCH_ARGS=${BENCH_ARGS:-}  # more flags for every model's bench_gpu.py, e.g. --skip-hf
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # an NCCL failure says why
GPU_TESTS=${GPU_TESTS:-tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_sampling.py tests/test_gpu.py}  # quick first
PROFILE_MODELS=${PROFILE_MODELS:-}  # e.g. qwen2.5-0.5b: profile_gpu.py's kernel tables before the benchmark
HOST_SECONDS=${HOST_SECONDS:-0}  # bench_host.py on CUDA (the host's phases a step, decode at 256); 0: not run
WEIGHTS_SECONDS=${WEIGHTS_SECONDS:-0}  # bench_weights.py, the engine on CUDA, the 1B shape (300: its setup takes 2 min); 0: not run
HOST_ARGS=${HOST_ARGS:-}  # more flags for bench_host.py ("--clock cpu": a phase's CPU time, not its wall clock)
WEIGHTS_ARGS=${WEIGHTS_ARGS:-}  # more flags for bench_weights.py ("--dp-backend thread": the loop a thread)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
stamp() { echo "== $(date -u +%T) $*"; }

stamp "setup"
if compgen -G ".whl/*.whl" >/dev/null; then  # gguf, pyzmq, grpcio and protobuf as new as the stubs, ...
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Into python3's own environment where it may write, else beside the wheels.
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . ||
    $PY -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
$PY - <<'EOF' || exit 1
import google.protobuf, grpc, tokenizers, torch, transformers
from tokenizers.decoders import DecodeStream
import lmgate.service.server  # every import the server needs
DecodeStream(ids=[0], skip_special_tokens=True)  # the detokenizer's prefilled stream (tokenizers 0.22 and newer)
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "none"
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, triton {triton_version}, transformers "
      f"{transformers.__version__}, tokenizers {tokenizers.__version__}, grpcio {grpc.__version__}, protobuf "
      f"{google.protobuf.__version__}")
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
EOF

if (( TEST_SECONDS > 0 )); then
    stamp "GPU suite (limit ${TEST_SECONDS} s)"
    # A line per test as it ends, and at the limit an interrupt (SIGINT), after which pytest still prints its
    # failures and summary; a test past 90 s dumps its threads' stacks. The engine test of test_triton_kernels
    # reads the embedded model's tokenizer, which is not on that machine.
    timeout -s INT -k 20 "$TEST_SECONDS" $PY -m pytest -v --tb=short -p no:cacheprovider --durations=15 \
        -o faulthandler_timeout=90 $GPU_TESTS -k "not engine_tokens_equal_on_the_triton_path"
    echo "GPU suite exit status: $?"
fi

if [[ -n $PROFILE_MODELS ]]; then
    stamp "profile $PROFILE_MODELS"
    timeout -s INT -k 10 120 $PY benchmarks/profile_gpu.py --models "${PROFILE_MODELS// /,}"
    echo "profile exit status: $?"
fi

if (( HOST_SECONDS > 0 )); then
    stamp "bench host on CUDA (limit ${HOST_SECONDS} s)"
    timeout -s INT -k 10 "$HOST_SECONDS" $PY benchmarks/bench_host.py --device cuda --workload decode --baseline '' \
        --ids-only --detail --tokenizer .whl/tokenizer --json "$OUT/bench_host.json" $HOST_ARGS  # the tokenizer: make gpu-wheels
    echo "bench host exit status: $?"
fi
if (( WEIGHTS_SECONDS > 0 )); then
    stamp "bench weights on CUDA (limit ${WEIGHTS_SECONDS} s)"
    timeout -s INT -k 10 "$WEIGHTS_SECONDS" $PY benchmarks/bench_weights.py --device cuda --models llama-3.2-1b \
        --repeats 2 --streams 0 $WEIGHTS_ARGS
    echo "bench weights exit status: $?"
fi

# Each model a process of its own, its limit a share of the time left by weight (the goals' shapes 5, the
# smallest 2): a model that ends early leaves its time to the next. A model stopped at its limit still prints
# and writes what it measured. The last two leave out some runs for time.
weight() { case $1 in smollm2-135m) echo 2 ;; *) echo 5 ;; esac; }
bench_args() {
    case $1 in
        qwen2.5-0.5b) ;;
        llama-3.2-1b) echo "--grpc-runs process" ;;
        *) echo "--skip-hf --grpc-runs process" ;;
    esac
}
deadline=$(( START + TOTAL_SECONDS ))
remaining=0
for model in $BENCH_MODELS; do remaining=$(( remaining + $(weight "$model") )); done
for model in $BENCH_MODELS; do
    left=$(( deadline - $(date +%s) - 10 ))  # 10 s for the kill after the interrupt
    limit=$(( left * $(weight "$model") / remaining ))
    remaining=$(( remaining - $(weight "$model") ))
    if (( limit < 30 )); then
        stamp "bench $model: skipped, ${left} s left"
        continue
    fi
    stamp "bench $model (limit ${limit} s)"
    timeout -s INT -k 10 "$limit" $PY benchmarks/bench_gpu.py --models "$model" $(bench_args "$model") $BENCH_ARGS \
        --json "$OUT/bench_gpu_$model.json"
    echo "bench $model exit status: $?"
done
stamp "done"
