"""The log-sum-exp a backend returns (feature ``lse``), against the oracle's.

What consumes it (vLLM's ``merge_attn_states``: MLA prefill over context chunks, cascade and
decode-context-parallel attention) weighs two partial outputs by ``exp(lse_a − lse_b)``, so an
error of ε in an LSE is a relative error of about ε in the merged weights. The tolerance is
therefore absolute and tight: ``LSE_ATOL`` plus ``LSE_RTOL`` of the value (logits near 256 in
fp32 carry about 3e-5), plus what rounding the query to the compute dtype moves it by
(``query_rounding``: 0.006 to 0.011 at the median of the standard bf16 LSE cases): FlashInfer's
FA2 scales the query in bf16 before its products, which on an H200 moved LSEs near 0.2 by
1.03e-3. That error is shared by every key of a query, so it cancels in a merge of the query's
pieces; an error of one key's score does not, and is the output check's to see.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from conformance.cases.oracle import attention_reference
from conformance.harness.step import PreparedCase
from conformance.harness.stored_cache import expected_lse

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
    prepared.backend.forward(
        query, prepared.kv_cache, prepared.metadata, out, layer=prepared.forward_layer.with_lse(lse)
    )
    return out, lse


def lse_findings(prepared: PreparedCase) -> tuple[str | None, dict[str, Any]]:
    """The step just run, again with an ``lse`` buffer: (what is wrong or None, metrics)."""
    return judge_lse(prepared, forward_with_lse(prepared)[1])


def judge_lse(prepared: PreparedCase, lse: torch.Tensor, *, negated: bool = False) -> tuple[str | None, dict[str, Any]]:
    """``lse`` (the buffer a forward of ``prepared``'s step was handed, NaN before it, padding rows
    included) against the oracle's: (what is wrong or None, metrics). Rows past the real tokens
    must stay NaN. Eager passes and graph replays alike: a replay's buffer is refilled with NaN
    first, so an LSE written only eagerly (a captured path launched without it) stays NaN.
    ``negated``: a later layer's step, run negated (``expected_lse``)."""
    batch = prepared.batch
    spec, tokens = batch.spec, batch.case.num_tokens
    padding = lse.shape[0] - tokens
    expected = expected_lse(prepared, negated=negated)
    got = lse[:tokens].double()
    error = (got - expected).abs()
    allowed = lse_allowed(prepared, expected, negated=negated)
    bad = ~(error <= allowed)  # NaN counts as bad
    metrics = {
        "lse_max_abs_error": float(error.nan_to_num(float("inf")).max()) if error.numel() else 0.0,
        # the worst element's error over its allowed error (a NaN: inf)
        "lse_tolerance_ratio": float((error / allowed).nan_to_num(float("inf")).max()) if error.numel() else 0.0,
    }
    if padding and not lse[tokens:].isnan().all():
        return (
            f"forward wrote the lse of {int((~lse[tokens:].isnan()).any(-1).sum())} rows past the step's real tokens",
            metrics,
        )
    if not bad.any():
        return None, metrics
    token, head = divmod(int(bad.flatten().nonzero()[0]), spec.num_heads)
    return (
        f"lse: {int(bad.sum())} of {bad.numel()} beyond |Δ| <= {LSE_ATOL:g} + {LSE_RTOL:g}·|lse| + the query's "
        f"rounding (natural log); first at token {token} head {head}: got {float(got[token, head]):.6g}, expected "
        f"{float(expected[token, head]):.6g} (allowed {float(allowed[token, head]):.3g})"
    ), metrics


def lse_allowed(prepared: PreparedCase, expected: torch.Tensor, *, negated: bool = False) -> torch.Tensor:
    """[num_tokens, H]: how far each of the step's LSEs may lie from ``expected`` (the oracle's):
    ``LSE_ATOL`` + ``LSE_RTOL``·|lse| + the query's rounding, and for an fp8 layer how far the
    oracle over its cache dequantized into the compute dtype lies from the exact one (as the
    output's allowance: ``stored_cache.oracle``). Every pass that judges an LSE uses it."""
    allowed = LSE_ATOL + LSE_RTOL * expected.abs() + query_rounding(prepared.batch)
    if prepared.batch.case.kv_scales is not None:
        allowed = allowed + (expected - expected_lse(prepared, negated=negated, rounded=True)).abs()
    return allowed


def query_rounding(batch) -> torch.Tensor:
    """[num_tokens, H] float64: how far rounding the query (scaled or not) to the compute dtype
    moves an LSE. Every score of a token and head shares its query's rounding δq, so the LSE moves
    by δq · k̄, k̄ the softmax-weighted mean key (the oracle's output with the keys as values); each
    δq_i is uniform within half an ulp, u·|q_i|; four standard deviations of the sum are
    4 / √3 · u · scale · sqrt(Σ_i (q_i k̄_i)²) (0 in fp32). FlashInfer's FA2 on an H200, 1.03e-3
    off at an LSE of 0.22, is a probe channel's q_p · k̄_p rounded so."""
    spec = batch.spec
    bounds = torch.zeros(batch.case.num_tokens, spec.num_heads, dtype=torch.float64, device=batch.device)
    if spec.dtype == torch.float32:
        return bounds
    for request, (context_len, _) in enumerate(batch.case.batch):
        start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
        if end == start:
            continue
        query, key = batch.query_values(start, end), batch.keys[request]
        key = spec.layout.key_heads(key)  # MLA's absorbed scores: one latent head
        mean_key = attention_reference(
            query,
            key,
            key,
            context_len=context_len,
            scale=spec.softmax_scale,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
            sparse_window=spec.sparse_window,
            **batch.oracle_inputs(request),
        )
        bounds[start:end] = (query.double() * mean_key).square().sum(-1).sqrt()
    unit_roundoff = torch.finfo(spec.dtype).eps / 2
    return bounds * (4 / math.sqrt(3) * unit_roundoff * spec.softmax_scale)
