"""The Triton kernel of ``step_inputs.prepare_triton``: one program per token (see ``step_inputs``
for what it computes). Its own module so that the engine imports Triton only where CUDA runs it."""

import triton
import triton.language as tl


# Every integer argument changes with the step or the batch: specialized (1, multiples of 16), they
# made 22 compiled variants of this one small kernel in a suite run.
@triton.jit(
    do_not_specialize=[
        "drafts_stride",
        "drafts_width",
        "block_table_stride",
        "max_blocks",
        "step",
        "block_size",
        "num_tokens",
    ]
)
def prepare_kernel(
    starts,
    last_token,
    drafts,
    drafts_stride,
    drafts_width,
    slots,
    query_start_loc,
    token_row,
    host_ids,
    is_decode,
    num_valid,
    block_table,
    block_table_stride,
    max_blocks,
    step,
    block_size,
    input_ids_out,
    positions_out,
    slot_mapping_out,
    seq_lens_out,
    num_tokens,
):
    token = tl.program_id(0)
    row = tl.load(token_row + token)
    row_start = tl.load(query_start_loc + row)
    offset = token - row_start
    num_valid_row = tl.load(num_valid + row)
    row_step = tl.minimum(step, tl.maximum(num_valid_row - 1, 0))
    index = offset + row_step
    slot = tl.load(slots + row)
    decode = tl.load(is_decode + row)
    position = tl.load(starts + row).to(tl.int64) + index
    draft_index = tl.minimum(tl.maximum(index - 1, 0), drafts_width - 1)  # past a row's drafts: unused
    draft = tl.load(drafts + slot * drafts_stride + draft_index, mask=index > 0, other=0)
    from_state = tl.where(index == 0, tl.load(last_token + slot), draft)
    input_id = tl.where(decode != 0, from_state, tl.load(host_ids + token))
    block_index = tl.minimum(position // block_size, max_blocks - 1)
    block = tl.load(block_table + row * block_table_stride + block_index).to(tl.int64)
    valid = offset + step < num_valid_row
    tl.store(input_ids_out + token, input_id)
    tl.store(positions_out + token, position)
    tl.store(slot_mapping_out + token, tl.where(valid, block * block_size + position % block_size, -1))
    if offset == 0:  # one program per row writes its seq_len
        row_end = tl.load(query_start_loc + row + 1)
        tl.store(seq_lens_out + row, (tl.load(starts + row) + row_step + row_end - row_start).to(tl.int32))
