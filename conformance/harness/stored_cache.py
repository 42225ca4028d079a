"""What a step's output must equal, and, for an fp8 layer, what its cache must hold.

A cache in the compute dtype holds the batch's numbers exactly: the output must equal the
oracle's attention of the batch (``PagedBatch.reference_output``). An fp8 cache holds them
quantized (``kv_quantization``), so the two halves are checked apart: ``write_findings`` compares
what ``write_kv`` stored (read back through the backend's ``read_kv``) with the contract's
quantization, and ``expected_output`` is the float64 attention of that stored cache.

A kernel may dequantize into its compute dtype (``stored × scale`` in float32, rounded to bf16 or
fp16, as vLLM's Triton unified attention does) or keep the product exact (a scale folded into the
scores): both attend over the dequantized cache as the contract says, and they differ by the
rounding of every key and value, which moves a score of magnitude s by about s × 2^-9 in bf16.
Where a few large scores share the softmax (edges data) that reached 2.4× the output tolerance
(``test_fp8``). Rounding the scale itself is not allowed: every number then moves the same way. So
the allowance ``oracle`` returns is how far the oracle over the cache rounded to
the layer's dtype lies from the exact one, element by element; the comparison adds it to the
tolerance (an output within tolerance of either oracle passes).
"""

from __future__ import annotations

from typing import Any

import torch

from conformance.cases.kv_quantization import (
    ONE_ULP_FRACTION,
    block_quantize,
    dequantize,
    largest,
    quantize,
    ulps_apart,
)
from conformance.cases.oracle import layer_reference
from conformance.harness.answers import answer_for
from conformance.harness.batch import joined
from conformance.harness.step import PreparedCase


def quantized(prepared: PreparedCase) -> bool:
    """Whether the layer's cache holds its numbers quantized: an fp8 cache, with the layer's scales,
    DeepSeek's fp8_ds_mla (its scales its own: ``read_kv`` returns the entries dequantized) or an
    indexer's (a scale a token, which ``read_kv`` returns beside the keys)."""
    return prepared.batch.spec.fp8_kv_cache


