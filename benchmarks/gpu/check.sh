#!/usr/bin/env bash
# The prepared GPU check: coserve's rendered GPU engine on one NVIDIA GPU, in at most 8 minutes.
#
#   bash benchmarks/gpu/check.sh [--out DIR] [--samples N]          # on the GPU image, one GPU
#   bash benchmarks/gpu/check.sh --dry-run                          # anywhere (CI): what it would run
#
# It installs nothing: it runs on the GPU image's own packages (images/vllm: vLLM 0.32 and coserve),
# with this checkout's src/ first on PYTHONPATH ($PYTHON: python3; the dry run prefers .venv/bin/python).
# Each step runs under `timeout`, inside one budget:
#
#   1. nvidia-smi answers, and `import vllm, torch` sees CUDA
#   2. `coserve render` of examples/pool.yaml with offline work and the host KV pool turned on
#      (offline steps are what safepoints preempt; the host pool is what kv_reload reloads from)
#   3. a NIXL probe: when vLLM cannot create a NIXL agent here (no UCX on a single-GPU box), the
#      rendered NixlConnector is replaced by vLLM's ExampleConnector in the same position, as
#      tests/engine/test_render_parity.py does; the output and the JSON say so
#   4. the random-weight Llama (16 layers, hidden 1024), built once into coserve's model cache
#   5. benchmarks/gpu/gpu_check.py run: the rendered decoder (SafepointGPUWorker, MultiConnector with
#      CoServeConnector first, piecewise CUDA graphs: no --enforce-eager) started twice, safepoints
#      on then off, measured with benchmarks/preemption.py's and kv_offload.py's functions
#
# Writes DIR/preemption_latency_cuda.json, DIR/safepoint_overhead_cuda.json and DIR/kv_reload_cuda.json
# ("device": "cuda"; DIR defaults to benchmarks/results), and DIR/gpu-check-logs/ (engine logs, the
# rendering). Exits 0 when all three were written by an engine that captured piecewise CUDA graphs
# and whose abandoned steps changed no output; a target not met is a result, not a failure.
#
# --dry-run needs no GPU: it checks every command, file and Python module the check uses, renders
# the decoder and prints the exact engine command lines (ENGINE_COMMAND[on|off]) it would launch.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

PYTHON=${PYTHON:-}  # default: python3 (the GPU image's); the dry run prefers this checkout's .venv
DRIVER=benchmarks/gpu/gpu_check.py
POOL=examples/pool.yaml
OUT=$ROOT/benchmarks/results
SAMPLES=200
DRY_RUN=0
TOTAL_S=480  # the issue's 8 minutes, everything included
MARGIN_S=25  # timeout's --kill-after grace, and copying the logs

usage() {
  sed -n '2,28p' "$ROOT/benchmarks/gpu/check.sh" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT=${2:?--out needs a directory}; shift ;;
    --out=*) OUT=${1#--out=} ;;
    --samples) SAMPLES=${2:?--samples needs a number}; shift ;;
    --samples=*) SAMPLES=${1#--samples=} ;;
    -h | --help) usage; exit 0 ;;
    *) echo "check.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
