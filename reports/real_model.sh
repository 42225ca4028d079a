#!/usr/bin/env bash
# The README's real-model figures (SmolLM2-135M-Instruct, the prompt set), on a GPU machine where
# `conformance engine fetch-model smollm2-135m` has put the model in the cache. From the project root:
#
#   bash reports/real_model.sh RUNS
#
# For each backend in BACKENDS (default "triton flashinfer"): `engine run` with the n-gram drafter
# (the generated text, and host syncs counted by the detector), greedy equality of speculation with
# plain decoding in bf16 (`reference_engine.equality`, divergences explained by the fp32 margin), and
# REPEATS (default 3) runs of `engine bench`: sync vs async, plain and with each drafter of DRAFTERS.
set -uo pipefail
runs=${1:?usage: real_model.sh RUNS_DIR}
backends=(${BACKENDS:-triton flashinfer})
drafters=${DRAFTERS:-ngram,layer-skip:22}
repeats=${REPEATS:-3}
common=(--model smollm2-135m --num-prompts 6 --max-tokens 128)
mkdir -p "$runs"
for backend in "${backends[@]}"; do
  python -m conformance engine run "${common[@]}" --backend "$backend" --drafter ngram --spec-tokens 3 --detect-syncs \
    --json "$runs/run-$backend.json" >"$runs/run-$backend.log" 2>&1
  python -m reference_engine.equality "${common[@]}" --backend "$backend" --dtype bf16 --k 3 --drafters "$drafters" \
    --json "$runs/equality-$backend.json" >"$runs/equality-$backend.log" 2>&1
  for repeat in $(seq "$repeats"); do
    python -m conformance engine bench "${common[@]}" --backend "$backend" --spec-tokens 0 \
      --json "$runs/bench-$backend-plain-$repeat.json" >"$runs/bench-$backend-plain-$repeat.log" 2>&1
    python -m conformance engine bench "${common[@]}" --backend "$backend" --spec-tokens 3 --drafters "$drafters" \
      --json "$runs/bench-$backend-spec-$repeat.json" >"$runs/bench-$backend-spec-$repeat.log" 2>&1
  done
done
