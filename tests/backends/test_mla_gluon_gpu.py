"""triton_mla's Gluon kernel on Hopper: it serves the 64-row tiles, and its output equals the
oracle's with NaN in every slot no request owns (so a partial last tile is not copied whole), for
one split and several, decode and spec-verify, bf16 and fp16."""

import pytest
import torch

from backends.triton.mla_backend import GLUON, TritonMLABackend, has_wgmma, tile_read, tiling
from conformance.cases.grammar import parse_case
from conformance.checks.memory import poison_pass
from conformance.harness.step import prepare_case

CASES = [
    "mla-h128-d512+64-bf16-p64:4000+1,63+1,64+1,65+1,1+1",  # one split at most; partial tiles
    "mla-h128-d512+64-bf16-p64:3000+1",  # one request: several splits, the last one partial
    "mla-h128-d512+64-bf16-p64:700+4,130+4,5+4",  # spec-verify: 16 heads x 4 tokens a tile
    "mla-h8-d512+64-fp16-p64:500+8,64+8,71+3",  # 8 heads x 8 tokens; a shorter request in the batch
]


def hopper() -> bool:
    return torch.cuda.is_available() and has_wgmma(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on Hopper (SM90) only")
@pytest.mark.parametrize("case_text", CASES)
def test_gluon_kernel_serves_and_matches_the_oracle_over_a_poisoned_pool(case_text):
    case, device = parse_case(case_text), torch.device("cuda")
    prepared = prepare_case(TritonMLABackend, case, device)
    decode_q = case.max_query_len
    block_m = tiling(case.spec.num_heads, decode_q).block_m
    assert tile_read(case.spec, block_m, prepared.kv_cache, True, True) == GLUON
    findings, metrics = poison_pass(TritonMLABackend, case, device)
    assert findings == [], findings
    assert metrics["nan-poison non-finite outputs"] == 0 and metrics["nan-poison mismatched"] == 0, metrics
