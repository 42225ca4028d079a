"""Fakes of the vendor libraries, for the adapters' CPU tests."""

import sys
import types

import pytest
import torch

import backends.flashinfer as flashinfer_adapters


class FakeWrapper:
    """A FlashInfer wrapper that records what it is planned and run with."""

    def __init__(self, *args, **kwargs):
        self._pin_memory_int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)  # what plan_staging swaps
        self.planned, self.ran = [], []

    def plan(self, *args, **kwargs):
        self.planned.append(kwargs)

    def run(self, *args, **kwargs):
        self.ran.append(kwargs)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FakeWrapper, BatchPrefillWithPagedKVCacheWrapper=FakeWrapper
    )
    mla = types.SimpleNamespace(
        BatchMLAPagedAttentionWrapper=FakeWrapper, MLAPlanMetadata=types.SimpleNamespace(csr=lambda *t: t)
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(flashinfer_adapters, "WORKSPACE_BYTES", 64)
