"""Attention's view of a graph-padded step whose padding rows are vLLM's empty requests: the real
rows as they are, each padding row of query length 0 and seq_len 0 with a block-table row of -1,
on the device (no host read: a graph replays it) and on the host alike."""

import torch

from reference_engine.empty_padding import EmptyPadding
from reference_engine.step_inputs import RowLayout, StepTensors


def test_padding_rows_become_empty_requests():
    # Two real verify rows of 4 tokens, two padding rows of 4 tokens each.
    num_valid = torch.tensor([4, 4, 0, 0])
    layout = RowLayout(
        slots=torch.tensor([0, 1, 9, 9]),
        query_start_loc=torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32),
        token_row=torch.arange(16) // 4,
        host_ids=torch.zeros(16, dtype=torch.int64),
        is_decode=torch.ones(4, dtype=torch.int64),
        num_valid=num_valid,
        block_table=torch.tensor([[3, 4], [5, 0], [0, 0], [0, 0]], dtype=torch.int32),
    )
    step = StepTensors(
        input_ids=torch.zeros(16, dtype=torch.int64),
        positions=torch.zeros(16, dtype=torch.int64),
        slot_mapping=torch.full((16,), -1),
        seq_lens=torch.tensor([20, 9, 4, 4], dtype=torch.int32),
    )
    padding = EmptyPadding(num_valid, width=2)
    starts, seq_lens, table = padding.device_view(layout, step)
    assert starts.tolist() == [0, 4, 8, 8, 8] and seq_lens.tolist() == [20, 9, 0, 0]
    assert table.tolist() == [[3, 4], [5, 0], [-1, -1], [-1, -1]]
    assert starts.dtype == seq_lens.dtype == table.dtype == torch.int32
    assert EmptyPadding.host_view([0, 4, 8, 12, 16], [20, 9, 4, 4], 2) == ([0, 4, 8, 8, 8], [20, 9, 0, 0])
    num_valid[2] = 4  # the next replay of the shape has three real rows: recomputed from the upload's view
    assert padding.device_view(layout, step)[0].tolist() == [0, 4, 8, 12, 12]
