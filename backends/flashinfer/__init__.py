"""Adapters over flashinfer-python. Each imports flashinfer lazily (in ``__init__``), so a machine
without it lists the backend as unavailable with the install command instead of failing."""

import torch

INSTALL_HINT = "pip install 'specdec-conformance[flashinfer]'"
WORKSPACE_BYTES = 128 * 2**20
FA2_COMPUTE_CAPABILITIES = frozenset({(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)})


def new_workspace(device: torch.device) -> torch.Tensor:
    """A FlashInfer scratch buffer, zeroed: trtllm's kernels keep counters in it that must start at 0."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def runs_on(compute_capabilities: frozenset[tuple[int, int]]) -> dict:
    """The Capabilities fields that say where a FlashInfer adapter runs (its kernels differ by GPU)."""
    return dict(devices=frozenset({"cuda"}), compute_capabilities=compute_capabilities,
                required_modules=("flashinfer",), install_hint=INSTALL_HINT)
