#!/usr/bin/env bash
# Regenerates reports/ from fresh runs of every built-in backend. On a GPU machine, from the
# project root:
#
#   bash reports/regenerate.sh checks RUNS   # every backend's checks, side by side, into RUNS/
#   bash reports/regenerate.sh bench RUNS    # the benchmark, REPEATS (3) runs alone on the GPU, into RUNS/
#   bash reports/regenerate.sh publish RUNS  # reports/ from what RUNS/ holds
#   bash reports/regenerate.sh all RUNS      # the three in turn
#   bash reports/regenerate.sh memory RUNS   # the memory check (compute-sanitizer), into reports/memory/
#   bash reports/regenerate.sh engine RUNS   # docs/engine.md's async-vs-sync table, into reports/engine/
#   bash reports/regenerate.sh kernels RUNS  # docs/performance.md's kernel table: REPEATS (3) runs, into RUNS/
#
# One after another the backends take over 20 minutes on an H100, so `checks` runs them side by
# side: one `conformance run --gpus` over its pool of isolated children, a backend's check over a
# few cases a unit of work, spread over every GPU of the machine (GPUS: all, or indices such as
# 0,1), JOBS slots (default 8 a GPU) sharing them. The benchmark runs alone: its timings need the GPU to itself. SUITE=full runs
# the full suite (reports/ publishes one suite: the standard one unless SUITE says otherwise);
# TIMEOUT bounds each case's time in seconds (--timeout, default 900); BACKENDS (space-separated)
# runs a subset.
set -uo pipefail
phase=${1:?usage: regenerate.sh checks|bench|publish|all RUNS_DIR}
runs=${2:?usage: regenerate.sh checks|bench|publish|all RUNS_DIR}
suite=${SUITE:-standard}
# Every built-in backend, from the registry (the one list of them).
all_backends=$(python -c "from backends.registry import BUILTIN_BACKENDS; print(' '.join(BUILTIN_BACKENDS))") || exit 2
# flash-attn-4 needs a CuTe DSL (nvidia-cutlass-dsl 4.5) that FlashInfer's own CuTe DSL kernels do
# not import with: FLASH_ATTN_PATH (PYTHONPATH entries) is added for flash_attn's processes only.
with_path() { if [[ $1 == flash_attn && -n ${FLASH_ATTN_PATH:-} ]]; then echo "PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$FLASH_ATTN_PATH"; else echo "PYTHONPATH=${PYTHONPATH:-}"; fi; }
backends=(${BACKENDS:-$all_backends})
for backend in "${backends[@]}"; do
  [[ " $all_backends " == *" $backend "* ]] || { echo "unknown backend $backend (one of: $all_backends)" >&2; exit 2; }
done
limit=(${TIMEOUT:+--timeout "$TIMEOUT"})  # a bound on each case
gpus=${GPUS:-all}
mkdir -p "$runs"

