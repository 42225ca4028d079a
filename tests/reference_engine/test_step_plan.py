"""The typed step plan: rows as the host plans them, uploaded in one copy as the same type, and the
host's lengths for the verify step and each draft step."""

import torch

from reference_engine.handoff import Uploader
from reference_engine.step_plan import HostLengths, StepRows


def planned() -> StepRows[list[int]]:
    rows = StepRows.empty()
    common = dict(host_last_token=-1, width=3, num_spec_tokens=2)
    rows.add_row(
        slot=4,
        host_ids=[0, 0, 0],
        inputs_from_device=True,
        decode=True,
        num_valid=3,
        num_drafts=2,
        produces=True,
        host_start=10,
        capacity=32,
        block_ids=[7],
        **common,
    )
    rows.add_row(
        slot=1,
        host_ids=[5, 6],
        inputs_from_device=False,
        decode=False,
        num_valid=2,
        num_drafts=0,
        produces=False,
        host_start=0,
        capacity=16,
        block_ids=[2, 3],
        **common,
    )
    return rows


def test_rows_and_their_upload():
    rows = planned()
    assert rows.query_start_loc == [0, 3, 5] and rows.token_row == [0, 0, 0, 1, 1]
    assert rows.is_decode == [1, 0] and rows.decode == [1, 0] and rows.num_decodes == 1
    assert rows.logits_index == [0, 1, 2, 4, 4, 4]  # a decode row's k + 1 positions, a prefill row's last
    assert rows.block_table == [7, 0, 0, 2, 3, 0]
    uploaded = Uploader(64, torch.device("cpu")).upload(rows)
    assert isinstance(uploaded, StepRows) and uploaded.slots.tolist() == [4, 1]
    assert uploaded.host_ids.tolist() == [0, 0, 0, 5, 6] and uploaded.produces.tolist() == [1, 0]


def test_host_lengths_of_the_verify_and_draft_steps():
    host = HostLengths()
    host.add_row(10, 3, 2)  # decode: last token + 2 drafts
    host.add_row(20, 1, 0)  # decode, no drafts this step
    host.add_row(0, 8, 0)  # prefill chunk
    assert host.query_start_loc == [0, 3, 4, 12]
    assert host.seq_lens() == [13, 21, 8]
    # Draft step i writes position start + i; a row stops advancing at its last draft.
    assert [host.draft_seq_lens(index, 2) for index in range(3)] == [[11, 21], [12, 21], [12, 21]]
