import pytest
import torch

from conformance.cases import random_data
from conformance.cases.grammar import parse_case
from conformance.cases.random_data import mix32, normal_tensors
from conformance.harness.batch import materialize


def reference_mix32(v: int) -> int:
    """mix32 on Python integers with uint32 arithmetic (the definition), as a signed int32."""
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * random_data.MULTIPLIERS[0]) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * random_data.MULTIPLIERS[1]) & 0xFFFFFFFF
    v ^= v >> 16
    return v - (1 << 32) if v >= 1 << 31 else v


def reference_number(seed: int, stream: int, index: int) -> float:
    """Number ``index`` of a stream, from the module's docstring, in plain Python."""
    key = reference_mix32((seed ^ (stream * random_data.STREAM_SALT)) & 0x7FFFFFFF)
    total = 0
    for counter in (2 * index, 2 * index + 1):
        bits = reference_mix32(reference_mix32(counter) ^ key) & 0xFFFFFFFF
        total += (bits & 0xFFFF) + (bits >> 16)
    scaled = torch.tensor(float(total - 2 * 0xFFFF), dtype=torch.float32) * torch.tensor(
        random_data.UNIT_VARIANCE_SCALE, dtype=torch.float32
    )
    return float(scaled)


# The first numbers of seed 12345's first stream. A case id must draw the same data on every
# machine and in every version: a change here changes every failing case's reproduction.
PINNED_FIRST_NUMBERS = [-2.3401026725769043, -0.3807361423969269, -0.24978046119213104, 0.9022595286369324]


def draw(seed: int, *shapes: tuple[int, ...], device: str = "cpu") -> list[torch.Tensor]:
    return normal_tensors(seed, list(shapes), device)


def test_the_numbers_follow_their_definition_and_are_pinned():
    assert [reference_number(12345, 0, i) for i in range(4)] == PINNED_FIRST_NUMBERS
    assert draw(12345, (4,))[0].tolist() == PINNED_FIRST_NUMBERS
    _, later, last = draw(2**31 - 1, (1,), (5000,), (2, 3))  # streams 1 and 2, counters past 2^13
    assert [float(later[i]) for i in (0, 1234, 4999)] == [reference_number(2**31 - 1, 1, i) for i in (0, 1234, 4999)]
    assert last.flatten().tolist() == [reference_number(2**31 - 1, 2, i) for i in range(6)]


def test_streams_and_seeds_are_reproducible_and_independent():
    first, second = draw(7, (1000,), (1000,))
    again = draw(7, (1000,), (10, 100))
    assert torch.equal(again[0], first) and torch.equal(again[1].flatten(), second)
    (other_seed,) = draw(8, (1000,))
    for x, y in ((first, second), (first, other_seed)):
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 0.1


def test_the_distribution_has_unit_variance_and_no_neighbour_correlation():
    (x,) = draw(3, (1 << 20,))
    assert abs(float(x.mean())) < 0.005 and abs(float(x.var()) - 1.0) < 0.01
    assert float(x.abs().max()) < 3.47
    assert x.unique().numel() > 100_000  # not a coarse lattice
    for lag in (1, 2, 16, 128):
        assert abs(float(torch.corrcoef(torch.stack([x[:-lag], x[lag:]]))[0, 1])) < 0.01
    # Roughly normal: 68 % within one standard deviation (a uniform would give 58 %).
    assert 0.66 < float((x.abs() < 1).float().mean()) < 0.70


def test_drawing_in_chunks_draws_the_same_numbers(monkeypatch):
    shapes = [(3, 1000), (5,), (0,), (2, 700)]
    whole = draw(11, *shapes)
    assert [t.shape for t in whole] == [torch.Size(s) for s in shapes]
    monkeypatch.setattr(random_data, "CHUNK_NUMBERS", {"cpu": 999, "cuda": 999})  # chunks that start inside tensors
    assert all(torch.equal(a, b) for a, b in zip(draw(11, *shapes), whole))


def test_a_stream_past_one_key_goes_on_under_derived_keys(monkeypatch):
    """Past SEGMENT_NUMBERS a stream's counters would overflow int32: segment j of stream s is
    stream j of a seed equal to s's key, and nothing else moves."""
    whole = draw(5, (250,), (30,))
    monkeypatch.setattr(random_data, "SEGMENT_NUMBERS", 100)
    monkeypatch.setattr(random_data, "CHUNK_NUMBERS", {"cpu": 64, "cuda": 64})  # chunks that cross segment boundaries
    long, short = draw(5, (250,), (30,))
    assert torch.equal(long[:100], whole[0][:100]) and torch.equal(short, whole[1])
    key = reference_mix32((5 ^ (0 * random_data.STREAM_SALT)) & 0x7FFFFFFF) & 0x7FFFFFFF
    for part in (1, 2):
        expected = [reference_number(key, part, i) for i in range(min(100, 250 - 100 * part))]
        assert long[100 * part : 100 * part + len(expected)].tolist() == expected
    assert not torch.equal(long[100:200], long[:100])


def test_mix32_is_a_bijection_on_a_sample_and_wraps_like_uint32():
    x = torch.arange(-(1 << 16), 1 << 16, dtype=torch.int32)
    assert mix32(x.clone()).unique().numel() == x.numel()
    patterns = [0, 1, 12345, 0x7FFFFFFF, -1, -(1 << 31), 0x5BD1E995 - (1 << 31)]
    assert mix32(torch.tensor(patterns, dtype=torch.int32)).tolist() == [reference_mix32(v) for v in patterns]


@pytest.mark.gpu
def test_cpu_and_gpu_draw_the_same_bits():
    shapes = [(5,), (3, 8, 128), (random_data.CHUNK_NUMBERS["cuda"] + 77,), (1000,)]
    for cpu, gpu in zip(draw(99, *shapes), draw(99, *shapes, device="cuda")):
        assert torch.equal(cpu, gpu.cpu())
    # A whole case, its data profiles applied on each device.
    for case_id in (
        "gqa-h8/2-d64-outliers:300+1,40+4",
        "gqa-h8/2-d64-w32-edges:100+3",
        "mla-h16-d512+64-fp16:200+2",
        "mha-h4-d128-fp32-share1:50+1,70+2",
    ):
        case = parse_case(case_id)
        cpu, gpu = materialize(case, "cpu"), materialize(case, "cuda")
        assert torch.equal(cpu.query, gpu.query.cpu()), case_id
        assert all(torch.equal(k, g.cpu()) for k, g in zip(cpu.keys, gpu.keys)), case_id
        assert all(v is None or torch.equal(v, g.cpu()) for v, g in zip(cpu.values, gpu.values)), case_id
