"""``kernels.fp16_scaling``: the power of two that brings each row of a bf16 query into fp16's range
before an fp8 cache's fp16 products. Run by Triton's CPU interpreter (a process of its own), one
query of rows from 0 to 3e38 in magnitude, one of them inf: each row comes out with its largest
element in [2^12, 2^13) (the interpreter's log2 is exact: no slack used), every element down to
2^-25 of its row's largest exactly recovered by the inverse, and the inf row scales only itself."""

import pytest

from tests.interpreted import interpreted

SCRIPT = r"""
import math, torch, triton, triton.language as tl
from backends.triton.kernels import fp16_scaling, largest_magnitude

@triton.jit
def scale_kernel(q_ptr, out_ptr, up_ptr, down_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    q = tl.load(q_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :])
    up, down = fp16_scaling(largest_magnitude(q))
    scaled = (q.to(tl.float32) * up[:, None]).to(tl.float16)
    tl.store(out_ptr + rows[:, None] * COLS + tl.arange(0, COLS)[None, :], scaled)
    tl.store(up_ptr + rows, up)
    tl.store(down_ptr + rows, down)

TOPS = [0.0, 1e-36, 1e-30, 3e-5, 1.0, 2.0**14, 65504.0, 7e4, 1e6, 3e38, float("inf"), 2.0, 0.5, 1e3, 1e-3, 12.0]
q = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
q = q / q.abs().amax(dim=1, keepdim=True)
for row, top in enumerate(TOPS):
    q[row] = q[row] * (top if math.isfinite(top) else 1.0)
    q[row, 0] = top  # the row's largest, exactly (a power of two in some rows: log2's edge)
    q[row, 1] = top * 2.0**-25 if math.isfinite(top) else 1.0
    q[row, 2] = top * 2.0**-40 if math.isfinite(top) else 1.0
q = q.to(torch.bfloat16)
out = torch.empty(16, 16, dtype=torch.float16)
up, down = torch.empty(16), torch.empty(16)
scale_kernel[(1,)](q, out, up, down, ROWS=16, COLS=16)
for row, top in enumerate(TOPS):
    exponent = math.log2(up[row].item())
    top_bf16 = q[row].float().abs().max().item()
    if top_bf16 == 0 or not math.isfinite(top_bf16):
        nominal = 0 if top_bf16 == 0 else -126
    else:
        nominal = max(-126, min(126, 12 - math.floor(math.log2(top_bf16))))
    back = out[row].float() * down[row]
    kept = q[row].float().abs() >= top_bf16 * 2.0**-25
    finite = math.isfinite(top_bf16)
    largest = out[row].float().abs().max().item()
    print(top, exponent == nominal, up[row].item() * down[row].item() == 1.0,
          not finite or bool(torch.isfinite(out[row].float()).all()),
          not finite or top_bf16 == 0 or exponent == 126 or 2.0**12 <= largest < 2.0**13,
          not finite or exponent == 126 or bool((back[kept] == q[row].float()[kept]).all()),
          not finite or exponent == 126 or bool(((back - q[row].float()).abs() <= top_bf16 * 2.0**-36).all()))
"""


@pytest.mark.slow
def test_each_query_row_scales_into_fp16_exactly():
    lines = interpreted(SCRIPT).split("\n")[:-1]
    assert len(lines) == 16
    for line in lines:
        top, *properties = line.split()
        assert properties == ["True"] * 6, f"query row of magnitude {top}: {properties}"
