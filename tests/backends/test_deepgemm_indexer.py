"""``deepgemm_indexer`` on the CPU: its claims (every case SKIPs, saying why), and its own logic
(DeepGEMM's page layout written and read back, the query quantized with its scales folded into
the weights, each token's context and block-table row, padding rows reading nothing, the mask past
each token's position) against a stand-in for ``fp8_paged_mqa_logits`` that does what DeepGEMM's
sources say it does, under Triton's CPU interpreter (the top-k and write are triton_indexer's).
The kernel itself: ``test_deepgemm_indexer_gpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backends import registry
from backends.base import DeviceInfo
from backends.deepgemm_indexer import QUERY_IN_FP8, DeepGEMMIndexerBackend
from conformance.cases.grammar import parse_case

H200 = DeviceInfo("cuda", "H200", (9, 0))


def test_every_case_skips_saying_why():
    assert registry.load("deepgemm_indexer") is DeepGEMMIndexerBackend
    claims = DeepGEMMIndexerBackend.capabilities
    fp8 = parse_case("indexer-h64-d128-bf16-fp8e4m3-p64-topk2048:3000+4").needs
    assert claims.feature_reason(fp8, H200).endswith(QUERY_IN_FP8)
    bf16 = parse_case("indexer-h64-d128-bf16-p64-topk512:900+4").spec
    assert claims.layout_reason(bf16) == "serves only layers with fp8_e4m3_kv_cache (this layer has none)"


# The stand-in kernel: DeepGEMM's documented math and layout, and what it leaves (NaN: memory it
# never writes, past the pages a row's context covers; the scores of whatever the last page holds
# past the context).
STAND_IN = """
import sys, types, torch

def get_num_sms():
    return 132

