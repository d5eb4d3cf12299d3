#!/usr/bin/env bash
# One device-machine session step: build the extension with CUDA, check, then measure.
# Usage (on the GPU host, repo root): bash scripts/device_run.sh STAGE [ARGS...]
#   STAGE=check   build + GPU tests + a short bench of one shape
#   STAGE=bench   the anchor shapes, ficco_jax vs JAX options (+ torch anchors if found: anchors_dir)
#   STAGE=x8a|x8b the 8-GPU run (issue 10); x4a|x4b the 4-GPU runs of 2026-11-22 session 2
#   STAGE=s3a, s3c: session 3's runs; s4load, s4b, s4c: the next session's (the 10,000-step load alone; NCCL
#                 contention and accuracy; the example with its communication-free bound); s4e: one GPU's GEMMs;
#                 s4x2: what 2 GPUs can tell (session 4); s5a, s5c-s5f: session 5 on 2 GPUs (timelines of the cross-process
#                 all-gather, the staging-copy and reduce-sum fixes, their A/B runs, the record; s5b, the A/B of a copy call
#                 removed since, is in git at 1725e0e); s5x4, s5acc: what the
#                 last device minutes of session 5 could do; s6x4a-s6x4e: session 6's 4-GPU calls; s6x2: its fallback on 2 GPUs;
#                 s7x2a, s7x2b: session 7 on 2 GPUs (pulls vs pushes); s7x2c: an h200x2 profile and its held-out check;
#                 s7x2d, s7x2e: the held-out check with the shipped h200x2; x4next: the next 4-GPU call
# Writes logs and JSON under $OUT (default ./out/device). Never changes GPU settings.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# The lent machines' jax/torch/scikit-build-core live in /opt/torch/.venv; on the one-GPU kind the
# python3 first on PATH lacked scikit-build-core (2026-11-22).
[ -x /opt/torch/.venv/bin/python3 ] && export PATH=/opt/torch/.venv/bin:$PATH
# A tree made by `git archive` has no .git, and git then finds whatever checkout encloses it (a stale
# commit on the device): stamp results with the commit written beside the tree (.commit), if any.
[ -z "${FICCO_COMMIT:-}" ] && [ -f .commit ] && export FICCO_COMMIT=$(cat .commit)
OUT=${OUT:-out/device}; mkdir -p "$OUT" "$OUT/calib" "$OUT/acc" "$OUT/char" "$OUT/faults" "$OUT/a2a" "$OUT/load" "$OUT/mp"
STAGE=${1:-check}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1

# Deadline-bound stages set DEADLINE (seconds for the whole stage, from here): `left` is what remains,
# `upto S` is S or what remains less 5 s, whichever is smaller (at least 1), for `timeout`.
T0=$SECONDS
left() { echo $((DEADLINE - (SECONDS - T0))); }
upto() { local l=$(($(left) - 5)); [ "$1" -lt "$l" ] && echo "$1" || echo $((l > 1 ? l : 1)); }

# The anchor scripts (../shared/anchors, carried): $ANCHORS, else .carry/anchors inside the tree (a
# checkout), else ../anchors (a `git archive` tree in .carry/clean beside .carry/anchors). Session 6's
# first call looked only inside the tree and skipped PyTorch's async-TP without a word.
anchors_dir() {
  local d; for d in ${ANCHORS:-} .carry/anchors ../anchors; do [ -f "$d/anchors_torch.py" ] && { echo "$d"; return; }; done
}
# PyTorch's async-TP anchors, timed in the same call as our bench.
anchors_torch() {
  local dir; dir=$(anchors_dir)
  if [ -z "$dir" ]; then echo "anchors_torch: anchors_torch.py not found (set ANCHORS); skipped"; return; fi
  timeout "$(upto "$1")" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" "$dir/anchors_torch.py" \
    > "$OUT/anchors_torch.log" 2>&1; echo "anchors_torch rc=$?"; grep -v "^W1\|^\*\*\*" "$OUT/anchors_torch.log" | tail -14
}

build() {
  local t0=$SECONDS
  FICCO_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  python3 -c "import ficco_jax._ext as e; print('extension', e.build_info())" || exit 1
  echo "build: $((SECONDS - t0)) s"
}

