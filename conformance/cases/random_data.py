"""Random case data that is the same, bit for bit, on every device, and drawn where it is used.

``torch.randn`` with a CPU generator is reproducible on any machine but slow: drawing data was 97
of the 155 profiled seconds of a warm standard-suite run of the triton backend (cProfile, one H100,
both process groups). PyTorch's CUDA generator is fast, but which number lands at which index
depends on the grid it launches, so on the GPU's SM count: a failure seen on one GPU kind would
not reproduce on another, nor on a CPU.

So the numbers are a counter-based hash computed with integer tensor ops, which every device
computes exactly: element ``i`` of stream ``s`` depends on ``(seed, s, i)`` alone, and is drawn on
the device that will hold it (no host-to-device copy). The hash is two rounds of a 32-bit
multiply-xorshift mixer (Wellons' ``lowbias32`` form) on int32 tensors, whose multiply wraps on the
CPU and on CUDA alike (``test_random_data`` compares the two, and both with a Python definition).

Distribution: the sum of four independent uniform 16-bit integers, centred and scaled to unit
variance (Irwin-Hall, n = 4): mean 0, variance 1, |x| < 3.47, kurtosis 2.7 where a normal's is
3. Every step is exact (integers below 2^18, one conversion to float32, one correctly rounded
float32 multiply), which is what makes CPU and GPU agree. Each value is an integer times a
scale that is not a power of two, rounded to float32, so an fp32 case's data uses every bit of
fp32's mantissa: a backend that rounds fp32 inputs to bf16 or TF32 still shows it.
"""

from __future__ import annotations

import itertools
import math

import torch

MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd, below 2^31: valid int32 scalars
STREAM_SALT = 0x3C6EF372  # separates the keys of streams that share a seed
HALF_MASK = 0xFFFF
SUM_MEAN = 2 * HALF_MASK  # of four uniform 16-bit integers
UNIT_VARIANCE_SCALE = 1.0 / math.sqrt(4 * ((HALF_MASK + 1) ** 2 - 1) / 12.0)
# Numbers drawn per pass. On a GPU a large pass keeps launches few (the temporaries stay under
# about 1 GiB). On a CPU a pass's temporaries must stay in cache and under glibc's mmap threshold:
# at 2^24 each pass mapped and zeroed fresh pages, and half a CPU run's time was the kernel's
# (250M numbers: 25 s, 29 s of it system time; at 2^16: 5.3 s, 1.2 s). Which pass draws a number
# does not change it: the bits are the same either way.
CHUNK_NUMBERS = {"cuda": 1 << 24, "cpu": 1 << 16}
SEGMENT_NUMBERS = 1 << 30  # numbers per key: counters 2i and 2i + 1 stay below 2^31


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


def stream_keys(seed: int, streams: int) -> torch.Tensor:
    """A 32-bit key per stream of ``seed`` (int32, CPU), mixed with the same function as the data."""
    salted = [(seed ^ (stream * STREAM_SALT)) & 0x7FFFFFFF for stream in range(streams)]
    return mix32(torch.tensor(salted, dtype=torch.int32))


def segments(seed: int, counts: list[int]) -> tuple[list[int], list[int]]:
    """The key and length of each segment of the streams, in order. A stream's counters are int32,
    so it runs SEGMENT_NUMBERS numbers per key; past that (a context of a million tokens) it goes
    on under a key derived from its own and the segment's index."""
    keys, lengths = [], []
    for key, count in zip(stream_keys(seed, len(counts)).tolist(), counts):
        for part, first in enumerate(range(0, count, SEGMENT_NUMBERS)):
            keys.append(key if part == 0 else int(stream_keys(key & 0x7FFFFFFF, part + 1)[part]))
            lengths.append(min(SEGMENT_NUMBERS, count - first))
    return keys, lengths


def normal_tensors(seed: int, shapes: list[tuple[int, ...]], device: torch.device | str) -> list[torch.Tensor]:
    """Float32 tensors of ``shapes`` on ``device``: tensor ``t`` holds the first numbers of stream
    ``t`` of ``seed``. All of them are drawn together, a chunk of their concatenation at a time, so
    a case of a thousand small tensors costs a few dozen kernel launches, not thousands."""
    device = torch.device(device)
    counts = [math.prod(shape) for shape in shapes]
    keys, lengths = segments(seed, counts)
    starts = torch.tensor([0] + list(itertools.accumulate(lengths))[:-1], dtype=torch.int64, device=device)
    keys = torch.tensor(keys, dtype=torch.int32, device=device)
    total = sum(counts)
    out = torch.empty(total, dtype=torch.float32, device=device)
    chunk = CHUNK_NUMBERS.get(device.type, CHUNK_NUMBERS["cpu"])
    for first in range(0, total, chunk):
        position = torch.arange(first, min(total, first + chunk), dtype=torch.int64, device=device)
        segment = torch.searchsorted(starts, position, right=True) - 1
        index = (position - starts[segment]).to(torch.int32)
        counters = torch.stack([2 * index, 2 * index + 1], dim=1)  # two 32-bit hashes per number
        bits = mix32(mix32(counters) ^ keys[segment].unsqueeze(1))
        halves = (bits & HALF_MASK) + _shift_right(bits, 16)
        centred = halves.sum(dim=1, dtype=torch.int32) - SUM_MEAN
        out[first : first + position.numel()] = centred.to(torch.float32).mul_(UNIT_VARIANCE_SCALE)
    return [part.view(shape) for part, shape in zip(out.split(counts), shapes)]
