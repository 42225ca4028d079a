"""Run one step of a case through a backend the way an engine would.

History (the context tokens) is written through the backend's own ``write_kv``, then the step:
``build`` → ``write_kv`` of the new tokens (plus slot -1 padding rows) → ``forward`` into a
NaN-poisoned output, so rows a backend forgets to write cannot pass.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from backends.base import AttentionBackend
from conformance.batch import NUM_PADDING_TOKENS, PagedBatch, materialize
from conformance.cases import Case


@dataclass
class PreparedCase:
    batch: PagedBatch
    backend: AttentionBackend
    kv_cache: torch.Tensor


def prepare(
    backend_cls: type[AttentionBackend], case: Case, device: torch.device, *, random_on_device: bool = False
) -> PreparedCase:
    batch = materialize(case, device, random_on_device=random_on_device)
    backend = backend_cls(case.spec, batch.limits(), torch.device(device))
    kv_cache = backend.allocate_kv_cache(batch.num_blocks)
    key, value, slots = batch.history_rows()
    if slots.numel():
        backend.write_kv(kv_cache, key, value, slots)
    return PreparedCase(batch, backend, kv_cache)


def poisoned_output(batch: PagedBatch, padding: int = NUM_PADDING_TOKENS) -> torch.Tensor:
    spec = batch.spec
    shape = (batch.case.num_tokens + padding, spec.num_heads, spec.v_head_dim)
    return torch.full(shape, float("nan"), dtype=spec.dtype, device=batch.device)


def _no_phase(name: str) -> ContextManager[None]:
    return contextlib.nullcontext()


def run_step(
    prepared: PreparedCase,
    *,
    with_host_lengths: bool = True,
    phase: Callable[[str], ContextManager[None]] = _no_phase,
) -> torch.Tensor:
    """One engine step; returns the output rows of the real tokens.

    ``phase(name)`` wraps each backend call ("build", "write_kv", "forward") and nothing else, so
    a sync detector sees only what the backend does, not the harness's own input preparation.
    """
    batch, backend = prepared.batch, prepared.backend
    common = batch.common_metadata(with_host_lengths=with_host_lengths)
    key, value, slots = batch.step_rows()
    query = torch.cat([batch.query, torch.zeros_like(batch.query[:NUM_PADDING_TOKENS])])
    out = poisoned_output(batch)
    with phase("build"):
        metadata = backend.build(common)
    with phase("write_kv"):
        backend.write_kv(prepared.kv_cache, key, value, slots)
    with phase("forward"):
        backend.forward(query, prepared.kv_cache, metadata, out)
    return out[: batch.case.num_tokens]
