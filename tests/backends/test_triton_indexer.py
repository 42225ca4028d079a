"""``triton_indexer`` (DeepSeek-V3.2's lightning indexer as a Triton kernel): its claims, the
``indexer`` check on small cases, and batches of one padded shape run through one instance, as a
captured CUDA graph replays them, under Triton's CPU interpreter (TRITON_INTERPRET=1, decided at
import time, so each run is a process of its own). The same batches captured and replayed on a GPU,
with no host sync, are ``test_triton_indexer_gpu.py``'s."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from backends import registry
from backends.base import (
    AttentionSpec,
    BackendLimits,
    CGSupport,
    CommonAttentionMetadata,
    LayerParameters,
)
from backends.features import EMPTY_REQUESTS, FP8_E4M3
from conformance.cases.oracle import index_logits, index_tolerance
from conformance.harness.index_choice import judge_rows

UNWRITTEN = -2  # what every output row holds before forward (as the indexer check fills it)

# Small cases through the indexer check: bf16 keys over decode, verify and prefill; fp8 keys with
# an empty request last, and over a block table wider than one tile of positions (p64, 300
# positions); fp16 keys and a top-k wider than every request and than the block table (-1 tails),
# empty requests first and mid-batch; a strided case (the block table a column slice of a wider
# one); fp32 queries over fp8 keys. Every case has padding rows (3 by default) the check fills
# with -2 and fails a backend that writes.
CHECK_CASES = [
    "indexer-h8-d32-bf16-p16-topk16:40+1,20+4,0+30",
    "indexer-h8-d32-bf16-fp8e4m3-p16-topk16:40+1,20+4,0+30,0+0",
    "indexer-h16-d64-fp8e4m3-p64-topk64:300+1x2,100+4",
    "indexer-h4-d64-fp16-p16-topk64:0+0,10+3,0+0,5+1",
    "indexer-h8-d32-bf16-p16-topk16-strided:30+2,0+0,7+9",
    "indexer-h4-d32-fp32-fp8e4m3-p16-topk8-edges:40+1,3+5",
]


def interpreted(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )


def test_the_claims_and_the_registry():
    from backends.triton.indexer import TritonIndexerBackend

    assert registry.load("triton_indexer") is TritonIndexerBackend
    claims = TritonIndexerBackend.capabilities
    assert claims.kinds == {"indexer"} and claims.features == {FP8_E4M3, EMPTY_REQUESTS}
    assert claims.cuda_graphs == CGSupport.ALWAYS and not claims.needs_cpu_seq_lens and claims.draft_step_update
    assert claims.required_modules == ("triton",)


CHECK_SCRIPT = """
import sys, torch
from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.indexer import IndexerCheck
from conformance.run.execution import judge
for case in sys.argv[1:]:
    result = judge(IndexerCheck(), registry.load("triton_indexer"), parse_case(case), torch.device("cpu"))
    print(result.verdict.name, result.reason)
