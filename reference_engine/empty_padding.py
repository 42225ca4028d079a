"""vLLM's empty padding requests in the batched engine. Where the backend claims them
(``Capabilities.graph_padding``), the padding rows of a step padded for a CUDA graph reach
attention as requests of query length 0 and sequence length 0 whose block-table rows are -1,
``query_start_loc`` repeating the real tokens' end, as vLLM pads a full graph. Their tokens lie
past ``num_actual_tokens`` (all a backend computes), so their output rows keep whatever the buffer
held; nothing else of the engine changes (they decode from the spare slot, slot -1, and never
commit). Only attention's view differs, computed by device operations into persistent tensors, so a
replayed graph recomputes it from the step's own lengths."""

from __future__ import annotations

import torch

from reference_engine.step_inputs import RowLayout, StepTensors


class EmptyPadding:
    """Attention's view of a padded step's rows: ``rows`` rows, the real ones first, told apart
    by ``num_valid`` (a view of the step's upload, at a fixed offset for the shape: padding rows 0)."""

    def __init__(self, num_valid: torch.Tensor, width: int) -> None:
        rows, device = num_valid.shape[0], num_valid.device
        self.num_valid = num_valid
        self.query_start_loc = torch.empty(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.empty(rows, dtype=torch.int32, device=device)
        self.block_table = torch.empty(rows, width, dtype=torch.int32, device=device)
        # -1 as a tensor: ``where`` with ``out=`` takes no number.
        self.no_block = torch.full((), -1, dtype=torch.int32, device=device)

    def device_view(self, layout: RowLayout, step: StepTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens, block_table) with the padding rows empty. Each is written by
        one device operation into its buffer (``out=``), in the int32 of its source: the verify step
        runs this eagerly before every replay, so every operation here is a launch on the host."""
        real = self.num_valid > 0
        real_end = (layout.query_start_loc[1:] * real).amax()  # the real rows come first
        torch.minimum(layout.query_start_loc, real_end, out=self.query_start_loc)
        torch.mul(step.seq_lens, real, out=self.seq_lens)  # 0 past the real rows
        torch.where(real[:, None], layout.block_table, self.no_block, out=self.block_table)
        return self.query_start_loc, self.seq_lens, self.block_table

    @staticmethod
    def host_view(query_starts: list[int], seq_lens: list[int], num_real: int) -> tuple[list[int], list[int]]:
        """The same on the host: the rows past ``num_real`` empty."""
        padding = len(seq_lens) - num_real
        return query_starts[: num_real + 1] + [query_starts[num_real]] * padding, seq_lens[:num_real] + [0] * padding
