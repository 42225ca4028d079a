"""Sweep triton_mla's tiling on the GPU: ``python -m conformance.tuning.tune_triton_mla``.

For each MLA (512 + 64) decode / spec-verify shape: FlashMLA's time, then ours for each way of
reading a tile (masked loads per page, or TMA where the tile allows it), tiling (rows per program,
BLOCK_N, warps, stages) and split target (programs wanted per SM), then the Gluon kernel
(``mla_gluon``, Hopper, 64-row tiles) for each tile size and ring depth. Prints forward µs (CUDA
events, L2 flushed) and the ratio to FlashMLA in the same run. ``--gluon`` sweeps the Gluon kernel
only. ``--fp8`` sweeps the masked-load tilings over an fp8 e4m3 latent (``FP8_CASES``), against
triton_mla's own time over the bf16 latent of the same shape (FlashMLA's SM90 fp8 decode takes an
fp8 query only); its maxdiff is then against triton_mla's output at the shipped tiling."""

import sys

import torch

from backends.triton import mla_backend
from conformance.tuning.timed_case import Sweep

CASES = {
    "decode b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+1x64",
    "verify q4 b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+4x64",
    "decode b256 ctx4096": "mla-h128-d512+64-bf16-p64:4096+1x256",
    "verify q8 b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+8x64",
    "h16 decode b64 ctx4096": "mla-h16-d512+64-bf16-p64:4096+1x64",
    "h16 verify q4 b64 ctx4096": "mla-h16-d512+64-bf16-p64:4096+4x64",
}
TILINGS = [
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 8, 4),
    (32, 64, 8, 2),
    (32, 64, 4, 2),
]  # rows, BLOCK_N, warps, stages
PROGRAMS_PER_SM = (1, 2, 4)
FP8_CASES = {
    "fp8 decode b64 ctx4096": "mla-h128-d512+64-bf16-fp8e4m3-p64:4096+1x64",
    "fp8 decode b64 ctx32k": "mla-h128-d512+64-bf16-fp8e4m3-p64:32768+1x64",
    "fp8 verify q4 b64 ctx4096": "mla-h128-d512+64-bf16-fp8e4m3-p64:4096+4x64",
}
# The fp8 tile is widened to fp16 in registers: fewer rows or keys a tile spill less.
FP8_TILINGS = [
    (64, 64, 8, 2),
    (64, 32, 8, 2),
    (32, 64, 8, 2),
    (32, 32, 8, 2),
    (32, 32, 8, 3),
    (32, 32, 4, 2),
    (16, 32, 4, 2),
]
READS = {"page": mla_backend.PAGE, "tma": mla_backend.TMA}
GLUON_TILINGS = [(64, 2, 512), (64, 2, 64), (64, 2, 128)]  # BLOCK_N, stages, latent columns per copy


def sweep_gluon(sweep: Sweep) -> None:
    """The Gluon kernel's tile sizes and ring depths, where it serves the shape."""
    from backends.triton import mla_gluon

    timed, shipped = sweep.timed, (mla_gluon.BLOCK_N, mla_gluon.NUM_STAGES, mla_gluon.LATENT_CHUNK)
    tiles = mla_backend.tiling(timed.case.spec.num_heads, timed.metadata.decode_q)
    if tiles.block_m != mla_gluon.ROWS:
        print(f"{sweep.name:24s} gluon: not served ({tiles.block_m}-row tiles)", flush=True)
        return
    shipped_tile_read, mla_backend.tile_read = mla_backend.tile_read, lambda *args: mla_backend.TMA
    print(sweep.line("triton tma (before the Gluon kernel)"), flush=True)
    mla_backend.tile_read = shipped_tile_read
    for block_n, stages, chunk in GLUON_TILINGS:
        mla_gluon.BLOCK_N, mla_gluon.NUM_STAGES, mla_gluon.LATENT_CHUNK = block_n, stages, chunk
        timed.backend._descriptors = None  # a new box
        print(sweep.line(f"gluon block_n={block_n:3d} stages={stages} latent_chunk={chunk}"), flush=True)
    mla_gluon.BLOCK_N, mla_gluon.NUM_STAGES, mla_gluon.LATENT_CHUNK = shipped
    timed.backend._descriptors = None


_SETTINGS = ("ROWS_PER_PROGRAM", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "PROGRAMS_PER_MULTIPROCESSOR")


def _settings() -> dict:
    return {name: getattr(mla_backend, name) for name in _SETTINGS}


def _restore(settings: dict) -> None:
    for name, value in settings.items():
        setattr(mla_backend, name, value)


def main(names: list[str]) -> None:
    device = torch.device("cuda")
    shipped_tile_read = mla_backend.tile_read
    gluon_only, fp8 = "--gluon" in names, "--fp8" in names
    shipped = _settings()
    cases = FP8_CASES if fp8 else CASES
    for name in [name for name in names if not name.startswith("--")] or cases:
        if fp8:  # against our own bf16 time: the case without its cache dtype
            sweep = Sweep(name, cases[name], "triton_mla", "triton_mla", device, cases[name].replace("-fp8e4m3", ""))
        else:
            sweep = Sweep(name, cases[name], "flashmla", "triton_mla", device)
            sweep_gluon(sweep)
        if gluon_only:
            continue
        metadata, heads = sweep.timed.metadata, sweep.timed.case.spec.num_heads
        reads, tilings = ({"page": READS["page"]}, FP8_TILINGS) if fp8 else (READS, TILINGS)
        per_sms = PROGRAMS_PER_SM[:2] if fp8 else PROGRAMS_PER_SM
        settings = [(read, tiling, per_sm) for read in reads for tiling in tilings for per_sm in per_sms]
        for read, (rows, block_n, warps, stages), per_sm in settings:
            mla_backend.ROWS_PER_PROGRAM, mla_backend.BLOCK_N, mla_backend.NUM_WARPS = rows, block_n, warps
            mla_backend.NUM_STAGES = dict.fromkeys(READS.values(), stages)
            mla_backend.PROGRAMS_PER_MULTIPROCESSOR = dict.fromkeys(READS.values(), per_sm)
            tiles = mla_backend.tiling(heads, metadata.decode_q)
            if READS[read] == mla_backend.TMA and tiles.block_m < mla_backend.TMA_MIN_ROWS:
                continue
            mla_backend.tile_read = lambda *args, chosen=READS[read]: chosen
            splits = sweep.timed.backend.splits_for(
                metadata.num_reqs, metadata.decode_q, heads // tiles.heads_per_program, per_sm
            )
            print(
                sweep.line(
                    f"{read:4s} rows={rows:3d} block_n={block_n:3d} warps={warps} stages={stages} per_sm={per_sm} "
                    f"splits={splits:2d}"
                ),
                flush=True,
            )
        mla_backend.tile_read = shipped_tile_read
        _restore(shipped)  # the next shape's vendor line may be triton_mla itself (--fp8)
        del sweep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
