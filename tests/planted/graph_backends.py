"""A small graph-safe backend in plain PyTorch, and planted graph/draft-loop defects built on it.

``TorchGraphSafe`` reads every length from the device and sizes everything from the static
limits, so one capture serves any batch of its padded shape. Each defect adds one realistic bug.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from backends import fp8
from backends.base import PLAIN_LAYER, Capabilities, CGSupport, LayerParameters
from backends.features import EMPTY_REQUESTS, FP8_E4M3, FP8_E5M2, FP8_QUERY, LOGITS_SOFT_CAP, SLIDING_WINDOW
from backends.flashinfer.gqa import FlashInferBackend
from backends.torch_naive import NaiveMetadata, TorchNaiveBackend
from tests.planted.input_defects import power_of_two_round_trip


@dataclass
class GraphSafeMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_tokens: int
    max_blocks: int  # how many blocks per request the gather reads


class TorchGraphSafe(TorchNaiveBackend):
    name = "test_graph_safe"
    capabilities = Capabilities(
        kinds=frozenset({"mha"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        features=frozenset({FP8_E4M3, FP8_E5M2, FP8_QUERY, SLIDING_WINDOW, LOGITS_SOFT_CAP}),
        cuda_graphs=CGSupport.ALWAYS,
        needs_cpu_seq_lens=False,
        draft_step_update=True,
        devices=frozenset({"cuda"}),
    )

    zero_unowned_values = True

    def build(self, common) -> GraphSafeMetadata:
        return GraphSafeMetadata(
            common.query_start_loc,
            common.seq_lens,
            common.block_table,
            common.num_actual_tokens,
            self.limits.max_blocks_per_req(self.spec.block_size),
        )

    def update_for_draft_step(self, metadata, common):
        return metadata  # nothing position-dependent is cached: the device tensors were advanced in place

    def token_lengths(self, metadata):
        """Per token: (request, position, seq_len), all from device tensors."""
        tokens = torch.arange(metadata.num_tokens, device=self.device)
        request = torch.searchsorted(metadata.query_start_loc[1:], tokens, right=True)
        request = request.clamp(max=metadata.seq_lens.shape[0] - 1)
        seq_len = metadata.seq_lens[request].long()
        query_len = (metadata.query_start_loc[request + 1] - metadata.query_start_loc[request]).long()
        position = seq_len - query_len + (tokens - metadata.query_start_loc[request])
        return request, position, seq_len

    def device_scales(self, scales) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """The (k, v) scales the gathered cache is multiplied by: the layer's device tensors (read
        on the device, so a graph replays with them), 1 without fp8."""
        k_scale, v_scale = fp8.scale_tensors(self.spec, scales)
        return (1.0, 1.0) if k_scale is None else (k_scale, v_scale)

    def device_query(self, query: torch.Tensor, scales) -> torch.Tensor:
        """The query's numbers in float32: an fp8 query times the layer's device q scale."""
        return fp8.query_values(self.spec, query, scales).float()

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        """Learned ``sinks`` and the ``lse`` are honoured here; only ``GraphSafeWithSinksAndLse``
        claims them (the others' cases stay as they were)."""
        spec = self.spec
        sinks, lse = layer.sinks, layer.lse
        k_scale, v_scale = self.device_scales(layer.scales)
        request, position, seq_len = self.token_lengths(metadata)
        block_size = spec.block_size
        # An eager batch's block table may be narrower than the static limit: gather what is there.
        max_blocks = min(metadata.max_blocks, metadata.block_table.shape[1])
        key_positions = torch.arange(max_blocks * block_size, device=self.device)
        blocks = metadata.block_table[request][:, :max_blocks].long()  # [T, max_blocks]
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size, device=self.device)).flatten(1)
        planes = self.slot_planes(kv_cache)
        keys, values = planes[0][slots].float() * k_scale, planes[1][slots].float() * v_scale  # [T, S, Hkv, D]
        group = spec.query_group_size
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
        query = self.device_query(query[: metadata.num_tokens], layer.scales)
        scores = torch.einsum("thd,tshd->ths", query, keys) * self.softmax_scale()
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        visible = (key_positions[None, :] <= position[:, None]) & (key_positions[None, :] < seq_len[:, None])
        if spec.sliding_window is not None:
            visible &= position[:, None] - key_positions[None, :] < spec.sliding_window
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        if self.zero_unowned_values:  # a zero weight does not cancel what the slot holds: 0 × NaN = NaN
            values = values.masked_fill(~visible[:, :, None, None], 0.0)
        if sinks is not None:  # one more logit per query head, whose value is 0
            scores = torch.cat([scores, sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)], dim=-1)
            values = torch.cat([values, values.new_zeros(values.shape[0], 1, *values.shape[2:])], dim=1)
        out[: metadata.num_tokens] = torch.einsum("ths,tshd->thd", scores.softmax(-1), values).to(out.dtype)
        if lse is not None:
            lse[: metadata.num_tokens] = scores.logsumexp(-1)