case "$STAGE" in
  check)
    build
    if ls tests/gpu/test_*.py >/dev/null 2>&1; then
      timeout 240 python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    fi
    timeout 300 python3 -m ficco_jax bench --shape "${2:-8192,8192,10240}" --no-windowed \
      --schedules "${1:-dma}" --out "$OUT/bench_check" 2>"$OUT/bench_check.err" | tail -12
    tail -3 "$OUT/bench_check.err"
    ;;
  bench)
    build
    timeout 420 python3 -m ficco_jax bench --schedules "${1:-auto}" --out "$OUT/bench" --plot 2>"$OUT/bench.err" | tail -14
    if [ -n "$(anchors_dir)" ]; then
      timeout 100 python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" "$(anchors_dir)/anchors_torch.py" \
        > "$OUT/anchors_torch.log" 2>&1; tail -6 "$OUT/anchors_torch.log"
    fi
    ;;
  trace)  # trace OP SCHEDULE M K N: a GPU timeline of one op (device 0), by nsys or else JAX's profiler
    build
    NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
    name="trace_${1}_${2//\//_}"
    if [ -z "$NSYS" ]; then  # no nsys (the 2-GPU machine, 2026-11-22): JAX's profiler (CUPTI) instead
      timeout 200 python3 scripts/trace_op.py "$@" --jax-profiler "$OUT/$name" > "$OUT/$name.log" 2>&1; echo "trace rc=$?"
      python3 scripts/perfetto_timeline.py "$OUT/$name" --device 0 --first "${TRACE_FIRST:-200}" --count "${TRACE_COUNT:-40}"
      exit 0
    fi
    timeout 200 "$NSYS" profile -t cuda -o "$OUT/$name" --force-overwrite true python3 scripts/trace_op.py "$@" > "$OUT/$name.log" 2>&1
    "$NSYS" stats --report cuda_gpu_trace --format csv --output "$OUT/$name" "$OUT/$name.nsys-rep" > /dev/null 2>&1
    python3 scripts/timeline.py "$OUT/${name}_cuda_gpu_trace.csv" 0 "${TRACE_FIRST:-200}" "${TRACE_COUNT:-40}"
    rm -f "$OUT/$name.nsys-rep" "$OUT/$name.sqlite"
    ;;
  characterize)  # issue 4: decomposition loss, NCCL vs copy-engine contention, transfer cost; then the profile
    build
    timeout 400 python3 -m ficco_jax characterize --plot --out "$OUT/characterize" 2>"$OUT/characterize.err" | tail -30
    ;;
  moe)  # issue 8: the Mixtral-like dispatch/combine side by side with JAX's all_to_all + einsum
    build
    if ls tests/gpu/test_a2a_gpu.py >/dev/null 2>&1; then timeout 200 python3 -m pytest tests/gpu/test_a2a_gpu.py -x -q 2>&1 | tail -3; fi
    timeout 300 python3 -m ficco_jax bench --op moe --schedules "${1:-dma/direct/c1,dma/direct/c2,dma/direct/c1/s2,xla/direct/c1}" \
      --out "$OUT/bench_moe" 2>"$OUT/bench_moe.err" | tail -6
    ;;
  final)  # the session's last short run: the example, which GEMM XLA uses, GEMM probe, small shape
    build
    if [ -f examples/tp_transformer.py ]; then
      timeout 170 python3 examples/tp_transformer.py --preset llama70b-layer --compare ${EXAMPLE_ARGS:-} > "$OUT/tp_transformer.log" 2>&1
      grep -v "^\[" "$OUT/tp_transformer.log" | tail -14
    fi
    timeout 40 python3 scripts/xla_gemm_hlo.py > "$OUT/xla_gemm_hlo.txt" 2>&1; grep -o 'custom_call_target="[^"]*"' "$OUT/xla_gemm_hlo.txt" | sort | uniq -c
    PROBE_GEMM_ONLY=1 timeout 60 python3 scripts/probe.py 2>&1 | tail -8
    timeout 50 python3 -m ficco_jax bench --no-windowed --op ag_matmul --shape 1024,4096,4096 \
      --schedules "dma/direct/c1" --out "$OUT/bench_final" 2>"$OUT/bench_final.err" | grep -E "^\| ag"
    ;;
  x8a)  # issue 10, first part, on all GPUs of the node: calibrate, PyTorch anchors, bench (anchors + Llama-405B)
    DEADLINE=${DEADLINE:-585}
    build
    N=$(nvidia-smi -L | wc -l)
    timeout 230 python3 -m ficco_jax calibrate --out "$OUT/calib/h200x${N}.json" 2>"$OUT/calib/calibrate.err" | tail -40
    [ -f "$OUT/calib/h200x${N}.json" ] && cp "$OUT/calib/h200x${N}.json" "ficco_jax/profiles/h200x${N}.json"
    if [ -n "$(anchors_dir)" ]; then
      ANCHOR_JSON=anchors_torch_405b.json ANCHOR_SHAPES='{"llama405b_qkv_M8k": [8192, 16384, 18432], "llama405b_mlp_up_M8k": [8192, 16384, 53248]}' \
        timeout 90 python3 -m torch.distributed.run --nproc-per-node="$N" "$(anchors_dir)/anchors_torch_shapes.py" > "$OUT/anchors_torch_405b.log" 2>&1
      timeout 110 python3 -m torch.distributed.run --nproc-per-node="$N" "$(anchors_dir)/anchors_torch.py" > "$OUT/anchors_torch.log" 2>&1
      grep '^{' "$OUT/anchors_torch_405b.log" "$OUT/anchors_torch.log" | cut -c1-220
    fi
    echo "bench with $(left) s left"
    timeout $(( $(left) - 10 )) python3 -m ficco_jax bench --no-windowed --shape llama405b --shape anchors \
      --schedules "${1:-dma/direct/c1,dma/direct/c2,dma/direct/c4/grouped}" --out "$OUT/bench" 2>"$OUT/bench.err" | tail -40
    tail -2 "$OUT/bench.err"
    ;;
  x8b)  # issue 10 (+5): the example at tp=8 with the shipped h200x8 profile, then the held-out accuracy check at tp=8
    DEADLINE=${DEADLINE:-570}
    build
    timeout 120 python3 examples/tp_transformer.py --preset llama70b-layer --tp 8 --compare --steps 4 > "$OUT/ex_tp8.log" 2>&1
    grep -v "^\[" "$OUT/ex_tp8.log" | grep -v "^ok " | tail -12
    echo "accuracy with $(left) s left"
    timeout $(( $(left) - 5 )) python3 -m ficco_jax accuracy --top 2 --budget-s $(( $(left) - 45 )) --out "$OUT/acc" \
      2>"$OUT/acc/accuracy.err" | tail -50
    ;;
  x4a)  # issues 4, 8, 11 (+ a first look at 9) on 4 GPUs: characterize, dma.all_to_all vs NCCL, faults, load, IPC
    DEADLINE=${DEADLINE:-560}
    build
    timeout "$(upto 130)" python3 -m ficco_jax characterize --out "$OUT/char" 2>"$OUT/char/characterize.err" | tail -40
    timeout "$(upto 130)" python3 scripts/gpu_faults.py --budget-s 100 --out "$OUT/faults" 2>"$OUT/faults/gpu_faults.err" | tail -30
    timeout "$(upto 110)" python3 scripts/a2a_vs_nccl.py --budget-s 80 --out "$OUT/a2a" 2>"$OUT/a2a/a2a.err" | tail -25
    timeout "$(upto 100)" python3 scripts/load_test.py --steps "${LOAD_STEPS:-600}" --comm dma --interval 100 --warmup 100 \
      --json "$OUT/load/load.json" > "$OUT/load/load.log" 2>&1; echo "load rc=$?"; tail -12 "$OUT/load/load.log"
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    if [ -f scripts/mp_gpu_launch.sh ]; then
      B=$(upto 100); FICCO_MP_BUDGET_S=$((B - 10)) OUT="$OUT/mp" timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
      echo "mp_gpu rc=$?"; tail -25 "$OUT/mp/launch.log"
    fi
    ;;
  x4b)  # why error paths died on the GPU, then issue 5 at tp=4, issue 8 all_to_all, issue 9 IPC (platform allocator)
    DEADLINE=${DEADLINE:-555}
    build
    timeout "$(upto 100)" python3 scripts/segv_probe.py > "$OUT/segv_probe.log" 2>&1; grep -v "^\s*$" "$OUT/segv_probe.log" | cut -c1-260 | tail -60
    timeout "$(upto 330)" python3 -m ficco_jax accuracy --top 1 --budget-s "${ACC_BUDGET:-290}" --out "$OUT/acc" \
      2>"$OUT/acc/accuracy.err" | tail -48
    timeout "$(upto 60)" python3 scripts/a2a_vs_nccl.py --sizes 4,16,64 --overlap-sizes 64 --budget-s 45 --out "$OUT/a2a" \
      2>"$OUT/a2a/a2a.err" | tail -20; grep -c "^ROW" "$OUT/a2a/a2a.err"
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 90); XLA_PYTHON_CLIENT_ALLOCATOR=platform FICCO_SEGV_TRACE=1 FICCO_MP_BUDGET_S=$((B - 15)) OUT="$OUT/mp" \
      timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -v "^\s*$" "$OUT/mp/launch.log" | cut -c1-260 | tail -30
    ;;
  s3a)  # session 3, call 1: all_to_all beside a matmul, NCCL contention, the 4-process IPC run, the example with cuDNN
        # attention. (It also started the 10,000-step load in the background for a second call to collect: the call
        # then ran to its 600 s limit, and the load was spoiled by the processes run beside it. Never again: one
        # JAX GPU program at a time, and the long load gets a call of its own, s4load.)
    DEADLINE=${DEADLINE:-575}
    build
    timeout "$(upto 80)" python3 scripts/a2a_vs_nccl.py --sizes 4,16,64 --overlap-sizes 16,64 --budget-s 60 --out "$OUT/a2a" \
      2>"$OUT/a2a/a2a.err" | tail -20
    timeout "$(upto 70)" python3 -m ficco_jax characterize --parts contention --out "$OUT/char" 2>"$OUT/char/char.err" | tail -12
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 200); FICCO_SEGV_TRACE=1 FICCO_MP_BUDGET_S=$((B - 25)) OUT="$OUT/mp" timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "PASS|FAIL|setup|^\|" "$OUT/mp/launch.log" | cut -c1-200 | tail -30
    FICCO_SEGV_TRACE=1 timeout "$(upto 190)" python3 examples/tp_transformer.py --preset llama70b-layer --compare --steps 4 \
      --attention cudnn > "$OUT/ex_cudnn.log" 2>&1; echo "example rc=$?"; grep -v "^\[" "$OUT/ex_cudnn.log" | tail -14
    ;;
  s3c)  # session 3, last call (quiet GPUs, nothing else running): faults, NCCL contention by PyTorch, GPU tests, then as
            # many load steps as fit. (Session 3 first ran these beside s3a's load: every JAX process preallocates 75 % of
        # each GPU, so the others ran out of memory and NCCL hung.)
    DEADLINE=${DEADLINE:-450}
    build
    timeout "$(upto 130)" python3 scripts/gpu_faults.py --budget-s 115 --out "$OUT/faults" 2>"$OUT/faults/gpu_faults.err" | tail -28
    timeout "$(upto 70)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"; grep '^{' "$OUT/char/contention_torch.log" | cut -c1-600
    timeout "$(upto 200)" python3 -m pytest tests/gpu -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    STEPS=$(( ($(left) - 35) * 15 )); [ "$STEPS" -gt 10000 ] && STEPS=10000
    if [ "$STEPS" -ge 1000 ]; then
      timeout "$(upto $(left))" python3 scripts/load_test.py --steps "$STEPS" --comm dma --interval 250 --warmup 250 \
        --json "$OUT/load/load.json" > "$OUT/load/load.log" 2>&1; echo "load rc=$?"; tail -3 "$OUT/load/load.log"
    fi
    ;;
  s4load)  # issue 11's 10,000-step load, alone on the GPUs (19.6 steps/s on 4xH200 in session 3: about 510 s + build)
    build
    timeout 570 python3 scripts/load_test.py --steps "${LOAD_STEPS:-10000}" --comm dma --interval 500 --warmup 500 \
      --json "$OUT/load/load.json" > "$OUT/load/load.log" 2>&1; echo "load rc=$?"; tail -4 "$OUT/load/load.log"
    ;;
  s4b)  # NCCL contention by PyTorch (it timed out at 70 s in session 3: more room, progress lines), then the held-out check
    DEADLINE=${DEADLINE:-570}
    build
    timeout "$(upto 150)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"
    grep -E '^\{|rank0' "$OUT/char/contention_torch.log" | cut -c1-600
    timeout "$(upto 420)" python3 -m ficco_jax accuracy --top 1 --budget-s "$(( $(left) - 40 ))" --plot --out "$OUT/acc" \
      ${ACC_ARGS:-} 2>"$OUT/acc/accuracy.err" | tail -50
    ;;
  s4c)  # issue 7: the llama70b-layer step without overlap, with overlap, and with no communication at all (the bound);
        # first, whether the tp=4 cuDNN-attention crash happens without ficco_jax imported at all
    build
    timeout 120 python3 scripts/cudnn_attention_repro.py > "$OUT/cudnn_repro.log" 2>&1; echo "cudnn repro rc=$?"; tail -5 "$OUT/cudnn_repro.log"
    timeout 430 python3 examples/tp_transformer.py --preset llama70b-layer --compare --comm-free-bound --steps 4 \
      > "$OUT/tp_transformer.log" 2>&1; echo "example rc=$?"; grep -v "^\[" "$OUT/tp_transformer.log" | grep -v "^ok " | tail -16
    ;;
  s4e)  # one GPU (kind nvidia-h200): the executor's cuBLASLt GEMM vs XLA's dot after the two-pass algorithm choice
    build
    # narrow N (the qkv shard on 4 GPUs, where the gap was 11-14 %) and wide N (where it was 2 %)
    # (session 4: the two-pass choice left the gap at 15 %; the probe now also times the matmul alone, and
    # FICCO_GEMM_LOG=1 prints the algorithm chosen and its in-plan time per run)
    for shape in "8192 8192 2560" "4096 8192 7168"; do
      FICCO_GEMM_LOG=1 PROBE_GEMM_ONLY=1 timeout 150 python3 scripts/probe.py $shape > "$OUT/probe_${shape// /_}.log" 2>&1
      grep -E "ficco gemm plan" "$OUT/probe_${shape// /_}.log" | cut -c1-200 | sort | uniq | head -12; tail -14 "$OUT/probe_${shape// /_}.log"
    done
    ;;
  s4x2)  # session 4 on 2 GPUs (nvidia-h200-x2: the 4- and 8-GPU kinds were not lent): the cuDNN crash without ficco_jax,
          # matmul slowdown beside NCCL (PyTorch) and beside copy engines (ours), host time vs device time of a
          # copy-engine call, then the example with cuDNN attention and its communication-free bound
    DEADLINE=${DEADLINE:-575}
    build
    mkdir -p "$OUT/host"
    timeout "$(upto 90)" python3 scripts/cudnn_attention_repro.py > "$OUT/cudnn_repro.log" 2>&1; CUDNN_RC=$?
    echo "cudnn repro rc=$CUDNN_RC"; tail -4 "$OUT/cudnn_repro.log"
    timeout "$(upto 150)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"
    grep -E '^\{' "$OUT/char/contention_torch.log" | cut -c1-700; grep rank0 "$OUT/char/contention_torch.log" | tail -3
    timeout "$(upto 80)" python3 -m ficco_jax characterize --parts contention --out "$OUT/char" 2>"$OUT/char/char.err" | tail -12
    timeout "$(upto 130)" python3 scripts/host_overhead.py --schedules ref,dma/direct/c1 --out "$OUT/host" 2>"$OUT/host/host.err" | tail -8
    if [ "$CUDNN_RC" = 0 ] && [ "$(left)" -gt 100 ]; then
      timeout "$(upto 240)" python3 examples/tp_transformer.py --preset llama70b-layer --tp 2 --layers 2 --attention cudnn \
        --compare --comm-free-bound --steps 4 > "$OUT/tp_transformer.log" 2>&1; echo "example rc=$?"
      grep -v "^\[" "$OUT/tp_transformer.log" | grep -v "^ok " | tail -16
    fi
    ;;
  s4x2b)  # the example with cuDNN attention crashed at tp=2 as at tp=4, while the attention alone ran (s4x2): try it
           # with XLA's command buffers off (jax-ml/jax#27599: cuDNN attention in CUDA graphs on several GPUs), with
           # Python's fault handler for a stack; then the same with command buffers on (default), smaller
    DEADLINE=${DEADLINE:-480}
    build
    echo "nsys: $(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)"
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "$(upto 260)" python3 -X faulthandler examples/tp_transformer.py \
      --preset llama70b-layer --tp 2 --layers 2 --attention cudnn --compare --comm-free-bound --steps 4 \
      > "$OUT/tp_cudnn_nocmdbuf.log" 2>&1; echo "example (command buffers off) rc=$?"
    grep -v "^\[" "$OUT/tp_cudnn_nocmdbuf.log" | grep -v "^ok " | cut -c1-200 | tail -22
    timeout "$(upto 120)" python3 -X faulthandler examples/tp_transformer.py --preset llama70b-layer --tp 2 --layers 1 \
      --attention cudnn --no-overlap --steps 2 > "$OUT/tp_cudnn_default.log" 2>&1; echo "example (default flags, 1 layer) rc=$?"
    grep -v "^\[" "$OUT/tp_cudnn_default.log" | cut -c1-200 | tail -14
    ;;
  s4x2c)  # the crash is in XLA's compile (fault handler, s4x2b): compile pieces of the example, each in a child process
    build
    timeout 400 python3 scripts/cudnn_compile_bisect.py --timeout-s 90 ${BISECT_ARGS:-} 2>&1 | cut -c1-400
    ;;
  s4x2d)  # the example with cuDNN attention, layers unrolled (the compile crash needs the layer scan, s4x2c): without
           # overlap, with overlap, and with no communication at all, at tp=2
    build
    timeout 450 python3 -X faulthandler examples/tp_transformer.py --preset llama70b-layer --tp 2 --attention cudnn \
      --compare --comm-free-bound --steps 5 > "$OUT/tp_cudnn_tp2.log" 2>&1; echo "example rc=$?"
    grep -v "^\[" "$OUT/tp_cudnn_tp2.log" | grep -v "^ok " | cut -c1-220 | tail -24
    ;;
  s4own)  # ag_matmul's plain forward no longer copies its own rows into the gathered output: the probe on one GPU
           # (the executor's matmul alone / via ag_matmul / with the own rows copied) and ag_matmul on all GPUs
    build
    for shape in ${PROBE_SHAPES:-"8192 8192 10240" "8192 8192 28672"}; do
      PROBE_GEMM_ONLY=1 timeout 200 python3 scripts/probe.py $shape > "$OUT/probe_${shape// /_}.log" 2>&1
      grep -E "^probe|^cublas|^xla|^ag_matmul" "$OUT/probe_${shape// /_}.log" | cut -c1-110
    done
    ;;
  s4mp)  # issue 9 on 2 GPUs, in one call: one process (bench) then one process per GPU (mp_gpu_launch), same shapes;
          # matmul_rs / matmul_a2a now write their send partials straight into the staging buffer across processes
    DEADLINE=${DEADLINE:-480}
    build
    [ -n "${MP_ONLY:-}" ] || timeout "$(upto 170)" python3 -m ficco_jax bench --no-windowed --op all --shape 8192,8192,10240 --shape 2048,8192,28672 \
      --shape 8192,8192,28672 --schedules "${MP_SCHEDULES:-dma/direct/c1,dma/direct/c4/grouped,dma/direct/c8/grouped}" \
      --out "$OUT/bench1p" 2>"$OUT/bench1p.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 280); FICCO_MP_NPROC=$(nvidia-smi -L | wc -l) FICCO_MP_BUDGET_S=$((B - 25)) OUT="$OUT/mp" timeout "$B" \
      bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\|" "$OUT/mp/launch.log" | cut -c1-220 | tail -24
    ;;
  s4x4)  # if the 4-GPU kind is lent: NCCL contention (issue 4), the example with cuDNN attention and its bound (7), the
          # own-rows skip on 4 GPUs and a timeline of the qkv op (3), one process per GPU with partials staged in place
          # (9); each short, most needed first
    DEADLINE=${DEADLINE:-580}
    build
    mkdir -p "$OUT/mp"
    timeout "$(upto 90)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"
    grep -E '^\{' "$OUT/char/contention_torch.log" | cut -c1-700
    timeout "$(upto 70)" python3 -m ficco_jax characterize --parts contention --out "$OUT/char" 2>"$OUT/char/char.err" | tail -3
    timeout "$(upto 170)" python3 -X faulthandler examples/tp_transformer.py --preset llama70b-layer --attention cudnn --compare \
      --comm-free-bound --steps 4 > "$OUT/tp_cudnn_tp4.log" 2>&1; echo "example rc=$?"
    grep -v "^\[" "$OUT/tp_cudnn_tp4.log" | grep -v "^ok " | cut -c1-220 | tail -16
    PROBE_GEMM_ONLY=1 timeout "$(upto 80)" python3 scripts/probe.py 8192 8192 10240 > "$OUT/probe_tp4.log" 2>&1
    grep -E "^ag_matmul" "$OUT/probe_tp4.log"
    # the tp=4 gap to the ideal (issue 3): a timeline of dma/direct/c1 at qkv M8k (no nsys needed)
    timeout "$(upto 60)" python3 scripts/trace_op.py ag_matmul dma/direct/c1 8192 8192 10240 8 --jax-profiler "$OUT/trace_qkv" \
      > "$OUT/trace_qkv.log" 2>&1 && python3 scripts/perfetto_timeline.py "$OUT/trace_qkv" --count 0 | head -12
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 240); FICCO_MP_BUDGET_S=$((B - 25)) OUT="$OUT/mp" timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\|" "$OUT/mp/launch.log" | cut -c1-220 | tail -20
    ;;
  s5a)  # session 5 on 2 GPUs (x4/x8 not lent): one process per GPU with the AcquireStaging refactor (its first GPU
         # run) and a timeline of the cross-process all-gather in each process (issue 9); timelines of the in-process
         # qkv ops (first GPU run of the JAX-profiler route, issue 3); one process, same shapes, same lease (9)
    DEADLINE=${DEADLINE:-570}
    build
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 250); FICCO_MP_NPROC=$(nvidia-smi -L | wc -l) FICCO_MP_BUDGET_S=$((B - 25)) OUT="$OUT/mp" \
      FICCO_MP_TIMED=llama70b_qkv_M8k,llama70b_mlp_up_M2k FICCO_MP_TRACE=ag_matmul:dma/direct/c1:8192,8192,10240 \
      timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\|" "$OUT/mp/launch.log" | cut -c1-220 | tail -12
    for p in 0 1; do
      [ -d "$OUT/mp/trace_p$p" ] && python3 scripts/perfetto_timeline.py "$OUT/mp/trace_p$p" --count 400 > "$OUT/mp/timeline_p$p.txt" 2>&1
    done
    head -8 "$OUT/mp/timeline_p0.txt" 2>/dev/null
    for spec in "ag_matmul dma/direct/c1" "matmul_rs dma/direct/c1" "matmul_rs dma/direct/c4/grouped"; do
      set -- $spec; name="trace_${1}_${2//\//_}"
      [ "$(left)" -gt 60 ] || break
      timeout "$(upto 60)" python3 scripts/trace_op.py $1 $2 8192 8192 10240 20 --jax-profiler "$OUT/$name" > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"
      python3 scripts/perfetto_timeline.py "$OUT/$name" --count 400 > "$OUT/$name.txt" 2>&1; head -6 "$OUT/$name.txt"
    done
    [ "$(left)" -gt 120 ] && timeout "$(upto 170)" python3 -m ficco_jax bench --no-windowed --op all --shape 8192,8192,10240 \
      --shape 2048,8192,28672 --schedules dma/direct/c1,dma/direct/c4/grouped,dma/direct/c8/grouped --out "$OUT/bench1p" \
      2>"$OUT/bench1p.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    ;;
  s5c)  # the staging copy now goes ahead of the own-shard matmul in host order (Stage), and the reduce-scatter sum
         # reads 16-byte packs: GPU tests, 2 processes quick with a timeline (default and 32 hardware connections), the
         # 1-process bench with the old (scalar) and the new sum, a timeline of matmul_rs
    DEADLINE=${DEADLINE:-580}
    build
    timeout "$(upto 150)" python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    NP=$(nvidia-smi -L | wc -l)
    for conn in default 32; do
      mkdir -p "$OUT/mp_$conn"
      extra=(); [ "$conn" = 32 ] && extra=(env CUDA_DEVICE_MAX_CONNECTIONS=32)
      B=$(upto 80); "${extra[@]}" env FICCO_MP_QUICK=1 FICCO_MP_NPROC=$NP FICCO_MP_BUDGET_S=$((B - 20)) OUT="$OUT/mp_$conn" \
        FICCO_MP_TRACE=ag_matmul:dma/direct/c1:8192,8192,10240 FICCO_MP_TIMED=llama70b_qkv_M8k timeout "$B" \
        bash scripts/mp_gpu_launch.sh > "$OUT/mp_$conn/launch.log" 2>&1
      echo "mp_gpu (connections $conn) rc=$?"; grep -E "FAIL|checks:|^\| ag|^\| matmul" "$OUT/mp_$conn/launch.log" | cut -c1-220
      grep -h "TIME" "$OUT/mp_$conn/mp_gpu_p0.log" | cut -c1-120
      [ -d "$OUT/mp_$conn/trace_p0" ] && python3 scripts/perfetto_timeline.py "$OUT/mp_$conn/trace_p0" --count 400 \
        > "$OUT/mp_$conn/timeline_p0.txt" 2>&1 && awk '/nvjet|#8[0-9]/' "$OUT/mp_$conn/timeline_p0.txt" | sed -n 8,14p
    done
    timeout "$(upto 60)" python3 scripts/trace_op.py matmul_rs dma/direct/c1 8192 8192 10240 20 --jax-profiler "$OUT/trace_rs" \
      > "$OUT/trace_rs.log" 2>&1; python3 scripts/perfetto_timeline.py "$OUT/trace_rs" --count 400 > "$OUT/trace_rs.txt" 2>&1
    grep -m3 ReduceSum "$OUT/trace_rs.txt" | cut -c1-120
    for red in scalar vector; do
      [ "$(left)" -gt 90 ] || break
      extra=(); [ "$red" = scalar ] && extra=(env FICCO_REDUCE_SCALAR=1)
      "${extra[@]}" timeout "$(upto 100)" python3 -m ficco_jax bench --no-windowed --op matmul_rs --shape 8192,8192,10240 \
        --shape 2048,8192,28672 --shape 8192,8192,28672 --schedules dma/direct/c1,dma/direct/c4/grouped,dma/direct/c4 \
        --out "$OUT/bench_rs_$red" 2>"$OUT/bench_rs_$red.err" | grep -E "^\| matmul" | cut -c1-250
      echo "bench ($red sum) rc=$?"
    done
    ;;
  s5d)  # the cross-process staging copy on XLA's stream (Stage; it ran on SMs beside the matmul, s5c): 2 processes with
         # every check, a timeline and the timings; the old stream (FICCO_STAGE_STREAM=copy) quick, for A/B; one process on
         # the same shapes; the reduce-scatter sum scalar vs 16-byte packs again
    DEADLINE=${DEADLINE:-340}
    build
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    NP=$(nvidia-smi -L | wc -l)
    for stage in compute copy; do
      mkdir -p "$OUT/mp_$stage"
      quick=""; [ "$stage" = copy ] && quick=1
      B=$(upto 100); FICCO_STAGE_STREAM=$stage FICCO_MP_QUICK=$quick FICCO_MP_NPROC=$NP FICCO_MP_BUDGET_S=$((B - 20)) \
        OUT="$OUT/mp_$stage" FICCO_MP_TRACE=ag_matmul:dma/direct/c1:8192,8192,10240 \
        FICCO_MP_TIMED=llama70b_qkv_M8k,llama70b_mlp_up_M2k timeout "$B" bash scripts/mp_gpu_launch.sh > "$OUT/mp_$stage/launch.log" 2>&1
      echo "mp_gpu (staging copy on the $stage stream) rc=$?"; grep -E "FAIL|checks:|^\| ag|^\| matmul" "$OUT/mp_$stage/launch.log" | cut -c1-220
      grep -h "TIME" "$OUT/mp_$stage/mp_gpu_p0.log" | cut -c1-120
      [ -d "$OUT/mp_$stage/trace_p0" ] && python3 scripts/perfetto_timeline.py "$OUT/mp_$stage/trace_p0" --count 400 \
        > "$OUT/mp_$stage/timeline_p0.txt" 2>&1
    done
    timeout "$(upto 110)" python3 -m ficco_jax bench --no-windowed --op all --shape 8192,8192,10240 --shape 2048,8192,28672 \
      --schedules dma/direct/c1,dma/direct/c4/grouped,dma/direct/c8/grouped --out "$OUT/bench1p" 2>"$OUT/bench1p.err" \
      | grep -E "^\| (ag|matmul)" | cut -c1-250
    for red in scalar vector; do
      [ "$(left)" -gt 35 ] || break
      extra=(); [ "$red" = scalar ] && extra=(env FICCO_REDUCE_SCALAR=1)
      "${extra[@]}" timeout "$(upto 45)" python3 -m ficco_jax bench --no-windowed --op matmul_rs --shape 8192,8192,10240 \
        --schedules dma/direct/c1,dma/direct/c4/grouped --out "$OUT/bench_rs_$red" 2>"$OUT/bench_rs_$red.err" \
        | grep -E "^\| matmul" | cut -c1-250
      echo "bench ($red sum) rc=$?"
    done
    ;;
  s5e)  # the record of session 5 on 2 GPUs (issue 9): 2 processes, every check and three anchor shapes timed, then one
         # process on the same shapes and schedules, same lease
    DEADLINE=${DEADLINE:-330}
    build
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 150); FICCO_MP_NPROC=$(nvidia-smi -L | wc -l) FICCO_MP_BUDGET_S=$((B - 20)) OUT="$OUT/mp" \
      FICCO_MP_TIMED=llama70b_qkv_M8k,llama70b_mlp_up_M8k,llama70b_mlp_up_M2k timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "FAIL|SKIP|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    grep -h "TIME" "$OUT/mp/mp_gpu_p0.log" | cut -c1-120
    timeout "$(upto 160)" python3 -m ficco_jax bench --no-windowed --op all --shape 8192,8192,10240 --shape 8192,8192,28672 \
      --shape 2048,8192,28672 --schedules dma/direct/c1,dma/direct/c2/grouped,dma/direct/c4/grouped,dma/direct/c8/grouped \
      --out "$OUT/bench1p" 2>"$OUT/bench1p.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    ;;
  s5f)  # session 5's last 2-GPU call, on the final code (copies back on cudaMemcpyAsync): GPU tests, then s5e's record
    DEADLINE=${DEADLINE:-330}
    build
    timeout "$(upto 90)" python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    DEADLINE=$((DEADLINE - (SECONDS - T0))) T0=$SECONDS
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 130); FICCO_MP_NPROC=$(nvidia-smi -L | wc -l) FICCO_MP_BUDGET_S=$((B - 20)) OUT="$OUT/mp" \
      FICCO_MP_TIMED=llama70b_qkv_M8k,llama70b_mlp_up_M8k,llama70b_mlp_up_M2k timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1
    echo "mp_gpu rc=$?"; grep -E "FAIL|SKIP|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    timeout "$(upto 140)" python3 -m ficco_jax bench --no-windowed --op all --shape 8192,8192,10240 --shape 8192,8192,28672 \
      --shape 2048,8192,28672 --schedules dma/direct/c1,dma/direct/c2/grouped,dma/direct/c4/grouped,dma/direct/c8/grouped \
      --out "$OUT/bench1p" 2>"$OUT/bench1p.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    ;;
  s5x4)  # if the 4-GPU kind is lent late in session 5 with ~4 device minutes left: the NCCL contention pair (issue 4), the
          # reduce-scatter with the 16-byte sum at tp=4 (3), 4 processes quick with the staging copy on XLA's stream (9)
    DEADLINE=${DEADLINE:-200}
    build
    timeout "$(upto 70)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"
    grep -E '^\{' "$OUT/char/contention_torch.log" | cut -c1-700
    timeout "$(upto 50)" python3 -m ficco_jax bench --no-windowed --op matmul_rs --shape 8192,8192,10240 \
      --schedules dma/direct/c1,dma/direct/c4/grouped --out "$OUT/bench_rs" 2>"$OUT/bench_rs.err" | grep -E "^\| matmul" | cut -c1-250
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 60); FICCO_MP_QUICK=1 FICCO_MP_BUDGET_S=$((B - 15)) OUT="$OUT/mp" timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1; echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    ;;
  s5acc)  # issue 5 on 2 GPUs with the last device minutes: the held-out check of `auto`, which at tp=2 now uses the
           # h200x4 profile (nearest group size of the same GPU); as many held-out cases as the budget allows
    DEADLINE=${DEADLINE:-190}
    build
    timeout "$(upto 175)" python3 -m ficco_jax accuracy --axis-size "$(nvidia-smi -L | wc -l)" --top 1 \
      --budget-s "$(( $(left) - 45 ))" --out "$OUT/acc" 2>"$OUT/acc/accuracy.err" | tail -30
    ;;
  s6x4a)  # for the next 4-GPU lease, first call: what session 5's fixes (16-byte reduce-scatter sum, staging copy on
           # XLA's stream) do at tp=4: the anchor bench beside PyTorch's async-TP (issue 3), then NCCL contention (4)
    DEADLINE=${DEADLINE:-580}
    build
    anchors_torch 100
    timeout "$(upto 330)" python3 -m ficco_jax bench --no-windowed --plot \
      --schedules dma/direct/c1,dma/direct/c2,dma/direct/c2/grouped,dma/direct/c4/grouped,dma/direct/c8/grouped \
      --out "$OUT/bench" 2>"$OUT/bench.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    timeout "$(upto 80)" python3 -m torch.distributed.run --nproc-per-node="$(nvidia-smi -L | wc -l)" scripts/contention_torch.py \
      --out "$OUT/char" > "$OUT/char/contention_torch.log" 2>&1; echo "contention_torch rc=$?"
    grep -E '^\{' "$OUT/char/contention_torch.log" | cut -c1-700
    ;;
  s6x4b)  # second call: 4 processes with a timeline (issue 9), the example with cuDNN attention and its communication-free
           # bound (7), then the held-out check of auto with what is left (5)
    DEADLINE=${DEADLINE:-580}
    build
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 200); FICCO_MP_BUDGET_S=$((B - 20)) OUT="$OUT/mp" FICCO_MP_TRACE=ag_matmul:dma/direct/c1:8192,8192,10240 \
      FICCO_MP_TIMED=llama70b_qkv_M8k,llama70b_mlp_up_M8k,llama70b_mlp_up_M2k timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1; echo "mp_gpu rc=$?"; grep -E "FAIL|SKIP|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    timeout "$(upto 180)" python3 -X faulthandler examples/tp_transformer.py --preset llama70b-layer --attention cudnn --compare \
      --comm-free-bound --steps 4 > "$OUT/tp_cudnn_tp4.log" 2>&1; echo "example rc=$?"
    grep -v "^\[" "$OUT/tp_cudnn_tp4.log" | grep -v "^ok " | cut -c1-220 | tail -16
    [ "$(left)" -gt 90 ] && timeout "$(upto 400)" python3 -m ficco_jax accuracy --top 1 --budget-s "$(( $(left) - 50 ))" \
      --out "$OUT/acc" 2>"$OUT/acc/accuracy.err" | tail -40
    ;;
  s6x4c)  # third call of session 6: async-TP beside our bench in one call (issue 3: s6x4a skipped it, see
           # anchors_torch), the held-out shapes s6x4b's budget cut (5), then 4 processes timing the same
           # schedules as the bench with a timeline of the worst 4-process case, matmul_rs mlp_up M2k (9)
    DEADLINE=${DEADLINE:-585}
    build
    anchors_torch 100
    timeout "$(upto 170)" python3 -m ficco_jax bench --no-windowed --shape llama70b_mlp_up_M8k --shape llama70b_qkv_M8k \
      --shape llama70b_mlp_up_M2k --shape gpt3_175b_mlp_M4k \
      --schedules dma/direct/c1,dma/direct/c2/grouped,dma/direct/c4/grouped,dma/direct/c8/grouped \
      --out "$OUT/bench" 2>"$OUT/bench.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    timeout "$(upto 170)" python3 -m ficco_jax accuracy --top 1 --budget-s 140 --shape gpt3_qkv_M16k --shape gpt3_mlp_M1k \
      --shape gpt3_mlp_M8k --shape mixtral_o_M4k --shape mixtral_expert_M2k --shape mixtral_expert_M32k \
      --out "$OUT/acc" 2>"$OUT/acc/accuracy.err" | tail -18
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    B=$(upto 130); FICCO_MP_BUDGET_S=$((B - 15)) OUT="$OUT/mp" FICCO_MP_QUICK=1 FICCO_MP_TIMED=llama70b_mlp_up_M2k \
      FICCO_MP_SCHEDULES=dma/direct/c1,dma/direct/c2/grouped,dma/direct/c8/grouped \
      FICCO_MP_TRACE=matmul_rs:dma/direct/c8/grouped:2048,8192,28672 timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1; echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    ;;
  s6x4d)  # last call of session 6 (issue 9): after the wait-once fix, 4 processes and then one process time the same
           # schedules at the same shapes in one call (like for like), with a 4-process timeline of matmul_rs M2k
    DEADLINE=${DEADLINE:-540}
    build
    command -v python >/dev/null || ln -sf "$(command -v python3)" /usr/local/bin/python
    S=dma/direct/c1,dma/direct/c2/grouped,dma/direct/c8/grouped
    B=$(upto 230); FICCO_MP_BUDGET_S=$((B - 20)) OUT="$OUT/mp" FICCO_MP_SCHEDULES=$S \
      FICCO_MP_TIMED=llama70b_mlp_up_M2k,llama70b_qkv_M8k,llama70b_mlp_up_M8k \
      FICCO_MP_TRACE=matmul_rs:dma/direct/c8/grouped:2048,8192,28672 timeout "$B" bash scripts/mp_gpu_launch.sh \
      > "$OUT/mp/launch.log" 2>&1; echo "mp_gpu rc=$?"; grep -E "FAIL|checks:|^\| ag|^\| matmul" "$OUT/mp/launch.log" | cut -c1-220
    timeout "$(upto 200)" python3 -m ficco_jax bench --no-windowed --shape llama70b_mlp_up_M2k --shape llama70b_qkv_M8k \
      --shape llama70b_mlp_up_M8k --schedules "$S" --out "$OUT/bench" 2>"$OUT/bench.err" | grep -E "^\| (ag|matmul)" | cut -c1-250
    ;;
  s6x4e)  # the last device minutes of session 6: the one held-out case s6x4c's budget cut (issue 5); a one-process
           # timeline of matmul_rs qkv M8k at tp=4, to see whether the pulls (MemcpyP2P) bound it (issue 3); the GPU tests
    DEADLINE=${DEADLINE:-250}
    build
    timeout "$(upto 120)" python3 -m ficco_jax accuracy --top 1 --shape mixtral_expert_M32k --out "$OUT/acc" \
      --resume benchmarks/2026-11-22-session6/s6bc_accuracy_merged.json 2>"$OUT/acc/accuracy.err" | tail -6
    timeout "$(upto 60)" python3 scripts/trace_op.py matmul_rs dma/direct/c2/grouped 8192 8192 10240 20 \
      --jax-profiler "$OUT/trace_rs_qkv" > "$OUT/trace_rs_qkv.log" 2>&1; echo "trace rc=$?"
    python3 scripts/perfetto_timeline.py "$OUT/trace_rs_qkv" --count 40 2>&1 | head -30
    mkdir -p "$OUT/ingress"; timeout "$(upto 40)" python3 scripts/ingress_probe.py --out "$OUT/ingress" > "$OUT/ingress/log" 2>&1
    echo "ingress rc=$?"; tail -6 "$OUT/ingress/log"
    timeout "$(upto 110)" python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    ;;
  s6x2)  # if only 2 GPUs are lent: the ingress probe (pull vs push vs both, issue 3), then the GPU tests of the final code
    DEADLINE=${DEADLINE:-200}
    mkdir -p "$OUT/ingress"; timeout "$(upto 40)" python3 scripts/ingress_probe.py --out "$OUT/ingress" > "$OUT/ingress/log" 2>&1
    echo "ingress rc=$?"; tail -6 "$OUT/ingress/log"
    build
    timeout "$(upto 150)" python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    ;;
  s7x2a)  # session 7, 2 x H200 (kinds over 2 GPUs withheld): transfer=push (issues 3, 8) — the GPU tests, pulled and
          # pushed, then each collective alone: NCCL vs copy engines pulling vs pushing
    DEADLINE=${DEADLINE:-500}
    build
    timeout "$(upto 200)" python3 -m pytest tests/gpu -x -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    for c in all_gather reduce_scatter all_to_all; do
      timeout "$(upto 80)" python3 scripts/a2a_vs_nccl.py --collective $c --sizes 1,4,16,64 --overlap-sizes '' \
        --schedules default,dma/direct/c1/push --budget-s 70 --out "$OUT/a2a" 2>"$OUT/a2a/$c.err" | tail -13
    done
    ;;
  s7x2b)  # session 7, 2 x H200: the GPU tests (s7x2a's stopped at a test's own bug), then the anchor shapes' ag_matmul /
          # matmul_rs and the MoE pair, pulled vs pushed (issues 3, 8)
    DEADLINE=${DEADLINE:-540}
    build
    timeout "$(upto 150)" python3 -m pytest tests/gpu -q 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
    pp=""; for s in dma/direct/c1 dma/direct/c2 dma/direct/c4 dma/direct/c2/grouped; do pp="$pp,$s,$s/push"; done
    timeout "$(upto 300)" python3 -m ficco_jax bench --op all --shape llama70b_mlp_up_M8k --shape llama70b_qkv_M8k \
      --shape llama70b_mlp_up_M2k --shape gpt3_175b_mlp_M4k --no-windowed --schedules "none$pp" --out "$OUT/bench" \
      2>"$OUT/bench.err" | tail -30
    timeout "$(upto 150)" python3 -m ficco_jax bench --op moe --no-windowed \
      --schedules none,dma/direct/c1,dma/direct/c1/push,dma/direct/c2,dma/direct/c2/push --out "$OUT/moe" \
      2>"$OUT/moe.err" | tail -12
    ;;
  s7x2c)  # session 7, 2 x H200: an h200x2 profile (issue 5 asks for calibrated profiles; none shipped for 2 GPUs), then
          # the held-out check at tp=2 with it, as far as the time allows (s7x2b's bench is held out too: replay)
    DEADLINE=${DEADLINE:-540}
    build
    timeout "$(upto 240)" python3 -m ficco_jax calibrate --name h200x2 --out "$OUT/calib/h200x2.json" \
      2>"$OUT/calib/calibrate.err" | tail -25
    [ -f "$OUT/calib/h200x2.json" ] || { echo "no profile"; tail -20 "$OUT/calib/calibrate.err"; exit 1; }
    timeout "$(upto 280)" python3 -m ficco_jax accuracy --top 1 --profile "$OUT/calib/h200x2.json" \
      --budget-s $(( $(left) - 60 )) --out "$OUT/acc" 2>"$OUT/acc/accuracy.err" | tail -12
    ;;
  s7x2d)  # session 7, 2 x H200: the held-out check with the shipped h200x2 profile (auto's own on this machine), live
    DEADLINE=${DEADLINE:-560}
    build
    timeout "$(upto 600)" python3 -m ficco_jax accuracy --top 1 --budget-s $(( $(left) - 100 )) --out "$OUT/acc" \
      2>"$OUT/acc/accuracy.err" | tail -8
    ;;
  s7x2e)  # session 7's last device minutes: the 8 held-out cases s7x2d's budget cut, resumed
    DEADLINE=${DEADLINE:-195}
    build
    timeout "$(upto 200)" python3 -m ficco_jax accuracy --top 1 --budget-s $(( $(left) - 70 )) --out "$OUT/acc" \
      --resume benchmarks/2026-11-22-session7/s7x2d_accuracy.json 2>"$OUT/acc/accuracy.err" | tail -6
    ;;
  x4next)  # the first call of the next session lent nvidia-h200-x4 (issues 3, 5, 8): PyTorch async-TP, then the four
           # large anchors pulled and pushed in the same call, the collectives pulled vs pushed vs NCCL, the 40th held-out case
    DEADLINE=${DEADLINE:-570}
    build
    anchors_torch 100
    pp=""; for s in dma/direct/c1 dma/direct/c2/grouped dma/direct/c8/grouped; do pp="$pp,$s,$s/push"; done
    timeout "$(upto 250)" python3 -m ficco_jax bench --op all --shape llama70b_mlp_up_M8k --shape llama70b_qkv_M8k \
      --shape llama70b_mlp_up_M2k --shape gpt3_175b_mlp_M4k --no-windowed --schedules "none$pp" --out "$OUT/bench" \
      2>"$OUT/bench.err" | tail -14
    for c in all_gather reduce_scatter all_to_all; do
      timeout "$(upto 45)" python3 scripts/a2a_vs_nccl.py --collective $c --sizes 4,16 --overlap-sizes '' \
        --schedules default,dma/direct/c1/push --budget-s 35 --out "$OUT/a2a" 2>"$OUT/a2a/$c.err" | tail -6
    done
    timeout "$(upto 80)" python3 -m ficco_jax accuracy --top 1 --shape mixtral_expert_M32k --out "$OUT/acc" \
      --resume benchmarks/2026-11-22-session6/s6bc_accuracy_merged.json 2>"$OUT/acc/accuracy.err" | tail -4
    ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
