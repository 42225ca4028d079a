"""The graph harness's memory-frugal comparisons (CPU-runnable)."""
import torch

from conformance.inputs.graph_harness import FREED_MEMORY_FILL, canaries_written, count_different


def test_count_different_counts_across_chunk_boundaries():
    a = torch.zeros(10, 7)
    b = a.clone()
    b[0, 0], b[4, 6], b[9, 6] = 1, 2, 3  # first element, a chunk's last, the very last
    for chunk in (1, 5, 35, 1000):
        assert count_different(a, b, chunk_elements=chunk) == 3
    assert count_different(a, 0.0, chunk_elements=4) == 0 and count_different(b, 0.0, chunk_elements=4) == 3


def test_canaries_written_counts_bytes_that_lost_the_fill():
    canaries = [torch.full((100,), FREED_MEMORY_FILL, dtype=torch.uint8) for _ in range(2)]
    assert canaries_written(canaries) == 0
    canaries[1][[0, 99]] = 0
    assert canaries_written(canaries) == 2