def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
    assert context_lens.dtype == torch.int32 and context_lens.dim() == 2 and block_kv == 64
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule, max_context_len, clean_logits):
    batch, next_n, heads, dim = q.shape
    assert q.dtype == torch.float8_e4m3fn and next_n == 1 and not clean_logits
    assert kv_cache.dtype == torch.uint8 and kv_cache.shape[1:] == (64, 1, dim + 4)
    assert weights.dtype == torch.float32 and weights.shape == (batch, heads) and weights.is_contiguous()
    assert block_table.dtype == torch.int32 and context_lens.shape == (batch, 1)
    pages = kv_cache.view(kv_cache.shape[0], -1)
    keys = pages[:, : 64 * dim].reshape(-1, 64, dim).view(torch.float8_e4m3fn).float()
    scales = pages[:, 64 * dim :].reshape(-1, 64, 4).contiguous().view(torch.float32)[..., 0]
    stride = -(-max_context_len // 256) * 256
    out = torch.full((batch, stride), float("nan"))
    for row in range(batch):
        covered = -(-int(context_lens[row, 0]) // 64)
        for page in range(covered):
            block = int(block_table[row, page])
            assert 0 <= block < kv_cache.shape[0], f"row {row} reads page {block}"
            score = torch.einsum("hd,td->ht", q[row, 0].float(), keys[block]).clamp(min=0)
            out[row, page * 64 : page * 64 + 64] = scales[block] * (weights[row] @ score)
    return out[:, :max_context_len]  # rows as wide as the kernel's (256-aligned), as DeepGEMM's

sys.modules["deep_gemm"] = types.SimpleNamespace(
    get_num_sms=get_num_sms,
    get_paged_mqa_logits_metadata=get_paged_mqa_logits_metadata,
    fp8_paged_mqa_logits=fp8_paged_mqa_logits,
)
"""


def claimed(devices: frozenset[str], compute_capabilities=None) -> type[DeepGEMMIndexerBackend]:
    """deepgemm_indexer claiming its fp8-key layers, to run the adapter (its query is e4m3)."""
    import dataclasses

    from backends.features import FP8_E4M3

    class Claimed(DeepGEMMIndexerBackend):
        capabilities = dataclasses.replace(
            DeepGEMMIndexerBackend.capabilities,
            devices=devices,
            compute_capabilities=compute_capabilities,
            features=frozenset({FP8_E4M3}),
            not_claimed={},
        )

    return Claimed


def adapter_problems(backend_cls, text: str, device) -> list[str]:
    """One step of case ``text`` through ``backend_cls`` as the harness runs it: each token's
    logits against the float64 logits of its query quantized as the adapter says (e4m3, a
    power-of-two scale a token and head) over the keys it stored, -inf past its position; its
    choice the top-k of those."""
    import torch

    from backends.fp8 import to_cache, token_scales
    from conformance.cases.oracle import index_logits, index_tolerance
    from conformance.harness.answers import CHOICE
    from conformance.harness.step import prepare_case, run_step

    case = parse_case(text)
    prepared = prepare_case(backend_cls, case, torch.device(device))
    batch, backend, spec, problems = prepared.batch, prepared.backend, case.spec, []
    logits = {}
    original = backend.logits
    backend.logits = lambda *args: logits.setdefault("rows", original(*args))
    out = run_step(prepared).cpu()
    rows = logits["rows"].double().cpu()
    for request, (context, new) in enumerate(case.batch):
        start, length = batch.query_start_loc[request], context + new
        if not new:
            continue
        stored, scales = backend.read_kv(prepared.kv_cache, batch.slots(request, range(length)).to(device))
        keys = stored.double().cpu() * scales.double().cpu()[:, None]
        flat = batch.query[start : start + new].float().cpu().reshape(-1, spec.head_dim)
        q_scales = token_scales(flat, spec.kv_cache_dtype)
        query = (to_cache(flat, q_scales[:, None], spec.kv_cache_dtype).double() * q_scales[:, None].double()).view(
            new, spec.num_heads, spec.head_dim
        )
        weights = batch.token_inputs["index_weights"][start : start + new].double().cpu()
        expected = index_logits(query, keys, weights, context_len=context)
        tolerance = index_tolerance(query, keys, weights)[:, None]  # one bf16 rounding of a head's score
        got, finite = rows[start : start + new, :length], torch.isfinite(expected)
        if not torch.equal(finite, torch.isfinite(got)):
            problems.append(f"request {request}: -inf where the oracle has none, or a value where it has -inf")
            continue
        # The kernel's fp8 products are exact; Hopper's fp8 MMA accumulates with fewer bits than
        # fp32 (about 2^-13 of a score): a tenth of the tolerance is room enough.
        off = float(((got - expected).abs() / tolerance)[finite].max()) if bool(finite.any()) else 0.0
        if off > 0.1:
            problems.append(f"request {request}: logits off by {off:.3g} tolerances")
        if bool((rows[start : start + new, length:] != float("-inf")).any()):  # NaN too
            problems.append(f"request {request}: a column past its length is not -inf")
        miss = CHOICE.misses(out[start : start + new], expected / tolerance)[0]
        if not bool((miss <= 1.0).all()):
            problems.append(f"request {request}: a choice {float(miss.max()):.3g} tolerances beyond the k-th logit")
    return problems


SCRIPT = (
    STAND_IN
    + """
from conformance.harness.nan_poison import nan_poison_pass
from conformance.harness.step import prepare_case
from conformance.cases.grammar import parse_case
from tests.backends.test_deepgemm_indexer import adapter_problems, claimed
for text in sys.argv[1:]:
    backend = claimed(frozenset({"cpu"}))
    problems = adapter_problems(backend, text, "cpu")
    # The memory check's NaN pass, its writes: the pages' bytes changed only where the step's
    # tokens go (its choices are judged against a bf16 query, which the adapter's is not).
    findings = nan_poison_pass(prepare_case(backend, parse_case(text), torch.device("cpu")))[0]
    problems += [f["what"] for f in findings if f["phase"] == "write_kv"]
    print("; ".join(problems) or "OK")
"""
)

# Decode, verify and a prefill with context; an empty request; a context past one page; the top-k
# wider than a short request (-1 tails); the default padding rows (3) after the real ones.
CASES = [
    "indexer-h32-d32-bf16-fp8e4m3-p64-topk16:130+1,40+4,0+0,0+9",
    "indexer-h64-d64-bf16-fp8e4m3-p64-topk8-strided:70+2,3+1",
]


@pytest.mark.slow
def test_the_adapter_computes_deepgemms_logits_over_its_own_pages():
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, *CASES],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.splitlines() == ["OK"] * len(CASES), completed.stdout
