"""Decode context parallelism over real GPUs: one DCP rank a process and a GPU, the ranks' outputs
and LSEs all-gathered through ``torch.distributed`` (NCCL), merged, and set beside the simulated
run (``harness.dcp``: every rank on one device). Run under torchrun, one process a rank:

    torchrun --nproc-per-node 2 -m conformance.harness.dcp_distributed --backend triton --case 'gqa-dcp2:3000+1,1+1'

Each process draws the case's data (the same seed: the same numbers), runs the step once as
numerics does (its pool is the oracle's), then its own rank's forward; rank 0 prints one JSON
line per case: the largest difference between the distributed and the simulated merge, and the
simulated run's verdict (``dcp_findings``). The case's ``dcpN`` must equal the process count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.harness.dcp import dcp_findings, rank_step
from conformance.harness.step import prepare_case, run_step
from reference_engine.dcp_attention import merge


def distributed_merge(prepared, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's rank forward, every rank's all-gathered (NCCL), merged."""
    out, lse, _ = rank_step(prepared, rank)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous())
    dist.all_gather(lses, lse.contiguous())
    return merge(outs, lses, torch.float64)


def usage_error(message: str) -> None:
    """One line on stderr, exit 2 (the project's usage error)."""
    print(f"dcp_distributed: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--case", action="append", required=True)
    args = parser.parse_args()
    if "RANK" not in os.environ or not torch.cuda.is_available():
        usage_error("run it under torchrun, one process a GPU (the module docstring)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    backend_cls = registry.load(args.backend)
    for text in args.case:
        case = parse_case(text)
        if case.dcp != world:
            usage_error(f"{text}: dcp{case.dcp} needs {case.dcp} processes, not {world}")
        prepared = prepare_case(backend_cls, case, device)
        run_step(prepared, with_host_lengths=True)
        merged, merged_lse = distributed_merge(prepared, rank, world)
        simulated = [rank_step(prepared, other)[:2] for other in range(world)]
        expected, expected_lse = merge([out for out, _ in simulated], [lse for _, lse in simulated], torch.float64)
        problem, metrics = dcp_findings(prepared)
        if rank == 0:
            line = {
                "case": case.id,
                "backend": args.backend,
                "gpus": [torch.cuda.get_device_name(index) for index in range(world)],
                "max_output_difference": float((merged - expected).abs().max()),
                "max_lse_difference": float((merged_lse - expected_lse).abs().nan_to_num(0.0).max()),
                "simulated_verdict": "PASS" if problem is None else "FAIL",
                "simulated_problem": problem,
                **metrics,
            }
            print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
