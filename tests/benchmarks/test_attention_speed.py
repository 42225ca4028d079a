"""pytest-benchmark view of the issue's target shapes, every available backend side by side.

    python -m pytest tests/benchmarks --benchmark-only --benchmark-json=bench.json

A plain ``pytest -q`` does not collect this folder (tests/conftest.py): name it, or pass
``--benchmarks``.

pytest-benchmark times step() on the host clock (launch + forward + synchronize); the CUDA-event
median of the forward alone, L2 flushed, is stored in extra_info["forward_us"], which is the
figure `conformance bench` reports too.
"""

import pytest
import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.bench import _l2_flusher, time_gpu
from conformance.harness.step import poisoned_output, prepare_case

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark]

SHAPES = {
    "decode b64 ctx4096": ("gqa-h32/8-d128-bf16-p16:4096+1x64", ["triton", "flashinfer", "trtllm"]),
    "verify q4 b64 ctx4096": ("gqa-h32/8-d128-bf16-p16:4096+4x64", ["triton", "flashinfer"]),
    "mla decode b64 ctx4096": ("mla-h128-d512+64-bf16-p64:4096+1x64", ["triton_mla", "flashmla"]),
}
PARAMS = [(shape, backend) for shape, (_, backends) in SHAPES.items() for backend in backends]


@pytest.mark.parametrize("shape,backend", PARAMS, ids=[f"{s}-{b}" for s, b in PARAMS])
def test_forward_speed(benchmark, shape, backend):
    device = torch.device("cuda")
    backend_cls = registry.load(backend)
    reason = backend_cls.availability_reason(device)
    if reason:
        pytest.skip(reason)
    case = parse_case(SHAPES[shape][0])
    prepared = prepare_case(backend_cls, case, device)
    batch = prepared.batch
    key, value, slots = batch.step_rows()
    prepared.backend.write_kv(prepared.kv_cache, key, value, slots, layer=prepared.layer)
    metadata = prepared.backend.build(batch.common_metadata(with_host_lengths=True))
    query = torch.cat([batch.query, torch.zeros_like(batch.query[:3])])
    out = poisoned_output(batch)

    def step():
        prepared.backend.forward(query, prepared.kv_cache, metadata, out, layer=prepared.forward_layer)
        torch.cuda.synchronize()

    forward_us = time_gpu(
        lambda: prepared.backend.forward(query, prepared.kv_cache, metadata, out, layer=prepared.forward_layer),
        _l2_flusher(device),
    )
    benchmark.extra_info["forward_us"] = forward_us
    benchmark.pedantic(step, rounds=30, iterations=1, warmup_rounds=3)
    # A timing of a forward that did nothing (or wrote garbage) is no timing.
    assert forward_us > 0
    assert torch.isfinite(out[: batch.case.num_tokens]).all(), "the timed forward left non-finite outputs"
