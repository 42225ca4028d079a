"""Sweep triton's split-KV decode launch on the GPU:
``python -m conformance.tuning.tune_triton [--splits-only] [CASE NAME ...]``.

For each decode / spec-verify shape of the issue's table: FlashInfer's time, then ours for every
(warps, stages, BLOCK_N) at the default split target, then every split target (programs wanted
per SM) at the best of those (``--splits-only``: at the backend's own launch). Prints forward µs
(CUDA events, L2 flushed) and the ratio to FlashInfer in the same run."""

import itertools
import sys

import torch

from backends.triton import backend as triton_backend
from conformance.tuning.timed_case import Sweep, TimedCase

CASES = {
    "decode b64 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+1x64",
    "decode b256 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+1x256",
    "verify q2 b256 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+2x256",
    "verify q4 b64 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+4x64",
    "verify q8 b256 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+8x256",
    "decode b8 ctx4096": "gqa-h32/8-d128-bf16-p16:4096+1x8",
    "decode b1 ctx32k": "gqa-h32/8-d128-bf16-p16:32768+1",
    # The bench shapes that missed 1.05x (docs/performance.md): small batches and fp8 caches.
    "verify q8 b1 ctx512": "gqa-h32/8-d128-bf16-p16:512+8",
    "verify q4 b1 ctx32k": "gqa-h32/8-d128-bf16-p16:32768+4",
    "verify q4 b8 ctx32k": "gqa-h32/8-d128-bf16-p16:32768+4x8",
    "decode b64 ctx32k": "gqa-h32/8-d128-bf16-p16:32768+1x64",
    "verify q4 b64 ctx32k": "gqa-h32/8-d128-bf16-p16:32768+4x64",
    "fp8 decode b64 ctx4096": "gqa-h32/8-d128-bf16-fp8e4m3-p16:4096+1x64",
    "fp8 decode b64 ctx32k": "gqa-h32/8-d128-bf16-fp8e4m3-p16:32768+1x64",
    "fp8 verify q4 b64 ctx4096": "gqa-h32/8-d128-bf16-fp8e4m3-p16:4096+4x64",
    "fp8 verify q4 b64 ctx32k": "gqa-h32/8-d128-bf16-fp8e4m3-p16:32768+4x64",
}
LAUNCHES = list(itertools.product((4, 8), (2, 3, 4), (32, 64, 128)))  # warps, stages, BLOCK_N
PROGRAMS_PER_SM = (1, 2, 4, 8, 16, 32)


OWN_TABLES = {  # programs wanted per SM, by decode variant: the bf16 table and the fp8 cache's
    table: dict(getattr(triton_backend, table))
    for table in ("DECODE_PROGRAMS_PER_MULTIPROCESSOR", "FP8_CACHE_PROGRAMS_PER_MULTIPROCESSOR")
}


def set_launch(timed: TimedCase, warps: int, stages: int, block_n: int, programs_per_sm: int | None) -> None:
    """None: the backend's own programs per SM."""
    triton_backend.DECODE_NUM_WARPS, triton_backend.DECODE_NUM_STAGES = warps, stages
    timed.backend.decode_block_n = block_n
    for table, own in OWN_TABLES.items():
        setattr(triton_backend, table, own if programs_per_sm is None else dict.fromkeys(own, programs_per_sm))


def main(arguments: list[str]) -> None:
    device = torch.device("cuda")
    splits_only = "--splits-only" in arguments
    names = [argument for argument in arguments if argument != "--splits-only"]
    for name in names or CASES:
        sweep = Sweep(name, CASES[name], "flashinfer", "triton", device)
        results = {}
        own = (triton_backend.DECODE_NUM_WARPS, triton_backend.DECODE_NUM_STAGES, sweep.timed.backend.decode_block_n)
        for warps, stages, block_n in [own] if splits_only else LAUNCHES:
            set_launch(sweep.timed, warps, stages, block_n, None)
            line = sweep.line(f"warps={warps} stages={stages} block_n={block_n:3d} per_sm=default")
            print(line, flush=True)
            if " µs " in line:
                results[(warps, stages, block_n)] = float(line.split(":")[1].split("µs")[0])
        best = min(results, key=results.get)
        metadata = sweep.timed.metadata
        for per_sm in PROGRAMS_PER_SM:
            set_launch(sweep.timed, *best, per_sm)
            splits = sweep.timed.backend.splits_for(
                metadata.num_reqs, metadata.decode_q, sweep.timed.backend.spec.num_kv_heads, per_sm
            )
            print(
                sweep.line(f"warps={best[0]} stages={best[1]} block_n={best[2]:3d} per_sm={per_sm:2d} splits={splits}"),
                flush=True,
            )
        del sweep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
