"""Decode context parallelism over two GPUs: one rank a process and a GPU, the outputs and LSEs
all-gathered through NCCL (``conformance.harness.dcp_distributed``), equal to the simulated run
on one GPU, which passes. Skipped where fewer than two GPUs are visible."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

CASES = [
    "gqa-h32/8-d128-bf16-p16-dcp2:1000+1,100+1,3000+1",
    "gqa-h32/8-d128-bf16-p16-dcp2:0+1,700+1",
    "mla-h16-d512+64-bf16-fp8e4m3-p64-dcp2:1500+1,1+1",
]


@pytest.mark.parametrize("backend", ["triton", "torch_naive"])
def test_nccl_ranks_equal_the_simulated_ranks(backend):
    cases = [case for case in CASES if backend == "torch_naive" or not case.startswith("mla")]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["-m", "conformance.harness.dcp_distributed", "--backend", backend]
    command += [argument for case in cases for argument in ("--case", case)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(cases), completed.stdout
    for line in lines:
        assert line["simulated_verdict"] == "PASS", line
        assert line["max_output_difference"] == 0.0 and line["max_lse_difference"] == 0.0, line
