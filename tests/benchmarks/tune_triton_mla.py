"""Sweep triton_mla's tiling on the GPU: ``python tests/benchmarks/tune_triton_mla.py``.
Prints forward µs (CUDA events, L2 flushed) per setting for decode and spec-verify q=4."""
import itertools

import torch

from backends.triton import mla_backend
from conformance.inputs.cases import parse_case
from conformance.checks.bench import _l2_flusher, time_gpu, traffic
from conformance.inputs.harness import poisoned_output, prepare_case

CASES = {"decode b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+1x64", "verify q4 b64 ctx4096": "mla-h128-d512+64-bf16-p64:4096+4x64"}


def main() -> None:
    device = torch.device("cuda")
    flush = _l2_flusher(device)
    for (name, text), rows, block_n, warps, stages in itertools.product(CASES.items(), (16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3)):
        mla_backend.ROWS_PER_PROGRAM, mla_backend.BLOCK_N, mla_backend.NUM_WARPS, mla_backend.NUM_STAGES = rows, block_n, warps, stages
        case = parse_case(text)
        prepared = prepare_case(mla_backend.TritonMLABackend, case, device, random_on_device=True)
        batch = prepared.batch
        key, _, slots = batch.step_rows()
        prepared.backend.write_kv(prepared.kv_cache, key, None, slots)
        metadata = prepared.backend.build(batch.common_metadata())
        query = torch.cat([batch.query, torch.zeros_like(batch.query[:3])])
        out = poisoned_output(batch)
        try:
            micros = time_gpu(lambda: prepared.backend.forward(query, prepared.kv_cache, metadata, out), flush)
        except Exception as error:  # noqa: BLE001 - out of resources for a setting is a result here
            print(f"{name:24s} rows={rows:3d} block_n={block_n:3d} warps={warps} stages={stages}: {type(error).__name__}")
            continue
        print(f"{name:24s} rows={rows:3d} block_n={block_n:3d} warps={warps} stages={stages}: {micros:8.1f} µs "
              f"{traffic(case)[0] / micros / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
