"""The log-sum-exp a backend returns (``Capabilities.returns_lse``), against the oracle's.

What consumes it (vLLM's ``merge_attn_states``: MLA prefill over context chunks, cascade and
decode-context-parallel attention) weighs two partial outputs by ``exp(lse_a − lse_b)``, so an
error of ε in an LSE is a relative error of about ε in the merged weights. The tolerance is
therefore absolute and tight: ``LSE_ATOL`` plus ``LSE_RTOL`` of the value (logits near 256 in
fp32 carry about 3e-5), plus what rounding the query to the compute dtype may move it by
(``query_rounding``): FlashInfer's FA2 scales the query in bf16 before its products, which on an
H200 moved LSEs near 0.2 by 1.03e-3. A score rounded to bf16 as a whole would leave 0.5 at 256,
far more than that allows.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from conformance.inputs.harness import PreparedCase
from conformance.inputs.stored_cache import expected_lse

LSE_ATOL = 1e-3
LSE_RTOL = 1e-4


def forward_with_lse(prepared: PreparedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """One more forward of the step just run (same metadata, same cache), handed an ``lse``
    buffer of NaN: (output, lse), padding rows included."""
    batch = prepared.batch
    spec, tokens, padding = batch.spec, batch.case.num_tokens, batch.case.padding
    query = torch.cat([batch.query, batch.query.new_zeros(padding, *batch.query.shape[1:])])
    out = torch.empty(tokens + padding, spec.num_heads, spec.v_head_dim, dtype=spec.dtype, device=batch.device)
    lse = torch.full((tokens + padding, spec.num_heads), float("nan"), dtype=torch.float32, device=batch.device)
    prepared.backend.forward(query, prepared.kv_cache, prepared.metadata, out, **prepared.forward_layer, lse=lse)
    return out, lse


def lse_findings(prepared: PreparedCase) -> tuple[str | None, dict[str, Any]]:
    """The step just run, again with an ``lse`` buffer: (what is wrong or None, metrics). Rows
    past the real tokens must stay NaN."""
    batch = prepared.batch
    spec, tokens, padding = batch.spec, batch.case.num_tokens, batch.case.padding
    _, lse = forward_with_lse(prepared)
    expected = expected_lse(prepared)
    got = lse[:tokens].double()
    error = (got - expected).abs()
    allowed = LSE_ATOL + LSE_RTOL * expected.abs() + query_rounding(batch)
    bad = ~(error <= allowed)  # NaN counts as bad
    metrics = {"lse_max_abs_error": float(error.nan_to_num(float("inf")).max()) if error.numel() else 0.0}
    if padding and not lse[tokens:].isnan().all():
        return f"forward wrote the lse of {int((~lse[tokens:].isnan()).any(-1).sum())} rows past the step's real tokens", metrics
    if not bad.any():
        return None, metrics
    token, head = divmod(int(bad.flatten().nonzero()[0]), spec.num_heads)
    return (f"lse: {int(bad.sum())} of {bad.numel()} beyond |Δ| <= {LSE_ATOL:g} + {LSE_RTOL:g}·|lse| + the query's "
            f"rounding (natural log); first at token {token} head {head}: got {float(got[token, head]):.6g}, expected "
            f"{float(expected[token, head]):.6g} (allowed {float(allowed[token, head]):.3g})"), metrics


def query_rounding(batch) -> torch.Tensor:
    """[num_tokens, H] float64: how far rounding the query (scaled or not) to the compute dtype
    moves an LSE, at most: a score's error is a sum of independent roundings of its product terms,
    each uniform within half an ulp, u·|q_i k_i|; four standard deviations of that sum,
    4 / √3 · u · scale · sqrt(Σ_i (q_i k_i)²), at the request's largest (0 in fp32). The worst
    case, every rounding one way, is about √D times that and never happens."""
    spec = batch.spec
    if spec.dtype == torch.float32 or batch.case.num_tokens == 0:
        return torch.zeros(batch.case.num_tokens, spec.num_heads, dtype=torch.float64, device=batch.device)
    bounds = []
    for request in range(batch.case.num_reqs):
        start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
        query = batch.query[start:end].float().square()  # [q, H, D]
        keys = batch.keys[request].float().square()  # MHA [n, Hkv, D]; MLA [n, D]
        keys = keys[:, None, :] if spec.kind == "mla" else keys.repeat_interleave(spec.query_group_size, dim=1)
        if end == start or keys.shape[0] == 0:
            bounds.append(query.new_zeros(end - start, spec.num_heads))
            continue
        bounds.append(torch.einsum("qhd,nhd->qhn", query, keys.expand(-1, spec.num_heads, -1)).amax(-1).sqrt())
    unit_roundoff = torch.finfo(spec.dtype).eps / 2
    return torch.cat(bounds).double() * (4 / math.sqrt(3) * unit_roundoff * spec.softmax_scale)