def _stored(prepared: PreparedCase, request: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every position of ``request`` as the backend stored it (history and this step)."""
    batch = prepared.batch
    slots = batch.slots(request, range(0, batch.seq_lens[request])).to(batch.device)
    key, value = prepared.backend.read_kv(prepared.kv_cache, slots)
    return key, value


def attended_values(prepared: PreparedCase, request: int, head: int, *, negated: bool = False) -> torch.Tensor:
    """[seq_len, Dv]: the values query head ``head`` of ``request`` attends over, as the oracle of
    ``expected_output`` has them (an fp8 layer's: its stored cache, dequantized); ``negated``: of a
    step run negated, the values negated back."""
    batch = prepared.batch
    if not quantized(prepared):
        return batch.head_values(request, head)
    key, value = _stored(prepared, request)
    spec = batch.spec
    # The kind's own scales: MLA's one latent entry is dequantized by k_scale (``LayerKind.scales``);
    # fp8_ds_mla's entries come back dequantized.
    scales = prepared.scales
    v_scale = 1.0 if scales is None else spec.layout.scales(scales.k_scale, scales.v_scale)[1]
    values = dequantize(spec.layout.head_values(spec, key, value, head), v_scale)
    return values.neg() if negated else values


def expected_output(prepared: PreparedCase, *, negated: bool = False) -> torch.Tensor:
    """The oracle's answer for ``prepared``'s step, float64 (an attention's ``[num_tokens, H, Dv]``,
    an indexer's logits in tolerances: ``harness.answers``) (``negated``: of
    the step whose query, key, value and pool were negated, ``run_step(negated=True)``). For an
    fp8 layer, of the cache as stored, after the step."""
    batch = prepared.batch
    if not quantized(prepared):
        reference = batch.reference_output()
        return answer_for(batch.spec).negated(reference) if negated else reference
    return _solve(prepared, negated=negated)[0]


def oracle(prepared: PreparedCase, *, negated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a comparison of the step's output needs: (``expected_output``, the rounding allowance).
    The allowance, for an fp8 layer, is |oracle over the stored cache dequantized exactly − oracle
    over it dequantized into the layer's dtype| (module docstring); None for a cache in the compute
    dtype, which holds its numbers exactly. The exact oracle is solved once for both."""
    if not quantized(prepared):
        return expected_output(prepared, negated=negated), None
    exact = _solve(prepared, negated=negated)[0]
    if not prepared.batch.spec.layout.attends:  # an indexer's logits carry their own tolerance
        return exact, None
    return exact, (exact - _solve(prepared, negated=negated, rounded=True)[0]).abs()


def expected_lse(prepared: PreparedCase, *, negated: bool = False, rounded: bool = False) -> torch.Tensor:
    """[num_tokens, H] float64: the oracle's log-sum-exp for ``prepared``'s step (natural log of
    each softmax's denominator; an fp8 layer's over its stored cache). ``negated``: of the step
    run negated, whose scores, and so its LSE, are the step's own (an fp8 layer's stored cache
    holds the keys negated: its query is negated too). ``rounded``: an fp8 layer's cache dequantized
    into the compute dtype (``oracle``'s allowance, for the LSE)."""
    return _solve(prepared, negated=negated and quantized(prepared), rounded=rounded)[1]


def _solve(
    prepared: PreparedCase, *, negated: bool = False, rounded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of the oracle over the cache as the step leaves it: the batch's own
    rows, or an fp8 layer's stored ones dequantized (``rounded``: into the layer's dtype)."""
    batch, spec, scales = prepared.batch, prepared.batch.spec, prepared.scales
    stored = quantized(prepared)

    def dequantized(rows: torch.Tensor | None, scale: float) -> torch.Tensor | None:
        if rows is None or not stored:
            return rows
        exact = dequantize(rows, scale)
        return exact.to(spec.dtype).double() if rounded else exact

    outputs, sums = [], []
    for request, (context_len, _) in enumerate(batch.case.batch):
        start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
        query = batch.query_values(start, end)
        query = query.neg() if negated else query
        key, value = (
            spec.layout.stored_entries(*_stored(prepared, request))
            if stored
            else (batch.keys[request], batch.values[request])
        )
        k_scale, v_scale = (scales.k_scale, scales.v_scale) if scales is not None else (1.0, 1.0)
        out, lse = layer_reference(
            spec,
            query,
            dequantized(key, k_scale),
            dequantized(value, v_scale),
            context_len=context_len,
            return_lse=True,
            **batch.oracle_inputs(request),
        )
        outputs.append(out)
        sums.append(lse)
    return joined(outputs), None if None in sums else torch.cat(sums)


def _place(
    stored: torch.Tensor, expected: torch.Tensor, apart: torch.Tensor, scale: float, request: int, plane: str
) -> dict[str, Any]:
    """Where ``apart`` is largest: position, head and channel, and the two numbers dequantized."""
    index = int(apart.flatten().argmax())
    per_position = apart[0].numel()
    position, within = divmod(index, per_position)
    head, channel = divmod(within, stored.shape[-1]) if stored.dim() == 3 else (0, within)
    return {
        "request": request,
        "position": position,
        "head": head,
        "channel": channel,
        "plane": plane,
        "stored": float(stored.flatten()[index].float()) * scale,
        "contract": float(expected.flatten()[index].float()) * scale,
        "steps": int(apart.flatten()[index]),
    }


def write_findings(prepared: PreparedCase, *, negated: bool = False) -> dict[str, Any] | None:
    """None when every stored number of every request is the contract's quantization of what
    ``write_kv`` was given (one fp8 step off allowed on ``ONE_ULP_FRACTION`` of them); else what is
    wrong and where first: ``{"what", "place", "worst"}``."""
    batch, scales = prepared.batch, prepared.scales
    if batch.spec.kv_scale_block is not None:
        return _block_write_findings(prepared, negated=negated)
    if batch.case.kv_scales is None:  # a cache in the compute dtype (an fp8 query's layer too)
        return None
    dtype = batch.spec.kv_cache_dtype
    elements = one_step = 0
    worst: dict[str, Any] | None = None
    for request in range(batch.case.num_reqs):
        stored_key, stored_value = _stored(prepared, request)
        planes = [("key", stored_key, batch.keys[request], scales.k_scale)]
        if stored_value is not None:
            planes.append(("value", stored_value, batch.values[request], scales.v_scale))
        for plane, stored, given, scale in planes:
            expected = quantize(given.neg() if negated else given, scale, dtype).to(stored.device)
            if stored.shape != expected.shape or stored.dtype != dtype:
                return {
                    "what": f"read_kv returned {plane}s of shape {tuple(stored.shape)} and dtype {stored.dtype}; "
                    f"expected {tuple(expected.shape)} {dtype}",
                    "place": f"request {request}",
                }
            apart = ulps_apart(stored, expected)
            elements += apart.numel()
            one_step += int((apart == 1).sum())
            if apart.numel() and (worst is None or int(apart.max()) > worst["steps"]):
                worst = _place(stored, expected, apart, scale, request, plane)
    allowed = int(ONE_ULP_FRACTION * elements)
    if worst is None or (worst["steps"] <= 1 and one_step <= allowed):
        return None
    stored_nan, contract_nan = worst["stored"] != worst["stored"], worst["contract"] != worst["contract"]
    saturated = abs(worst["contract"]) == largest(dtype) * (
        scales.k_scale if worst["plane"] == "key" else scales.v_scale
    )
    if stored_nan and saturated:
        what = "write_kv stored NaN where the contract saturates to the format's largest number"
    elif stored_nan or contract_nan:
        what = (
            f"write_kv stored {'NaN' if stored_nan else 'a number'} where "
            f"the contract stores {'NaN' if contract_nan else 'a number'}"
        )
    elif worst["steps"] > 1:
        what = (
            f"write_kv stored a number {worst['steps']} fp8 steps from the contract's quantization "
            "(value / scale, rounded to nearest even, saturated)"
        )
    else:
        what = (
            f"write_kv rounded {one_step} of {elements} stored numbers one fp8 step away from the contract's "
            f"(at most {allowed}, {ONE_ULP_FRACTION:.0%}, allowed for values on a rounding boundary): a rounding "
            "rule other than round-to-nearest-even (truncation?)"
        )
    where = (
        f"request {worst['request']} position {worst['position']} head {worst['head']} channel "
        f"{worst['channel']} ({worst['plane']}): stored {worst['stored']:.6g}, contract {worst['contract']:.6g} "
        "(dequantized)"
    )
    return {"what": what, "place": where, "worst": worst}


def _block_write_findings(prepared: PreparedCase, *, negated: bool = False) -> dict[str, Any] | None:
    """``write_findings`` for DeepSeek's fp8_ds_mla: each token's latent, read back dequantized,
    over the contract's scales of its blocks (``block_quantize``) must be the contract's e4m3 numbers
    (one step off allowed on ``ONE_ULP_FRACTION`` of them), and its rope part exactly as given. A
    block stored over another scale (one a token, say) lands between the contract's numbers."""
    batch, spec = prepared.batch, prepared.batch.spec
    latent_dim, block = spec.kv_lora_rank, spec.kv_scale_block
    elements = one_step = 0
    for request in range(batch.case.num_reqs):
        entry, _ = _stored(prepared, request)
        given = batch.keys[request].neg() if negated else batch.keys[request]
        if not given.shape[0]:
            continue
        expected, scales = block_quantize(given[:, :latent_dim].cpu(), block, spec.kv_cache_dtype)
        over = entry[:, :latent_dim].double().cpu().reshape(-1, latent_dim // block, block)
        requantized = (over / scales.double()[..., None]).reshape(-1, latent_dim).float().to(spec.kv_cache_dtype)
        apart = ulps_apart(requantized, expected)
        elements += apart.numel()
        one_step += int((apart == 1).sum())
        if bool((apart > 1).any()):
            position, channel = (apart > 1).nonzero()[0].tolist()
            return {
                "what": "the cache read back (read_kv) holds a latent number more than one e4m3 step from the "
                f"contract's (its block of {block} over max(max|x| / 448, FLT_MIN)): write_kv stored it, or read_kv "
                "dequantizes it, wrong",
                "place": f"request {request} position {position} channel {channel}",
            }
        rope = entry[:, latent_dim:].double().cpu()
        if not torch.equal(rope, given[:, latent_dim:].double().cpu()):
            position = int((rope != given[:, latent_dim:].double().cpu()).any(dim=1).nonzero()[0])
            return {
                "what": "write_kv changed the rope part (stored unquantized)",
                "place": f"request {request} position {position}",
            }
    if one_step > ONE_ULP_FRACTION * elements:
        return {
            "what": f"write_kv rounded {one_step} of {elements} latent numbers one e4m3 step away from the contract's",
            "place": "every request",
        }
    return None
