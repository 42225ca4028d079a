"""Deliberately broken backends. Each check must FAIL (or CRASH) on the defect it exists to catch.

Each is torch_naive with one realistic bug, so the defect is the only difference.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import torch

from backends.base import PLAIN_LAYER, Capabilities, CGSupport, LayerParameters
from backends.torch_naive import TorchNaiveBackend


class CausalOffByOne(TorchNaiveBackend):
    """Lets each token see the next one: `<=` where `<` was meant, on the shifted index."""

    name = "planted_causal_off_by_one"

    def visible(self, query_positions, key_positions):
        return key_positions[None, :] <= query_positions[:, None] + 1


class FirstBlockOnly(TorchNaiveBackend):
    """Reads the request's first block for every logical block (ignores the rest of the table)."""

    name = "planted_first_block_only"

    def gather(self, plane, block_table_row, seq_len):
        num_blocks = -(-seq_len // self.spec.block_size)
        return super().gather(plane, block_table_row[:1].expand(num_blocks), seq_len)


class WrongScale(TorchNaiveBackend):
    """1/head_dim instead of 1/sqrt(head_dim)."""

    name = "planted_wrong_scale"

    def softmax_scale(self):
        return 1.0 / self.spec.head_dim


class WritesSlotMinusOne(TorchNaiveBackend):
    """Indexes the cache with the raw slot mapping: slot -1 lands on the pool's last slot."""

    name = "planted_writes_slot_minus_one"

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER):
        rows_per_plane = [key.view(key.shape[0], 1, -1)] if self.spec.kind == "mla" else [key, value]
        for plane, rows in zip(self.slot_planes(kv_cache), rows_per_plane):
            plane[slot_mapping] = rows.to(plane.dtype)


class ForgetsLastToken(TorchNaiveBackend):
    """Never writes the batch's last output row (caught by the NaN-poisoned output buffer)."""

    name = "planted_forgets_last_token"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        scratch = out.clone()
        super().forward(query, kv_cache, metadata, scratch, layer)
        last = metadata.query_start_loc[-1] - 1
        out[:last] = scratch[:last]


class RaisesInBuild(TorchNaiveBackend):
    name = "planted_raises_in_build"

    def build(self, common):
        raise ValueError("planted: build() refuses")


class CrashesOnLargeBatch(TorchNaiveBackend):
    """Kills its own process (SIGSEGV) on any batch of more than 3 requests."""

    name = "planted_crashes"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if len(metadata.seq_lens) > 3:
            os.kill(os.getpid(), signal.SIGSEGV)
        super().forward(query, kv_cache, metadata, out, layer)


STICKY_FAULT = "CUDA error: an illegal memory access was encountered"


def _faulted_forward(self, query, kv_cache, metadata, out, layer=None):
    raise RuntimeError(STICKY_FAULT)


class FaultsOnLongSequence(TorchNaiveBackend):
    """An out-of-bounds read on a sequence past 80 tokens, which on a GPU leaves the process's
    CUDA context unusable: every later kernel of the process fails with the same error, another
    backend's too (here: torch_naive's forward, wherever this process runs it)."""

    name = "planted_faults_on_long_sequence"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if max(metadata.seq_lens) > 80:
            TorchNaiveBackend.forward = _faulted_forward
        super().forward(query, kv_cache, metadata, out, layer)


class Hangs(TorchNaiveBackend):
    name = "planted_hangs"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        time.sleep(3600)


class HangsOnLongSequence(TorchNaiveBackend):
    """Never returns (a kernel spinning on a flag no one sets) once a sequence passes 8 tokens."""

    name = "planted_hangs_on_long_sequence"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER):
        if max(metadata.seq_lens) > 8:
            time.sleep(3600)
        super().forward(query, kv_cache, metadata, out, layer)


class NeedsBlackwell(TorchNaiveBackend):
    """Claims what trtllm-gen MLA kernels need: a CUDA device of compute capability 10.x."""

    name = "planted_needs_blackwell"
    capabilities = Capabilities(
        kinds=frozenset({"mla"}),
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        compute_capabilities=frozenset({(10, 0), (10, 3)}),
        cuda_graphs=CGSupport.NEVER,
    )


class NeedsMissingPackage(TorchNaiveBackend):
    name = "planted_needs_missing_package"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        required_modules=("no_such_vendor_package",),
        install_hint="pip install 'specdec-conformance[no_such_extra]'",
    )


class NotABackend:
    """Registry tests: a class that does not implement the contract."""


class GuessesSeqLens(TorchNaiveBackend):
    """Avoids the host sync when host lengths are absent by carrying each row's length from its
    previous build forward by this step's query length: it assumes every token it attended to was
    kept. Exact in every attention case (one build each) and in a synchronous engine (host lengths
    given); under async speculative decoding a rejected draft leaves every later length too long."""

    name = "planted_guesses_seq_lens"

    def build(self, common):
        guessed = getattr(self, "_guessed", None)
        if common.has_host_seq_lens or guessed is None or len(guessed) != common.num_reqs:
            metadata = super().build(common)
        else:
            metadata = super().build(
                dataclasses.replace(common, host_seq_lens=torch.tensor(guessed, dtype=torch.int32))
            )
        self._guessed = [length + query for length, query in zip(metadata.seq_lens, common.query_lens_cpu.tolist())]
        return metadata
