"""The log-sum-exp a backend returns (``Capabilities.returns_lse``), against the oracle's.

What consumes it (vLLM's ``merge_attn_states``: MLA prefill over context chunks, cascade and
decode-context-parallel attention) weighs two partial outputs by ``exp(lse_a − lse_b)``, so an
error of ε in an LSE is a relative error of about ε in the merged weights. The tolerance is
therefore absolute and tight: ``LSE_ATOL`` plus ``LSE_RTOL`` of the value (logits near 256 in
fp32 carry about 3e-5), far below the 0.5 a score rounded to bf16 would leave at that size.
"""
from __future__ import annotations

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
    allowed = LSE_ATOL + LSE_RTOL * expected.abs()
    bad = ~(error <= allowed)  # NaN counts as bad
    metrics = {"lse_max_abs_error": float(error.nan_to_num(float("inf")).max()) if error.numel() else 0.0}
    if padding and not lse[tokens:].isnan().all():
        return f"forward wrote the lse of {int((~lse[tokens:].isnan()).any(-1).sum())} rows past the step's real tokens", metrics
    if not bad.any():
        return None, metrics
    token, head = divmod(int(bad.flatten().nonzero()[0]), spec.num_heads)
    return (f"lse: {int(bad.sum())} of {bad.numel()} beyond |Δ| <= {LSE_ATOL:g} + {LSE_RTOL:g}·|lse| (natural log); "
            f"first at token {token} head {head}: got {float(got[token, head]):.6g}, expected "
            f"{float(expected[token, head]):.6g}"), metrics
