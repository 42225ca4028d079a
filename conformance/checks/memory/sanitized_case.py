"""The memory check's sanitized child: one stage of one case, run under compute-sanitizer.

    python -m conformance.checks.memory.sanitized_case BACKEND CASE STAGE OUT.json

STAGE is ``step`` (one engine step, eager), ``draft-loop`` (k = 4 draft steps under CUDA graphs,
as the draft-loop check runs them), ``engine`` (the reference engine: a few async steps of
speculative decoding, k = 3, drafting through the backend, eager), or ``nan-poison``
(``memory.poison_pass``, run without the tool: OUT.json gets its findings and metrics). For the
first two the pool is fresh, never-written
memory except the slots the requests own and wrote (``PoolFill.FRESH``), so initcheck reports any
read of a slot no request wrote, and OUT.json says which tensor each device address belongs to;
it is written before any backend call, because a memcheck fault ends the process. Every stage
runs here rather than in the worker, so a backend's wild access ends this process only.

The step and engine stages run with PyTorch's caching allocator off (the parent sets
PYTORCH_NO_CUDA_MEMORY_CACHING=1): each tensor is then its own allocation, and memcheck sees a
read one element past any of them. CUDA graph capture needs the caching allocator, so the
draft-loop stage runs with it on: memcheck sees there only accesses outside its segments. The
engine's pools are zeroed (``allocate_kv_cache``), so only memcheck runs the engine stage.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.memory.sanitizer import PHASE_MARKER
from conformance.harness.allocation_map import AllocationMap
from conformance.harness.step import PoolFill, prepare_case, run_step

STAGES = ("step", "draft-loop", "engine", "nan-poison")
DRAFT_STEPS = 4
ENGINE_PROMPTS = (5, 19, 33)  # prompt lengths: a prefill chunk beside decodes, blocks crossed while drafting
ENGINE_TOKENS = 8


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
    from conformance.harness.draft_loop import DraftLoop, run_one_graph_loop, run_rebuilt_loop

    with phase("draft-loop setup (history write_kv)"):
        loop = DraftLoop(backend_cls, case, DRAFT_STEPS, torch.device("cuda"), padding_row=True, fill=PoolFill.FRESH)
    buffers, drafted = loop.buffers, loop.drafted
    # The graph batch's padding row has length 1 and a block-table row of zeros: it reads block 0
    # slot 0, which the harness hands it, so that one slot is written; the rest of block 0 stays fresh.
    reserved_slot = torch.zeros(1, dtype=torch.int64, device=buffers.kv_cache.device)
    buffers.backend.write_kv(
        buffers.kv_cache,
        buffers.key[:1],
        None if buffers.value is None else buffers.value[:1],
        reserved_slot,
        layer=buffers.layer,
    )
    drafted_table = torch.cat([drafted.block_table, torch.zeros_like(drafted.block_table[:1])])
    where = AllocationMap()
    where.add_pool(buffers.kv_cache, drafted_table, drafted.seq_lens + [1], case.spec.block_size, buffers.num_blocks)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "query", "key", "value", "out"):
        where.add(name, getattr(buffers, name))
    where.save(map_path)
    one_graph = backend_cls.capabilities.draft_step_update
    with phase(f"draft loop k={DRAFT_STEPS}: warm-up, capture and replay"):
        (run_one_graph_loop if one_graph else run_rebuilt_loop)(loop)


def memory_engine(backend_cls, case, device: torch.device):
    """The engine stage's engine (async, k = 3 drafted through the backend, eager) and its prompts."""
    from conformance.harness.engine_model import cache_config, model_and_prompts
    from conformance.harness.engine_runs import ATTENTION_DRAFTER, SPEC_TOKENS
    from reference_engine.batched_engine import BatchedEngine
    from reference_engine.core import EngineConfig

    model, prompts = model_and_prompts(case, device, ENGINE_PROMPTS)
    engine = BatchedEngine(
        EngineConfig(
            model=model.config,
            backend=f"{backend_cls.__module__}:{backend_cls.__qualname__}",
            device=str(device),
            dtype=case.spec.dtype,
            block_size=case.spec.block_size,
            num_blocks=32,
            max_num_reqs=len(prompts),
            max_num_tokens=64,
            num_spec_tokens=SPEC_TOKENS,
            drafter=ATTENTION_DRAFTER,
            cuda_graphs=False,
            **cache_config(case),
        ),
        model,
    )
    return engine, prompts


def run_engine_stage(backend_cls, case, map_path: Path) -> None:
    from reference_engine.sampling import SamplingParams

    engine, prompts = memory_engine(backend_cls, case, torch.device("cuda"))
    where = AllocationMap(
        unmapped="an allocation outside the KV pools (the engine's inputs and state, or the backend's own)"
    )
    for name, tensor in engine_pools(engine):
        where.add(name, tensor)
    where.save(map_path)
    with phase(f"engine: async, k=3 drafted through the backend, {ENGINE_TOKENS} tokens for {len(prompts)} prompts"):
        engine.generate(prompts, SamplingParams(max_tokens=ENGINE_TOKENS, ignore_eos=True))


def engine_pools(engine) -> list[tuple[str, torch.Tensor]]:
    """Every pool of the engine's layers, named: a layer's attention's (a backend serving only some
    batches runs beside a companion: a pool for each), an MLA model's decompressed prefill's, and a
    sparse layer's indexer's (its keys; a companion's too)."""
    pools = []
    for layer, caches in enumerate(engine.kv_caches):
        for role, cache in zip(("KV pool", "MLA prefill's KV pool", "indexer's key pool"), caches):
            for part, tensor in enumerate(cache if isinstance(cache, tuple) else (cache,)):
                owner = "companion's " if part else ""
                if tensor is not None:
                    pools.append((f"layer {layer} {owner}{role}", tensor))
    return pools


def run_poison_stage(backend_cls, case, out_path: Path) -> None:
    from conformance.checks.memory import poison_pass

    findings, metrics = poison_pass(backend_cls, case, torch.device("cuda"))
    out_path.write_text(json.dumps({"findings": findings, "metrics": metrics}))


def main(argv: list[str]) -> int:
    backend, case_id, stage, out_path = argv
    backend_cls, case = registry.load(backend), parse_case(case_id)
    run = {
        "step": run_step_stage,
        "draft-loop": run_draft_loop_stage,
        "engine": run_engine_stage,
        "nan-poison": run_poison_stage,
    }[stage]
    run(backend_cls, case, Path(out_path))
    print(PHASE_MARKER + "done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
