"""Adapters over flashinfer-python. Each imports flashinfer lazily (in ``__init__``), so a machine
without it lists the backend as unavailable with the install command instead of failing."""

import importlib

import torch

from backends.base import AttentionBackend, AttentionSpec, BackendLimits, CommonAttentionMetadata

INSTALL_HINT = "pip install 'specdec-conformance[flashinfer]'"
WORKSPACE_BYTES = 128 * 2**20
FA2_COMPUTE_CAPABILITIES = frozenset({(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)})


def new_workspace(device: torch.device) -> torch.Tensor:
    """A FlashInfer scratch buffer, zeroed: trtllm's kernels keep counters in it that must start at 0."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def runs_on(compute_capabilities: frozenset[tuple[int, int]]) -> dict:
    """The Capabilities fields that say where a FlashInfer adapter runs (its kernels differ by GPU)."""
    return dict(
        devices=frozenset({"cuda"}),
        compute_capabilities=compute_capabilities,
        required_modules=("flashinfer",),
        install_hint=INSTALL_HINT,
    )


def packed_rows(block_table: torch.Tensor) -> torch.Tensor:
    """The block table with rows packed: the trtllm entry points read row r at r × width, not at
    its row stride (a column slice of a wider table, as engines pass, returned other blocks'
    data: H200, XQA; trtllm_mla's trtllm-gen kernels are given the same, unmeasured). Called in
    ``forward``, never ``build``: under a CUDA graph the copy is captured and re-reads the
    engine's persistent table on every replay (a copy made in ``build`` would be frozen into the
    graph). No copy when the rows are packed already."""
    return block_table.contiguous()


class DeviceLengthsEntryPoint(AttentionBackend):
    """A FlashInfer function that reads every length on the device (``trtllm``, ``trtllm_mla``): the
    function, imported when the backend is made, its zeroed workspace, and a draft-step update that
    only re-points the metadata at the step's device tensors (nothing is planned on the host)."""

    entry_point: tuple[str, str]  # (module, function)

    def __init__(self, spec: AttentionSpec, limits: BackendLimits, device: torch.device) -> None:
        super().__init__(spec, limits, device)
        module, function = self.entry_point
        self.kernel = getattr(importlib.import_module(module), function)
        self.workspace = new_workspace(self.device)

    def update_for_draft_step(self, metadata, common: CommonAttentionMetadata):
        metadata.block_table, metadata.seq_lens = common.block_table, common.seq_lens
        return metadata