class StagesLengthsInOnePinnedBuffer(TorchGraphSafe):
    """Stages each step's lengths in one pinned host buffer and copies them to the device with
    ``non_blocking=True``: the copy reads the buffer when the stream reaches it, so when the host
    builds the next step before this one has run (an async scheduler), this step gets the next
    one's lengths (FlashInfer's ``plan`` under an overlap scheduler: mini-sglang #103; vLLM
    #32799). Right whenever each step has run before the next is built."""

    name = "planted_stages_lengths_in_one_pinned_buffer"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.staging = torch.empty(limits.max_num_reqs, dtype=torch.int32, pin_memory=True)
        self.device_lengths = torch.empty(limits.max_num_reqs, dtype=torch.int32, device=device)

    def build(self, common):
        metadata = super().build(common)
        num_reqs = common.num_reqs
        self.staging[:num_reqs].copy_(common.seq_lens_cpu)
        self.device_lengths[:num_reqs].copy_(self.staging[:num_reqs], non_blocking=True)
        metadata.seq_lens = self.device_lengths[:num_reqs]
        return metadata


class BakesMaxSeqLen(TorchGraphSafe):
    """Sizes its gather from the host's max_seq_len at build time: frozen into the graph."""

    name = "planted_bakes_max_seq_len"

    def build(self, common):
        metadata = super().build(common)
        metadata.max_blocks = -(-common.max_seq_len // self.spec.block_size)
        return metadata


class MasksOnlyScoresUnderCapture(TorchGraphSafe):
    """Eager, gathers each request's own slots exactly (torch_naive's path); under capture, reads
    every block the static limit allows and hides the slots past each length by their scores
    alone (weight 0), so their values still reach the sum. Over a finite pool every output is
    right; a NaN in an unowned slot turns it NaN (the way whole-tile TMA loads go wrong)."""

    name = "planted_masks_only_scores_under_capture"
    zero_unowned_values = False

    def build(self, common):
        return TorchNaiveBackend.build(self, common)

    def build_for_capture(self, common):
        return TorchGraphSafe.build(self, common)

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if isinstance(metadata, NaiveMetadata):
            TorchNaiveBackend.forward(self, query, kv_cache, metadata, out, layer)
        else:
            super().forward(query, kv_cache, metadata, out, layer)


class HostLengthsInForward(TorchGraphSafe):
    """Reads the lengths on the host inside forward: a sync, illegal during capture."""

    name = "planted_host_lengths_in_forward"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        metadata.max_blocks = min(metadata.max_blocks, -(-int(metadata.seq_lens.max().item()) // self.spec.block_size))
        super().forward(query, kv_cache, metadata, out, layer)


class StaleDraftPositions(TorchGraphSafe):
    """Snapshots seq_lens in build() and never refreshes them in update_for_draft_step()."""

    name = "planted_stale_draft_positions"

    def build(self, common):
        metadata = super().build(common)
        metadata.seq_lens = common.seq_lens.clone()
        return metadata


class PacksBlockTableInBuild(TorchGraphSafe):
    """Hands its kernel a packed copy of the block table, made in build(): right eagerly and on a
    packed table (``.contiguous()`` is then the table itself), but under a graph the capture's
    copy is frozen in, so a replay reads the capture's block ids whenever the engine's table is a
    column slice of a wider one (the trtllm adapter's first fix for XQA's row stride did this).
    Every copy is kept (as a backend that caches its metadata would keep it), so the replays read
    valid, stale block ids rather than freed memory, and get wrong values, not a crash."""

    name = "planted_packs_block_table_in_build"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.copies = []

    def build(self, common):
        metadata = super().build(common)
        metadata.block_table = common.block_table.contiguous()
        self.copies.append(metadata.block_table)
        return metadata


class WritesPaddingIntoBlockZero(TorchGraphSafe):
    """Clamps slot -1 to 0, so padding rows overwrite the reserved block."""

    name = "planted_writes_padding_into_block_zero"

    def write_kv(self, kv_cache, key, value, slot_mapping, layer: LayerParameters = PLAIN_LAYER) -> None:
        slots = slot_mapping.clamp(min=0)
        for plane, rows in zip(self.slot_planes(kv_cache), (key, value)):
            plane.index_copy_(0, slots, rows.to(plane.dtype))


class ScalesQueryOverTheStepsTokens(TorchGraphSafe):
    """Brings the query into range by one power of two taken over every request's tokens (a
    dynamic per-step query scale), and takes it back out: exact for finite rows. Eager, the step's
    tokens are the real ones; in a padded graph batch they include the padding requests' rows,
    which hold what earlier steps left in the buffer (zeros, in the harness before it filled them
    with NaN and huge values)."""

    name = "planted_scales_query_over_the_steps_tokens"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        scaled = query.clone()
        scaled[: metadata.num_tokens] = power_of_two_round_trip(query[: metadata.num_tokens])
        super().forward(scaled, kv_cache, metadata, out, layer)


class FlashInferOneGraphWrapper(FlashInferBackend):
    """The flashinfer adapter as it was: a ``use_cuda_graph`` decode wrapper only at
    ``max_num_reqs``, so a graph captured at a smaller batch holds the eager wrapper, whose replays
    read plan buffers the next plan has replaced: wrong values, or (when what took that memory
    holds large numbers) an illegal address, which kills its process. (The adapter imports
    flashinfer when made, not here.)"""

    name = "planted_flashinfer_one_graph_wrapper"

    def build_for_capture(self, common):
        return self.build(common)  # no wrapper for this batch size: the eager one is captured


class ForgetsLastRowInDraftUpdate(TorchGraphSafe):
    """Keeps its own seq_lens buffer (filled in ``build``) and advances it in
    ``update_for_draft_step`` with one row too few, as a kernel launched on ``num_reqs - 1``
    programs does. Invisible while a padding row is last; wrong for a real last row."""

    name = "planted_forgets_last_row_in_draft_update"

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.own_seq_lens = torch.zeros(limits.max_num_reqs, dtype=torch.int32, device=device)

    def build(self, common):
        metadata = super().build(common)
        self.own_seq_lens[: common.num_reqs].copy_(common.seq_lens)
        metadata.seq_lens = self.own_seq_lens[: common.num_reqs]
        return metadata

    def update_for_draft_step(self, metadata, common):
        metadata.seq_lens[: common.num_reqs - 1] += 1
        return metadata


class GrowsWorkspaceAtNewShape(TorchGraphSafe):
    """Copies the step's seq_lens into a workspace sized by the largest batch seen so far, and
    reallocates it when a larger batch comes: a graph captured earlier keeps reading the old one."""

    name = "planted_grows_workspace_at_new_shape"

    def build(self, common):
        metadata = super().build(common)
        workspace = getattr(self, "workspace", None)
        if workspace is None or workspace.numel() < common.num_reqs:
            self.workspace = torch.zeros(common.num_reqs, dtype=torch.int32, device=self.device)
        self.workspace[: common.num_reqs].copy_(common.seq_lens)
        metadata.seq_lens = self.workspace[: common.num_reqs]
        return metadata


class AutotunesOnFirstCall(TorchGraphSafe):
    """Times two variants with CUDA events on its first forward at each token count and keeps
    the faster, as a lazy autotuner does: the event synchronize is illegal inside a capture."""

    name = "planted_autotunes_on_first_call"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        tuned = self.__dict__.setdefault("tuned", set())
        if metadata.num_tokens not in tuned:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            super().forward(query, kv_cache, metadata, out, layer)
            end.record()
            end.synchronize()
            tuned.add(metadata.num_tokens)
        super().forward(query, kv_cache, metadata, out, layer)


class NondeterministicReplays(TorchGraphSafe):
    """Splits the weighted sum over keys at a point that moves with a device counter (as an
    atomics-ordered split-KV reduction does): right to rounding, never the same bits twice.
    Claims determinism anyway."""

    name = "planted_nondeterministic_replays"
    capabilities = dataclasses.replace(TorchGraphSafe.capabilities, deterministic=True)

    def __init__(self, spec, limits, device):
        super().__init__(spec, limits, device)
        self.calls = torch.zeros((), dtype=torch.int64, device=device)

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        self.calls.add_(1)
        scratch = torch.empty_like(out)
        super().forward(query, kv_cache, metadata, scratch, layer)
        # Re-add the result in two halves whose boundary moves: different rounding each call.
        split = (self.calls % 7 + 1).to(torch.float32) / 8
        part = scratch[: metadata.num_tokens].float()
        out[: metadata.num_tokens] = (part * split + part * (1 - split)).to(out.dtype)


class CopiesScalesPerStep(TorchGraphSafe):
    """Makes a fresh device tensor of the layer's scales from the host floats in every forward
    (as a backend that builds its kernel's descale tensors per call does): a new allocation and a
    pageable host-to-device copy each step, which a CUDA graph cannot capture."""

    name = "planted_copies_scales_per_step"

    def device_scales(self, scales):
        if not self.spec.fp8_kv_cache:
            return 1.0, 1.0
        per_step = torch.tensor([scales.k_scale, scales.v_scale], device=self.device)
        return per_step[0], per_step[1]


class GraphSafeEmptyRequests(TorchGraphSafe):
    """TorchGraphSafe claiming vLLM's empty padding requests too: its reads start from each query
    token, so an empty request reads and writes nothing."""

    name = "test_graph_safe_empty_requests"
    capabilities = dataclasses.replace(
        TorchGraphSafe.capabilities, features=TorchGraphSafe.capabilities.features | {EMPTY_REQUESTS}
    )


class WritesLastTokenOfEmptyRequests(GraphSafeEmptyRequests):
    """On the device, as a kernel with one program per request: an empty request's program writes
    zeros to row ``query_start_loc[r + 1] - 1``, the previous request's last token (vLLM #37442)."""

    name = "planted_writes_last_token_of_empty_requests"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        super().forward(query, kv_cache, metadata, out, layer)
        starts = metadata.query_start_loc
        empty = ((starts[1:] == starts[:-1]) & (starts[1:] > 0)).int()
        hit = torch.zeros(out.shape[0], dtype=torch.int32, device=out.device)
        hit.scatter_add_(0, (starts[1:] - 1).clamp(min=0).long(), empty)  # no host read: capturable
        out.masked_fill_(hit[:, None, None] > 0, 0.0)


class GraphSafeWithEmptyRequests(TorchGraphSafe):
    """TorchGraphSafe claiming vLLM's empty requests, so the graphs check also captures it over
    empty requests only. Empty requests pad a graph's batch without rows of their own, so the
    step's real token count is a device value: every row of the output buffer is computed and only
    the real ones (below ``query_start_loc[-1]``) are kept."""

    name = "test_graph_safe_with_empty_requests"
    capabilities = dataclasses.replace(
        TorchGraphSafe.capabilities, features=TorchGraphSafe.capabilities.features | {EMPTY_REQUESTS}
    )

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        rows = query.shape[0]
        real = torch.arange(rows, device=self.device) < metadata.query_start_loc[-1]
        kept = out.clone()
        super().forward(query, kv_cache, dataclasses.replace(metadata, num_tokens=rows), out, layer=layer)
        out.copy_(torch.where(real[:, None, None], out, kept))


class SkipsAnIdleBatchAtCapture(GraphSafeWithEmptyRequests):
    """Looks, when a graph is built, whether the batch has anything to attend, and captures no
    attention at all when every length is 0 (a dummy capture's batch): every replay of that graph
    then leaves its output as it was. The class of vLLM #51970, an illegal access in a graph
    captured over all-zero indexer lengths: the lengths of the capture decide what the graph does."""

    name = "planted_skips_an_idle_batch_at_capture"

    def build_for_capture(self, common):
        metadata = self.build(common)
        metadata.idle = int(common.seq_lens.max()) == 0  # read before the capture begins
        return metadata

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if getattr(metadata, "idle", False):
            return  # nothing to attend
        super().forward(query, kv_cache, metadata, out, layer=layer)