"""


@pytest.mark.slow
def test_the_indexer_check_passes_under_the_interpreter():
    completed = interpreted("-c", CHECK_SCRIPT, *CHECK_CASES)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["PASS "] * len(CHECK_CASES), completed.stdout


# Batches of one padded shape (3 requests, 8 query rows of which the last are padding): lengths,
# query lengths, an empty request (its block-table row -1) and the real token count move from one
# to the next; the last is followed by a draft step (every request one token longer).
BATCHES = [
    [(30, 1), (20, 4), (0, 3)],
    [(0, 6), (50, 1), (9, 1)],
    [(10, 1), (0, 0), (40, 1)],
    [(0, 0), (55, 2), (3, 2)],
]
ROWS, BLOCKS_PER_REQUEST, BLOCK_SIZE = 8, 4, 16


def run_batches(
    device: torch.device,
    kv_cache_dtype: torch.dtype | None,
    topk: int,
    capture: bool = False,
    watch=contextlib.nullcontext,
) -> list[str]:
    """The problems found running ``BATCHES`` (then a draft step) through one triton_indexer over
    persistent tensors, as an engine replays a CUDA graph: metadata built from device tensors only
    (no host lengths), the output filled with -2 before each step. ``capture``: the first batch
    warms up, then forward is captured once (``build_for_capture``) and replayed for every batch
    after ``build``. ``watch()``: a context around each step's build and forward (a host-sync
    detector on a GPU)."""
    from backends.triton.indexer import TritonIndexerBackend

    generator = torch.Generator().manual_seed(0)
    spec = AttentionSpec(
        kind="indexer",
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.bfloat16,
        block_size=BLOCK_SIZE,
        kv_cache_dtype=kv_cache_dtype,
        sparse_topk=topk,
    )
    num_reqs, width = len(BATCHES[0]), BLOCKS_PER_REQUEST * BLOCK_SIZE
    backend = TritonIndexerBackend(spec, BackendLimits(num_reqs, ROWS, width), device)
    kv_cache = backend.allocate_kv_cache(1 + num_reqs * BLOCKS_PER_REQUEST)
    # Every request's keys at every position, written before each step up to its length.
    all_keys = torch.randn(num_reqs, width, spec.head_dim, generator=generator).mul(4).to(spec.dtype).to(device)
    blocks = 1 + torch.arange(num_reqs * BLOCKS_PER_REQUEST, dtype=torch.int32).view(num_reqs, -1).flip(1)
    int32 = dict(dtype=torch.int32, device=device)
    query = torch.zeros(ROWS, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=device)
    weights = torch.zeros(ROWS, spec.num_heads, device=device)
    query_start_loc, seq_lens = torch.zeros(num_reqs + 1, **int32), torch.zeros(num_reqs, **int32)
    block_table = torch.zeros(num_reqs, BLOCKS_PER_REQUEST, **int32)
    out = torch.full((ROWS, topk), UNWRITTEN, **int32)
    layer = LayerParameters(index_weights=weights)
    problems: list[str] = []

    def load(batch, query_lens) -> CommonAttentionMetadata:
        lengths = [context + q for (context, _), q in zip(batch, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        query.copy_(torch.randn(query.shape, generator=generator).to(spec.dtype))
        weights.copy_(torch.randn(weights.shape, generator=generator))
        query_start_loc.copy_(torch.tensor(starts))
        seq_lens.copy_(torch.tensor(lengths))
        table = torch.where(torch.tensor(lengths)[:, None] > 0, blocks, -1)  # an empty request's row: -1
        block_table.copy_(table)
        for request, length in enumerate(lengths):
            if not length:
                continue
            positions = torch.arange(length)
            slots = (table[request].long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).to(device)
            backend.write_kv(kv_cache, all_keys[request, :length], None, slots)
        out.fill_(UNWRITTEN)
        common = CommonAttentionMetadata.from_lengths(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
            query_starts=starts,
            host_seq_lens=lengths,
            lengths_known=False,
            max_seq_len=width,
        )
        return common

    def judge(name: str, common: CommonAttentionMetadata) -> None:
        if common.device_to_host_copies:
            problems.append(f"{name}: copied {common.device_to_host_copies} to the host")
        starts, lengths = common.query_start_loc_cpu.tolist(), seq_lens.tolist()
        rows = out.cpu()
        if bool((rows[starts[-1] :] != UNWRITTEN).any()):
            problems.append(f"{name}: padding rows written")
        for request, length in enumerate(lengths):
            start, end = starts[request], starts[request + 1]
            if end == start:
                continue
            positions = torch.arange(length)
            slots = block_table[request].long().cpu()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
            stored, scales = backend.read_kv(kv_cache, slots.to(device))
            keys = stored.double().cpu() * (1.0 if scales is None else scales.double().cpu()[:, None])
            q, w = query[start:end].cpu(), weights[start:end].cpu()
            context = length - (end - start)
            logits = index_logits(q, keys, w, context_len=context)
            problem, _ = judge_rows(rows[start:end], logits, index_tolerance(q, keys, w), context, topk, start)
            if problem:
                problems.append(f"{name}, request {request}: token {problem.token} {problem.what}")

    graph = None
    for index, batch in enumerate(BATCHES):
        common = load(batch, [q for _, q in batch])
        if graph is not None:
            with watch():
                backend.build(common)
                graph.replay()
        else:
            with watch() if index else contextlib.nullcontext():
                metadata = backend.build(common)
                backend.forward(query, kv_cache, metadata, out, layer)
            if capture:
                metadata = backend.build_for_capture(common)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    backend.forward(query, kv_cache, metadata, out, layer)
                out.fill_(UNWRITTEN)
                graph.replay()
        judge(f"batch {index}", common)
    # A draft step: every request of the last batch a token longer, its metadata advanced in place.
    last = BATCHES[-1]
    metadata = backend.build(load(last, [q for _, q in last]))
    drafted = [(context + q, 1 if context + q else 0) for context, q in last]
    common = load([(context, 0) for context, _ in drafted], [q for _, q in drafted])
    with watch():
        metadata = backend.update_for_draft_step(metadata, common)
        if graph is not None:
            graph.replay()
        else:
            backend.forward(query, kv_cache, metadata, out, layer)
    judge("draft step", common)
    positions = metadata.token_position[: common.num_actual_tokens].tolist()
    expected = [context + q - 1 for context, q in drafted if q]
    if positions != expected:
        problems.append(f"draft step: token positions {positions}, not {expected}")
    return problems


BATCHES_SCRIPT = """
import torch
from tests.backends.test_triton_indexer import run_batches
for kv_cache_dtype, topk in ((torch.float8_e4m3fn, 16), (None, 80)):
    print(run_batches(torch.device("cpu"), kv_cache_dtype, topk))
"""


@pytest.mark.slow
def test_batches_of_one_shape_and_a_draft_step_under_the_interpreter():
    """fp8 keys with a top-k of 16, then bf16 keys with a top-k of 80, wider than the block table
    (64 positions): each token's choice right, the padding rows untouched, no length copied to the
    host, the draft step's positions remade from the advanced lengths."""
    completed = interpreted("-c", BATCHES_SCRIPT)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["[]", "[]"], completed.stdout
