#!/usr/bin/env bash
# Regenerates reports/ from fresh runs of every built-in backend. Run on a GPU machine from the
# project root: bash reports/regenerate.sh
set -uo pipefail
work=$(mktemp -d)
conformance run --backend torch_naive,triton,triton_mla,flashinfer,flashinfer_mla,trtllm,flashmla --quiet --json "$work/all.json"
# Exits 3 where its GPU cannot run it (Hopper); the JSON still records why.
conformance run --backend trtllm_mla --quiet --json "$work/trtllm_mla.json"
conformance bench --backend triton,flashinfer,trtllm,triton_mla,flashmla,torch_naive --quiet --json "$work/bench.json"
python -m conformance.publish "$work/all.json" "$work/trtllm_mla.json" --bench "$work/bench.json" --out reports
