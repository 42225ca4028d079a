"""Sweep triton_mla's tiling on the GPU: ``python tests/benchmarks/tune_triton_mla.py``.

For each MLA (128 heads, 512 + 64) decode / spec-verify shape: FlashMLA's time, then ours for each
tiling (rows per program, BLOCK_N, warps, stages) and split target (programs wanted per SM).
Prints forward µs (CUDA events, L2 flushed) and the ratio to FlashMLA in the same run."""
import sys

import torch

from backends.triton import mla_backend
from tests.benchmarks.tuning import Sweep

CASES = {
    "decode b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+1x64",
    "verify q4 b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+4x64",
    "decode b256 ctx4096": "mla-h128-d512+64-bf16-p64:4096+1x256",
    "verify q8 b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+8x64",
}
TILINGS = [(64, 64, 8, 3), (64, 32, 8, 3), (64, 64, 8, 2), (32, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 3)]  # rows, BLOCK_N, warps, stages
PROGRAMS_PER_SM = (1, 2, 4, 8)


def main(names: list[str]) -> None:
    device = torch.device("cuda")
    for name in names or CASES:
        sweep = Sweep(name, CASES[name], "flashmla", "triton_mla", device)
        metadata = sweep.timed.metadata
        for (rows, block_n, warps, stages), per_sm in [(tiling, per_sm) for tiling in TILINGS for per_sm in PROGRAMS_PER_SM]:
            mla_backend.ROWS_PER_PROGRAM, mla_backend.BLOCK_N, mla_backend.NUM_WARPS, mla_backend.NUM_STAGES = rows, block_n, warps, stages
            mla_backend.PROGRAMS_PER_MULTIPROCESSOR = per_sm
            tiles = mla_backend.tiling(128, metadata.decode_q)
            splits = sweep.timed.backend.splits_for(metadata.num_reqs, metadata.decode_q, 128 // tiles.heads_per_program, per_sm)
            print(sweep.line(f"rows={rows:3d} block_n={block_n:3d} warps={warps} stages={stages} per_sm={per_sm} splits={splits:2d}"),
                  flush=True)
        del sweep
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main(sys.argv[1:])
