"""The memory check's sanitized child: one stage of one case, run under compute-sanitizer.

    python -m conformance.run.sanitized_case BACKEND CASE STAGE MAP.json

STAGE is ``step`` (one engine step, eager) or ``draft-loop`` (k = 4 draft steps under CUDA
graphs, as the draft-loop check runs them). The pool is fresh, never-written memory except the
slots the requests own and wrote (``PoolFill.FRESH``), so initcheck reports any read of a slot no
request wrote. MAP.json says which tensor each device address belongs to; it is written before
any backend call, because a memcheck fault ends the process.

The step stage runs with PyTorch's caching allocator off (the parent sets
PYTORCH_NO_CUDA_MEMORY_CACHING=1): each tensor is then its own allocation, and memcheck sees a
read one element past any of them. CUDA graph capture needs the caching allocator, so the
draft-loop stage runs with it on: memcheck sees there only accesses outside its segments.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from backends import registry
from conformance.inputs.allocation_map import AllocationMap
from conformance.inputs.cases import parse_case
from conformance.inputs.harness import PoolFill, prepare_case, run_step
from conformance.run.sanitizer import PHASE_MARKER

STAGES = ("step", "draft-loop")
DRAFT_STEPS = 4


@contextlib.contextmanager
def phase(name: str):
    """Mark the phase, and wait for its kernels, so the tool's reports print under its marker."""
    print(PHASE_MARKER + name, flush=True)
    yield
    torch.cuda.synchronize()


def run_step_stage(backend_cls, case, map_path: Path) -> None:
    where = AllocationMap()

    def record(name: str, tensor: torch.Tensor | None) -> None:
        where.add(name, tensor)
        where.save(map_path)

    with phase("history write_kv"):
        prepared = prepare_case(backend_cls, case, torch.device("cuda"), fill=PoolFill.FRESH, record=record)
    batch = prepared.batch
    where.allocations = [allocation for allocation in where.allocations if allocation.name != "KV pool"]
    where.add_pool(prepared.kv_cache, batch.block_table, batch.seq_lens, case.spec.block_size, batch.num_blocks)
    where.save(map_path)
    run_step(prepared, phase=phase, record=record)


def run_draft_loop_stage(backend_cls, case, map_path: Path) -> None:
    from conformance.checks.draft_loop import DraftLoop, run_one_graph_loop, run_rebuilt_loop

    with phase("draft-loop setup (history write_kv)"):
        loop = DraftLoop(backend_cls, case, DRAFT_STEPS, torch.device("cuda"), padding_row=True, fill=PoolFill.FRESH)
    buffers, drafted = loop.buffers, loop.drafted
    where = AllocationMap()
    where.add_pool(buffers.kv_cache, drafted.block_table, drafted.seq_lens, case.spec.block_size, buffers.num_blocks)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "query", "key", "value", "out"):
        where.add(name, getattr(buffers, name))
    where.save(map_path)
    one_graph = backend_cls.capabilities.draft_step_update
    with phase(f"draft loop k={DRAFT_STEPS}: warm-up, capture and replay"):
        (run_one_graph_loop if one_graph else run_rebuilt_loop)(loop)


def main(argv: list[str]) -> int:
    backend, case_id, stage, map_path = argv
    backend_cls, case = registry.load(backend), parse_case(case_id)
    (run_step_stage if stage == "step" else run_draft_loop_stage)(backend_cls, case, Path(map_path))
    print(PHASE_MARKER + "done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
