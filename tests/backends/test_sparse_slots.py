"""The sparse slot translation's Triton launch against its torch formula, under Triton's CPU
interpreter: random index rows (-1s, entries past the token's position), window parts, padding
rows, an index row that is a strided view, more columns than one program covers, and block-table
rows of -1 past each request's last block. The torch
formula itself is judged end to end by tests/backends/test_flashmla_sparse.py."""

import pytest

from tests.interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = """
import sys, torch
from backends.sparse_slots import slots_with_torch, slots_with_triton
topk, window, block_size, tokens, real, entries = map(int, sys.argv[1:7])
generator = torch.Generator().manual_seed(topk + window)
requests, blocks = 3, 64
table = torch.randperm(requests * blocks, generator=generator).view(requests, blocks).to(torch.int32)
request = torch.randint(0, requests, (tokens,), generator=generator)
position = torch.randint(0, blocks * block_size - 1, (tokens,), generator=generator)
wide = torch.randint(-1, blocks * block_size, (tokens, 2 * topk + 3), generator=generator, dtype=torch.int32)
rows = wide[:, 3::2]  # a strided view, as a layer's index rows may be
num_tokens = torch.tensor([real])
# A real pool's table: -1 past each request's last block (its furthest token's position), so a
# translation that reads the table for an entry it then drops reads block -1.
for r in range(requests):
    own = position[:real][request[:real] == r]
    table[r, (int(own.max()) // block_size + 1 if len(own) else 0) :] = -1
outputs = []
for translate in (slots_with_torch, slots_with_triton):
    out = torch.full((tokens, entries), 12345, dtype=torch.int32)
    translate(rows, request, position, num_tokens, table, out, window=window, block_size=block_size)
    outputs.append(out)
mismatch = (outputs[0] != outputs[1]).nonzero()
below = sum(int((out < -1).sum()) for out in outputs)  # a slot made from block -1
print(len(mismatch) + below, (outputs[1] >= 0).sum().item(), f"{below} below -1; differ at", mismatch[:5].tolist())
"""


@pytest.mark.parametrize(
    "topk, window, block_size, tokens, real, entries",
    [
        (20, 6, 4, 7, 5, 32),  # a window part, two padding rows, columns past the entries
        (600, 30, 64, 3, 3, 640),  # two programs a token
        (64, 0, 16, 4, 1, 64),  # no window; three padding rows
    ],
)
def test_the_triton_translation_matches_the_formula(topk, window, block_size, tokens, real, entries):
    mismatches, listed, first = interpreted(SCRIPT, *map(str, (topk, window, block_size, tokens, real, entries))).split(
        maxsplit=2
    )
    assert mismatches == "0", first
    assert int(listed) > real  # the rows listed slots (not a trivially all -1 output)
