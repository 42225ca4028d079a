"""Random case data that is the same, bit for bit, on every device, and drawn where it is used.

``torch.randn`` with a CPU generator is reproducible on any machine but slow: drawing data was 97
of the 155 profiled seconds of a warm standard-suite run of the triton backend (cProfile, one H100,
both process groups). PyTorch's CUDA generator is fast, but which number lands at which index
depends on the grid it launches, so on the GPU's SM count: a failure seen on one GPU kind would
not reproduce on another, nor on a CPU.

So the numbers are a counter-based hash computed with integer tensor ops, which every device
computes exactly: element ``i`` of stream ``s`` depends on ``(seed, s, i)`` alone, and is drawn on
the device that will hold it (no host-to-device copy). The hash is two rounds of a 32-bit
multiply-xorshift mixer (Wellons' ``lowbias32`` form; int32 tensors, whose multiply wraps on
every device PyTorch runs on).

Distribution: the sum of four independent uniform 16-bit integers, centred and scaled to unit
variance (Irwin-Hall, n = 4): mean 0, variance 1, |x| < 3.47, kurtosis 2.7 where a normal's is
3. Every step is exact (integers below 2^18, one conversion to float32, one correctly rounded
float32 multiply), which is what makes CPU and GPU agree. Each value is an integer times a
scale that is not a power of two, rounded to float32, so an fp32 case's data uses every bit of
fp32's mantissa: a backend that rounds fp32 inputs to bf16 or TF32 still shows it.
"""
from __future__ import annotations

import math

import torch

MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd, below 2^31: valid int32 scalars
STREAM_SALT = 0x3C6EF372  # separates the keys of streams that share a seed
HALF_MASK = 0xFFFF
SUM_MEAN = 2 * HALF_MASK  # of four uniform 16-bit integers
UNIT_VARIANCE_SCALE = 1.0 / math.sqrt(4 * ((HALF_MASK + 1) ** 2 - 1) / 12.0)
CHUNK_NUMBERS = 1 << 24  # numbers drawn per pass: bounds the int32 temporaries at ~0.5 GiB


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (``>>`` on int32 is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit patterns with good avalanche, in place on an int32 tensor."""
    x ^= _shift_right(x, 16)
    x *= MULTIPLIERS[0]
    x ^= _shift_right(x, 15)
    x *= MULTIPLIERS[1]
    x ^= _shift_right(x, 16)
    return x


def _stream_key(seed: int, stream: int) -> int:
    """A 31-bit key per (seed, stream), mixed on the host with the same function as the data."""
    key = torch.tensor([(seed ^ (stream * STREAM_SALT)) & 0x7FFFFFFF], dtype=torch.int32)
    return int(mix32(key)[0])


class CaseRandom:
    """Successive streams of unit-variance numbers for one seed; ``normal`` draws the next one."""

    def __init__(self, seed: int, device: torch.device | str):
        self.seed, self.device = seed, torch.device(device)
        self.streams = 0

    def normal(self, *shape: int) -> torch.Tensor:
        """A float32 tensor of ``shape`` on the device: the next stream's first numbers."""
        key = _stream_key(self.seed, self.streams)
        self.streams += 1
        count = math.prod(shape)
        if 2 * count >= 2**31:
            raise ValueError(f"{count} numbers in one tensor: the counters are int32 (draw it in parts)")
        out = torch.empty(count, dtype=torch.float32, device=self.device)
        for start in range(0, count, CHUNK_NUMBERS):
            end = min(count, start + CHUNK_NUMBERS)
            # Two 32-bit hashes per number, at counters 2i and 2i + 1.
            bits = mix32(mix32(torch.arange(2 * start, 2 * end, dtype=torch.int32, device=self.device)) ^ key)
            halves = (bits & HALF_MASK) + _shift_right(bits, 16)
            total = halves.view(-1, 2).sum(dim=1, dtype=torch.int32) - SUM_MEAN
            out[start:end] = total.to(torch.float32).mul_(UNIT_VARIANCE_SCALE)
        return out.view(shape)