case "$SAMPLES" in '' | *[!0-9]*) echo "check.sh: --samples must be a whole number" >&2; exit 2 ;; esac
case "$OUT" in /*) ;; *) OUT=$PWD/$OUT ;; esac  # relative to where the check was started
cd "$ROOT"
if [ -z "$PYTHON" ]; then
  if [ "$DRY_RUN" -eq 1 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

START=$SECONDS
STEP_PID=
WORK=

say() { printf '[gpu-check +%3ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }
left() { echo $((TOTAL_S - MARGIN_S - (SECONDS - START))); }

# run_step CAP_S WHAT CMD...: CMD under `timeout`, for at most CAP_S seconds and never past the budget.
# In the background and waited for, so that an interrupted check stops the step's whole process group
# (timeout leads one: the engines of step 5 live in it).
run_step() {
  local cap=$1 what=$2 limit rc=0
  shift 2
  limit=$(left)
  if [ "$limit" -gt "$cap" ]; then limit=$cap; fi
  if [ "$limit" -lt 5 ]; then die "no time left for: $what"; fi
  say "$what (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" &
  STEP_PID=$!
  wait "$STEP_PID" || rc=$?
  STEP_PID=
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then say "timed out after ${limit}s: $what"; fi
  return "$rc"
}

# shellcheck disable=SC2317  # called by the EXIT trap
on_exit() {
  local rc=$?
  if [ -n "$STEP_PID" ]; then
    kill -TERM -- "-$STEP_PID" 2>/dev/null || kill -TERM "$STEP_PID" 2>/dev/null || true
  fi
  if [ -n "$WORK" ] && [ -d "$WORK" ]; then
    if [ "$DRY_RUN" -eq 0 ]; then
      mkdir -p "$OUT/gpu-check-logs"
      cp "$WORK"/*.log "$WORK"/*.json "$WORK"/*.yaml "$WORK"/*.txt "$OUT/gpu-check-logs/" 2>/dev/null || true
      say "logs: $OUT/gpu-check-logs/"
    fi
    rm -rf "$WORK"
  fi
  say "done in $((SECONDS - START))s, exit $rc"
}
trap on_exit EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "command not found: $1"; }
need_file() { [ -f "$1" ] || die "file not found: $1"; }

# --- what every run needs, GPU or not ---------------------------------------------------------------------
say "$([ "$DRY_RUN" -eq 1 ] && echo "dry run" || echo "GPU check"): python $PYTHON, out $OUT, budget ${TOTAL_S}s"
need_cmd timeout
need_cmd "$PYTHON"
for file in "$POOL" "$DRIVER" benchmarks/gpu/rendered_engine.py benchmarks/preemption.py benchmarks/kv_offload.py \
  benchmarks/harness/__init__.py benchmarks/harness/stats.py benchmarks/harness/client.py benchmarks/harness/engines.py src/coserve/__main__.py; do
  need_file "$file"
done
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/coserve-gpu-check.XXXXXX")

# The GPU image's modules are found without importing them (vllm and torch take long); the pure
# ones import below, with the benchmarks, through the driver's --help.
MODULES='
import importlib.util, sys
from importlib.metadata import entry_points
missing = [m for m in ("vllm", "torch", "transformers", "tokenizers", "safetensors", "psutil", "httpx", "yaml")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit("missing Python modules: " + ", ".join(missing))
plugins = {e.name for e in entry_points(group="vllm.general_plugins")}
print("vllm plugin coserve:", "registered" if "coserve" in plugins else "not registered (its connector still loads by module path)")
'
run_step 60 "Python modules" "$PYTHON" -c "$MODULES" >"$WORK/modules.txt" || die "Python modules: see above"
say "$(cat "$WORK/modules.txt")"
run_step 60 "the driver and the benchmark modules it imports (--help)" "$PYTHON" "$DRIVER" --help >/dev/null \
  || die "$DRIVER --help"
run_step 30 "the pool to render: $POOL, offline work and host KV pool on" \
  "$PYTHON" "$DRIVER" variant "$POOL" >"$WORK/pool.yaml" || die "variant of $POOL"
run_step 60 "coserve render (python -m coserve)" "$PYTHON" -m coserve render "$WORK/pool.yaml" -o json \
  >"$WORK/rendered.json" || die "coserve render $WORK/pool.yaml"

if [ "$DRY_RUN" -eq 1 ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then say "nvidia-smi: found"; else say "nvidia-smi: absent (the GPU run needs it)"; fi
  run_step 30 "the engine command lines" "$PYTHON" "$DRIVER" command --rendered "$WORK/rendered.json" \
    --workdir "$WORK" || die "the engine command lines"
  say "dry run passed: every command, file and module is there; the engines above are what the GPU run launches"
  exit 0
fi

# --- the GPU run ----------------------------------------------------------------------------------------------
need_cmd nvidia-smi
run_step 30 "nvidia-smi" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  >"$WORK/gpu.txt" || die "nvidia-smi found no GPU"
GPU=$(head -n 1 "$WORK/gpu.txt")
say "GPU: $GPU"
run_step 120 "vllm and torch see CUDA" "$PYTHON" -c '
import torch, vllm
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
' >"$WORK/versions.txt" || die "vllm/torch on CUDA"
say "$(cat "$WORK/versions.txt")"
grep -q '^vllm 0\.32\.' "$WORK/versions.txt" || say "WARNING: coserve is built for vLLM 0.32.x"

NIXL_ARGS=()
if run_step 90 "NIXL probe (NixlConnector's first step)" "$PYTHON" "$DRIVER" nixl-probe >"$WORK/nixl.txt" 2>&1; then
  say "$(grep '^nixl-probe: ' "$WORK/nixl.txt" | tail -n 1): NixlConnector runs as rendered"
else
  reason=$(grep '^nixl-probe: ' "$WORK/nixl.txt" | tail -n 1 || true)
  reason=${reason#nixl-probe: }
  reason=${reason:-the probe did not finish}
  NIXL_ARGS=(--substitute-nixl --nixl-reason "$reason")
  say "NIXL cannot start here ($reason): ExampleConnector takes NixlConnector's place, as in the parity test"
fi

run_step 240 "the random-weight model (built once)" "$PYTHON" "$DRIVER" model >"$WORK/model.txt" || die "model"
MODEL=$(tail -n 1 "$WORK/model.txt")
say "model: $MODEL"

budget=$(($(left) - 15))
rc=0
run_step "$((budget + 10))" "the rendered engine: safepoints on, then off" "$PYTHON" "$DRIVER" run \
  --rendered "$WORK/rendered.json" --model "$MODEL" --workdir "$WORK" --out "$OUT" --gpu "$GPU" \
  --budget-s "$budget" --samples "$SAMPLES" ${NIXL_ARGS[@]+"${NIXL_ARGS[@]}"} || rc=$?
for result in "$OUT"/*_cuda.json; do
  if [ -f "$result" ]; then say "result: $result"; fi
done
exit "$rc"