run_checks() {
  local gpu_count together=()
  gpu_count=$(python -c "import sys; from conformance.run.gpus import choose_gpus; print(len(choose_gpus(sys.argv[1])))" "$gpus") || exit 2
  # Side by side, CPU work (drawing data, compiling kernels) must not oversubscribe the cores.
  export OMP_NUM_THREADS=1
  for backend in "${backends[@]}"; do [[ $backend == flash_attn ]] || together+=("$backend"); done
  if ((${#together[@]})); then
    python -m conformance run --backend "$(IFS=,; echo "${together[*]}")" --suite "$suite" --gpus "$gpus" \
      --workers "${JOBS:-$((8 * gpu_count))}" --quiet ${limit[@]+"${limit[@]}"} --json "$runs/$suite.json" >"$runs/$suite.log" 2>&1
  fi
  # Its own run (see FLASH_ATTN_PATH), after the others, on the same GPUs.
  if [[ " ${backends[*]} " == *" flash_attn "* ]]; then
    env "$(with_path flash_attn)" python -m conformance run --backend flash_attn --suite "$suite" --gpus "$gpus" \
      --quiet ${limit[@]+"${limit[@]}"} --json "$runs/$suite-flash_attn.json" >"$runs/$suite-flash_attn.log" 2>&1
  fi
  return 0  # a run that found failures still wrote its results: publish shows them
}

# The memory check, one backend after another (its cost per backend is part of what it reports),
# published on its own into reports/memory/.
run_memory() {
  for backend in "${backends[@]}"; do
    env "$(with_path "$backend")" python -m conformance run --backend "$backend" --suite "$suite" --check memory --quiet \
      ${limit[@]+"${limit[@]}"} --json "$runs/memory-$backend.json" >"$runs/memory-$backend.log" 2>&1
  done
  python -m conformance.report.publish "$runs"/memory-*.json --out reports/memory
}

# REPEATS (3) runs back to back; publish takes each case's median run and keeps every run's times.
run_bench() {
  local i
  for ((i = 1; i <= ${REPEATS:-3}; i++)); do
    python -m conformance bench --backend triton,flashinfer,trtllm,triton_mla,flashmla,flashmla_sparse,triton_indexer,torch_naive,torch_indexer --quiet \
      --json "$runs/bench-$i.json" >"$runs/bench-$i.log" 2>&1
    # Its own process (see FLASH_ATTN_PATH), right after, on the same GPU; published in one table.
    env "$(with_path flash_attn)" python -m conformance bench --backend flash_attn --quiet \
      --json "$runs/bench-$i-flash_attn.json" >"$runs/bench-$i-flash_attn.log" 2>&1
  done
}

# docs/engine.md's async-vs-sync table (triton, k = 3, both drafters, tiny-d128 and 1b), alone on the
# GPU like the benchmark: reports/engine/async_vs_sync_<gpu>_<model>.json.
run_engine() {
  local gpu
  gpu=$(python -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())") || exit 2
  for model in tiny-d128 1b; do
    python -m conformance engine bench --backend triton --model "$model" --spec-tokens 3 --num-prompts 8 --prompt-len 128 \
      --max-tokens 128 --drafters scripted:random:0.7,layer-skip --detect-syncs --step-idle --repeats 3 \
      --json "$runs/async_vs_sync_${gpu}_$model.json" >"$runs/async_vs_sync_${gpu}_$model.log" 2>&1
    cp "$runs/async_vs_sync_${gpu}_$model.json" reports/engine/
  done
}

# docs/performance.md's kernel table: our kernels and the vendors' on the same shapes, side by side in
# one process per run, REPEATS runs back to back (RUNS/kernels-<i>.json); the table is their medians.
run_kernels() {
  local g=gqa-h32/8-d128-bf16-p16 m=mla-h128-d512+64-bf16-p64 s=mla-h16-d512+64-bf16-p64 i
  for ((i = 1; i <= ${REPEATS:-3}; i++)); do
    python -m conformance bench --backend triton,flashinfer,triton_mla,flashmla --quiet \
      --case $g:4096+1x64 --case $g:4096+1x256 --case $g:4096+2x256 --case $g:4096+4x64 --case $g:4096+8x256 \
      --case $m:4096+1x64 --case $m:4096+4x64 --case $m:4096+8x256 --case $s:4096+1x64 --case $s:4096+4x64 \
      --json "$runs/kernels-$i.json" >"$runs/kernels-$i.log" 2>&1 || return
  done
}

# Without bench runs in RUNS, the published bench section and files stay as they were.
publish() {
  local parts bench
  shopt -s nullglob
  parts=("$runs/$suite"-*.json) bench=("$runs"/bench*.json)
  shopt -u nullglob
  # ${a[@]+...}: an empty array under set -u on bash before 4.4
  python -m conformance.report.publish "$runs/$suite".json ${parts[@]+"${parts[@]}"} \
    ${bench[0]:+--bench "${bench[@]}"} --out reports
}

case "$phase" in
  checks) run_checks ;;
  bench) run_bench ;;
  publish) publish ;;
  all) run_checks; run_bench; publish ;;
  memory) run_memory ;;
  engine) run_engine ;;
  kernels) run_kernels ;;
  *) echo "unknown phase $phase (checks, bench, publish, all, memory, engine or kernels)" >&2; exit 2 ;;
esac
