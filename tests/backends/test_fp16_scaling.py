"""``kernels.fp16_scaling``: the power of two that brings a bf16 query into fp16's range before an
fp8 cache's fp16 products. Run by Triton's CPU interpreter (a process of its own): a query of any
magnitude comes out finite, its largest element in [2^11, 2^14), and every element down to 2^-25
of the largest exactly recovered by the inverse."""

import pytest

from tests.interpreted import interpreted

SCRIPT = r"""
import math, sys, torch, triton, triton.language as tl
from backends.triton.kernels import fp16_scaling, largest_magnitude

@triton.jit
def scale_kernel(q_ptr, out_ptr, factors_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    q = tl.load(q_ptr + offsets)
    up, down = fp16_scaling(largest_magnitude(q))
    tl.store(out_ptr + offsets, (q.to(tl.float32) * up).to(tl.float16))
    tl.store(factors_ptr, up)
    tl.store(factors_ptr + 1, down)

generator = torch.Generator().manual_seed(0)
for top in (0.0, 1e-30, 3e-5, 1.0, 2.0**14, 65504.0, 7e4, 1e6, 3e38):
    q = torch.randn(16, 16, generator=generator)
    q = (q / q.abs().max() * top).to(torch.bfloat16)
    q[0, 0] = top  # the largest, exactly (a power of two for some: log2's edge)
    q[1, 1] = top * 2.0**-25
    q[2, 2] = top * 2.0**-40
    out = torch.empty(16, 16, dtype=torch.float16)
    factors = torch.empty(2, dtype=torch.float32)
    scale_kernel[(1,)](q, out, factors, ROWS=16, COLS=16)
    up, down = factors.tolist()
    exponent = math.log2(up)
    largest = out.float().abs().max().item()
    kept = q.float().abs() >= top * 2.0**-25
    back = out.float() * down
    print(top, exponent == int(exponent), up * down == 1.0, bool(torch.isfinite(out.float()).all()),
          top == 0 or 2.0**11 <= largest < 2.0**14, bool((back[kept] == q.float()[kept]).all()),
          bool(((back - q.float()).abs() <= top * 2.0**-36).all()))
"""


@pytest.mark.slow
def test_any_query_magnitude_scales_into_fp16_exactly():
    lines = interpreted(SCRIPT).split("\n")[:-1]
    assert len(lines) == 9
    for line in lines:
        top, *properties = line.split()
        assert properties == ["True"] * 6, f"query magnitude {top}: {properties}"
