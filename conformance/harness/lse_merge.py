"""The log-sum-exp at work: an MLA prefill with context, merged the way vLLM runs it.

vLLM and SGLang run DeepSeek's MLA prefill over decompressed keys in pieces: the new tokens attend
over the cached context (every context key, none of the new ones) and, causally, over themselves;
``merge_attn_states`` then joins the two partial outputs by their log-sum-exps. Here both pieces
run through the backend under test, each as an ordinary step asking for the LSE:

* **the context piece**: every new token becomes a request of its own over the context, its own
  key a *null key*, ``-NULL_LOGIT · q / (scale · |q|²)`` per head, whose score is ``-NULL_LOGIT``:
  its weight is 0 in fp32 and float64 alike, so the piece is attention over the context alone;
* **the new-token piece**: each request's new tokens with no context (their keys at positions
  0.., causal among themselves as before).

The merge must equal the oracle's answer for the whole step. It runs on MHA layers without
learned sinks (a null key serves one query head only where every KV head has one query head; a
sink would be counted once per piece) over a cache in the compute dtype, for chains (the pieces
are cut as chains: a tree's new-token piece would lose its tree, its context piece sit at the
context's position rather than at each token's depth).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.comparison import TOLERANCES
from conformance.harness.lse_pass import forward_with_lse
from conformance.harness.step import PreparedCase, prepare_layer, run_step

NULL_LOGIT = 2000.0  # the null key's score: exp(-2000) is 0 in fp32 and in float64


def merge_applies(prepared: PreparedCase) -> bool:
    """Whether ``prepared``'s step can be cut into the two pieces (the module docstring)."""
    spec = prepared.batch.spec
    return (
        spec.kind == "mha"
        and spec.num_kv_heads == spec.num_heads
        and not spec.attention_sinks
        and prepared.scales is None  # an fp8 cache or query: pieces of an fp32 oracle's, not the contract's
        and any(context for context, _ in prepared.batch.case.batch)
        and not prepared.batch.case.trees
    )


def _piece(prepared: PreparedCase, batch_shape, query, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece as a step of its own, through a backend instance sized for it: (output, lse) of
    its real tokens."""
    case = replace(prepared.batch.case, batch=tuple(batch_shape), shared_prefix_blocks=0, tag="")
    layout = materialize(case, prepared.batch.device)  # blocks and pool; its data is replaced below
    batch = PagedBatch(
        case, layout.device, query.to(layout.query.dtype), keys, values, layout.block_table, layout.num_blocks
    )
    backend = type(prepared.backend)(case.spec, batch.limits(), batch.device)
    piece = prepare_layer(batch, backend, None)
    run_step(piece)
    out, lse = forward_with_lse(piece)
    return out[: case.num_tokens].double(), lse[: case.num_tokens].double()


def merge_findings(prepared: PreparedCase) -> tuple[str | None, dict]:
    """(what is wrong or None, metrics) for the merged pieces of ``prepared``'s step, on the first,
    middle and last new token of every request with context."""
    batch = prepared.batch
    spec, scale = batch.spec, batch.spec.softmax_scale
    starts = batch.query_start_loc
    new_shape, new_keys, new_values = [], [], []
    context_shape, context_query, context_keys, context_values, checked = [], [], [], [], []
    for request, (context, new) in enumerate(batch.case.batch):
        key, value = batch.keys[request], batch.values[request]
        new_shape.append((0, new))
        new_keys.append(key[context:])
        new_values.append(value[context:])
        if context == 0 or new == 0:
            continue
        for token in sorted({0, new // 2, new - 1}):
            query = batch.query[starts[request] + token]  # [H, D]
            norm = query.double().pow(2).sum(-1, keepdim=True).clamp_min(1e-6)
            null_key = (-NULL_LOGIT * query.double() / (scale * norm)).to(key.dtype)
            context_shape.append((context, 1))
            context_query.append(query)
            context_keys.append(torch.cat([key[:context], null_key[None]]))
            context_values.append(torch.cat([value[:context], torch.zeros_like(value[:1])]))
            checked.append(starts[request] + token)
    out_new, lse_new = _piece(prepared, new_shape, batch.query, new_keys, new_values)
    out_context, lse_context = _piece(prepared, context_shape, torch.stack(context_query), context_keys, context_values)

    rows = torch.tensor(checked, device=out_new.device)
    out_b, lse_b = out_new[rows], lse_new[rows]
    top = torch.maximum(lse_context, lse_b)
    weight_a, weight_b = torch.exp(lse_context - top)[..., None], torch.exp(lse_b - top)[..., None]
    merged = (out_context * weight_a + out_b * weight_b) / (weight_a + weight_b)

    reference = batch.reference_output().to(merged.device)[rows]
    atol, rtol = TOLERANCES[spec.dtype]
    error = (merged - reference).abs()
    metrics = {"merge_max_abs_error": float(error.nan_to_num(float("inf")).max())}
    bad = ~(error <= atol + rtol * reference.abs())
    if not bad.any():
        return None, metrics
    return (
        f"the step merged by the LSEs of its context piece and its new-token piece (vLLM's MLA prefill with "
        f"context) differs from the oracle on {int(bad.sum())} of {bad.numel()} elements: max abs error "
        f"{metrics['merge_max_abs_error']:.3g} (atol {atol:g}, rtol {rtol:g})"
    ), metrics
