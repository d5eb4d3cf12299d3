#!/usr/bin/env bash
# Launches benchmarks/suites/multiprocess.py as N processes on this host (one device each, jax.distributed on
# localhost), waits for them under a time limit, and reports every process's exit status.
#
#   bash benchmarks/suites/multiprocess_launch.sh         # GPUs: 4 processes, CUDA_VISIBLE_DEVICES=i each
#   bash benchmarks/suites/multiprocess_launch.sh --cpu   # smoke test of the Python side: 2 CPU processes, tiny shapes
#
# Environment (all optional):
#   FICCO_MP_NPROC      processes (default 4 on GPUs, 2 with --cpu)
#   FICCO_MP_BUDGET_S   seconds for everything (default 540: fits a 10-minute command; about 300
#                       covers the small checks and one anchor; steps that do not fit are skipped)
#   FICCO_MP_VISIBLE    "isolated" (default: CUDA_VISIBLE_DEVICES=i per process) or "all" (every GPU
#                       visible, jax local_device_ids=[i]); with "isolated", if CUDA IPC could not
#                       open a peer's memory, the launcher retries once with "all" (quick checks)
#   FICCO_MP_PORT       coordinator port (default: a free one)
#   FICCO_PYTHON        the interpreter of every process (default: python3 on PATH); the benchmark
#                       entry point and the tests pass their own (sys.executable)
#   FICCO_MP_TRACE, FICCO_MP_TIMED, FICCO_MP_SCHEDULES, FICCO_MP_QUICK: multiprocess.py's --trace,
#                       --timed, --schedules, --quick (its --help says what they do)
#   OUT                 where results go (default ./out/multiprocess): mp_gpu.json (rank 0), one log per process
# Exit status: 0 if every process exited 0.
set -u
cd "$(dirname "$0")/../.."
REPO=$(pwd)

CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
if [ "$CPU" = 1 ]; then NPROC=${FICCO_MP_NPROC:-2}; else NPROC=${FICCO_MP_NPROC:-4}; fi
BUDGET=${FICCO_MP_BUDGET_S:-540}
VISIBLE=${FICCO_MP_VISIBLE:-isolated}
OUT=${OUT:-$REPO/out/multiprocess}
PYTHON=${FICCO_PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)

# NVLink SHARP (multicast) stays off, as in every step of benchmarks/run.py: on GPUs that others
# share, a program using it can put the host's GPUs out of service. NCCL only carries the
# reference collectives and JAX sequential here, so nothing is lost.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The cross-process copy-engine path is opt-in (config.CROSS_PROCESS_DMA): this script is its check.
export FICCO_CROSS_PROCESS_DMA=1
# Processes reach a call's rendezvous after compiling it on their own; give slow compiles room.
export FICCO_RENDEZVOUS_TIMEOUT_S=${FICCO_RENDEZVOUS_TIMEOUT_S:-30}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])'; }

# run_job MODE JSON_NAME BUDGET_S [extra args]: one job of NPROC processes; prints the exit codes.
run_job() {
  local mode=$1 json=$2 budget=$3; shift 3
  local port=${FICCO_MP_PORT:-$(free_port)}
  # The script starts no step it cannot finish within its budget (15 s kept for the report and
  # teardown); this limit only catches a hang.
  local limit=$((budget + 20))
  budget=$((budget > 60 ? budget - 15 : budget))
  echo "== multiprocess: $NPROC processes, mode $mode, port $port, budget ${budget}s (kill after ${limit}s), out $OUT" >&2
  local pids=() i
  for ((i = 0; i < NPROC; i++)); do
    local log="$OUT/${json%.json}_p$i.log"
    (
      export FICCO_MP_PROCESS_ID=$i FICCO_MP_NUM_PROCESSES=$NPROC FICCO_MP_PORT=$port
      local extra=()
      if [ "$CPU" = 1 ]; then
        export JAX_PLATFORMS=cpu
        unset XLA_FLAGS
      elif [ "$mode" = isolated ]; then
        export CUDA_VISIBLE_DEVICES=$i
      else
        extra=(--local-device "$i")
      fi
      if [ "$i" = 0 ]; then  # rank 0 to the console too: the table and its log lines
        exec timeout --kill-after=20 "$limit" "$PYTHON" benchmarks/suites/multiprocess.py --out "$OUT" --json "$json" \
          --budget-s "$budget" "${extra[@]}" "$@" 2>&1 | tee "$log"
      else
        exec timeout --kill-after=20 "$limit" "$PYTHON" benchmarks/suites/multiprocess.py --out "$OUT" --json "$json" \
          --budget-s "$budget" "${extra[@]}" "$@" >"$log" 2>&1
      fi
    ) &
    pids+=($!)
  done
  local codes=() failed=0
  for ((i = 0; i < NPROC; i++)); do
    wait "${pids[$i]}"
    codes+=($?)
  done
  # rank 0 ran through a pipe: take its status from its log's end if tee hid it
  echo "== multiprocess mode $mode: exit codes per process: ${codes[*]} (124/137: killed by the time limit)" >&2
  for ((i = 0; i < NPROC; i++)); do
    if [ "${codes[$i]}" != 0 ] && [ "$i" != 0 ]; then
      echo "-- process $i (exit ${codes[$i]}), last lines of $OUT/${json%.json}_p$i.log:" >&2
      tail -n 25 "$OUT/${json%.json}_p$i.log" >&2
    fi
    [ "${codes[$i]}" != 0 ] && failed=1
  done
  return $failed
}

set -o pipefail
run_job "$VISIBLE" mp_gpu.json "$BUDGET"
STATUS=$?

# CUDA IPC may need every GPU visible in every process (peer access across isolated
# CUDA_VISIBLE_DEVICES is driver- and container-dependent): one quick retry that way.
ELAPSED=$(( $(date +%s) - START ))
LEFT=$(( BUDGET - ELAPSED ))
if [ "$CPU" = 0 ] && [ "$STATUS" != 0 ] && [ "$VISIBLE" = isolated ] && [ "$LEFT" -gt 150 ] \
   && grep -q '"ipc_open_failed": true' "$OUT/mp_gpu.json" 2>/dev/null; then
  echo "== CUDA IPC could not open a peer's memory with isolated devices; retrying with every GPU visible" >&2
  run_job all mp_gpu_all_visible.json $((LEFT - 30)) --quick
  RETRY=$?
  echo "== retry with every GPU visible: $([ $RETRY = 0 ] && echo passed || echo failed)" >&2
fi
echo "== multiprocess done in $(( $(date +%s) - START ))s, status $STATUS; results in $OUT" >&2
exit $STATUS
