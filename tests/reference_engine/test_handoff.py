"""The step upload: every field lands on the device with the host's values, int64 but for the
fields attention reads as int32, those on 64-byte boundaries; a step of the same field lengths
reuses the views (the offsets a graph's buffers are fixed by), another step's values change under
them; a step past the staging buffer is refused."""

import pytest
import torch

from reference_engine.handoff import Uploader
from reference_engine.step_plan import StepRows


def planned(slot: int, block_ids: list[int], host_ids: list[int]) -> StepRows[list[int]]:
    rows = StepRows.empty()
    rows.add_row(
        slot=slot,
        host_ids=host_ids,
        inputs_from_device=False,
        decode=False,
        num_valid=len(host_ids),
        num_drafts=0,
        produces=True,
        host_last_token=-1,
        host_start=5,
        capacity=48,
        block_ids=block_ids,
        width=4,
        num_spec_tokens=2,
    )
    rows.add_row(
        slot=7,
        host_ids=[0, 0, 0],
        inputs_from_device=True,
        decode=True,
        num_valid=3,
        num_drafts=2,
        produces=True,
        host_last_token=-1,
        host_start=30,
        capacity=32,
        block_ids=[9, 2],
        width=4,
        num_spec_tokens=2,
    )
    return rows


def test_every_field_lands_with_its_values_and_dtype():
    uploader = Uploader(256, torch.device("cpu"))
    rows = planned(3, [4, 5, 6], [11, 12])
    uploaded = uploader.upload(rows)
    for name in ("slots", "query_start_loc", "token_row", "host_ids", "logits_index", "host_start", "block_table"):
        view = getattr(uploaded, name)
        assert view.tolist() == getattr(rows, name), name
        assert view.dtype == (torch.int32 if name in StepRows.INT32 else torch.int64), name
    for name in StepRows.INT32:
        assert getattr(uploaded, name).data_ptr() % 64 == 0, name
    again = planned(1, [8], [13, 2**40])  # the same lengths: the same views, the new values
    assert uploader.upload(again) is uploaded
    assert uploaded.block_table.tolist() == [8, 0, 0, 0, 9, 2, 0, 0] and uploaded.host_ids[1] == 2**40


def test_a_step_past_the_staging_buffer_is_refused():
    with pytest.raises(RuntimeError, match="exceeds the staging buffer"):
        Uploader(8, torch.device("cpu")).upload(planned(3, [4, 5, 6], [11, 12]))
