"""Equal to the float64 oracle: the element test every check that compares outputs uses.

An element passes when |out - ref| <= atol + rtol * |ref| (numpy's ``isclose``), with atol/rtol
chosen by dtype. Inputs are rounded to the dtype before the oracle sees them, so the tolerance
covers only what a kernel does: low-precision products and accumulation, softmax in fp32, and
the final rounding of the output. fp32 allows TF32 matmuls. An fp8 layer's comparison adds the
rounding allowance ``stored_cache.oracle`` returns: dequantizing into the compute dtype is allowed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # evidence imports what imports this module
    from conformance.harness.evidence import WorstElement

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {  # dtype: (atol, rtol)
    torch.float32: (1e-3, 1e-3),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def compare_with_oracle(
    out: torch.Tensor,
    reference: torch.Tensor,
    query_start_loc: list[int],
    atol: float,
    rtol: float,
    allowance: torch.Tensor | None = None,
) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """(passed, metrics, evidence) for backend output ``out`` against the oracle's ``reference``;
    ``allowance``: per element, added to the tolerance (an fp8 layer's rounding allowance)."""
    out = out.double()
    reference = reference.to(out.device)
    diff = (out - reference).abs()
    non_finite = ~torch.isfinite(out)
    allowed = atol + rtol * reference.abs()
    if allowance is not None:
        allowed = allowed + allowance.to(out.device)
    # NaN compares false with everything: count it as a mismatch explicitly.
    mismatched = (diff > allowed) | non_finite
    excess = torch.where(non_finite, torch.full_like(diff, float("inf")), diff - allowed)
    finite_diff = torch.where(non_finite, torch.zeros_like(diff), diff)
    significant = reference.abs() > atol

    worst_flat = int(excess.flatten().argmax())
    # divmod, not torch.unravel_index: its first call imports sympy (3 s of every process).
    heads, channels = excess.shape[1:]
    token, within = divmod(worst_flat, heads * channels)
    head, channel = divmod(within, channels)
    request = max(r for r in range(len(query_start_loc) - 1) if query_start_loc[r] <= token)
    metrics = {
        "max_abs_error": float(finite_diff.max()),
        "max_rel_error": float((finite_diff / reference.abs()).masked_fill(~significant, 0).max()),
        "mismatch_fraction": float(mismatched.double().mean()),
        "mismatched": int(mismatched.sum()),
        "elements": out.numel(),
        "non_finite": int(non_finite.sum()),
        # How far past the tolerance the worst element is (1.0 = at the limit; inf for NaN/Inf):
        # the margin by which a defect fails, or a correct backend passes.
        "tolerance_ratio": float(torch.where(non_finite, torch.full_like(diff, float("inf")), diff / allowed).max()),
    }
    evidence: "dict[str, WorstElement]" = {
        "worst": {
            "request": request,
            "token": token - query_start_loc[request],
            "head": head,
            "channel": channel,
            "got": float(out[token, head, channel]),
            "expected": float(reference[token, head, channel]),
        }
    }
    return not bool(mismatched.any()), metrics, evidence


def mismatched_rows(
    out: torch.Tensor,
    reference: torch.Tensor,
    allowance: torch.Tensor | None,
    atol: float,
    rtol: float,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """bool [rows]: the rows with an element beyond ``compare_with_oracle``'s test (NaN counts),
    a chunk of rows at a time (the float64 differences of a whole bank would take its memory
    several times over)."""
    bad = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for start in range(0, out.shape[0], chunk_rows):
        got = out[start : start + chunk_rows].double()
        expected = reference[start : start + chunk_rows].to(got.device)
        allowed = atol + rtol * expected.abs()
        if allowance is not None:
            allowed = allowed + allowance[start : start + chunk_rows].to(got.device)
        wrong = ((got - expected).abs() > allowed) | ~torch.isfinite(got)
        bad[start : start + chunk_rows] = wrong.flatten(1).any(dim=1)
    return bad


def how_far_off(errors: dict[str, Any]) -> str:
    """A failed comparison in words: how many outputs are not finite, or else beyond tolerance."""
    if errors["non_finite"]:
        return f"{errors['non_finite']} NaN/Inf outputs"
    return f"{errors['mismatched']} of {errors['elements']} elements beyond tolerance"


def worst_place(worst: WorstElement) -> str:
    """Where the worst element is, and its two values."""
    return (
        f"request {worst['request']} token {worst['token']} head {worst['head']}: "
        f"got {worst['got']:.4g}, expected {worst['expected']:.4g}"
    )
