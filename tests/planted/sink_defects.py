"""Planted learned-sink defects, each torch_naive with one bug of a kind that reached users: sinks
dropped by the prefill kernel (FlashInfer's SM12x prefill, gpt-oss at 0.000 on GSM8K: vLLM
#52148), the sink given a value (added to the numerator), sinks indexed by KV head."""

from __future__ import annotations

import dataclasses

import torch

from backends.base import PLAIN_LAYER, LayerParameters
from backends.features import ATTENTION_SINKS
from backends.flashinfer.gqa import FlashInferBackend
from backends.torch_naive import TorchNaiveBackend


class IgnoresSinksInPrefill(TorchNaiveBackend):
    """Requests of more than one new token (the prefill kernel, which spec-verify rows use too)
    attend without the sinks; decode rows are right."""

    def request_sinks(self, sinks, query_len):
        return None if query_len > 1 else sinks


class AddsSinkToNumerator(TorchNaiveBackend):
    """Counts the sink in the numerator too, as if it were a key whose value is 1 in every channel."""

    def attend(self, query, key, value, context_len, sinks=None, indexed=None):
        out = super().attend(query, key, value, context_len, sinks, indexed)
        if sinks is None:
            return out
        scores = self.masked_scores(query, key, context_len, indexed)  # [H, q, s]
        top = torch.maximum(scores.amax(-1), sinks.float()[:, None])  # [H, q]
        sink_weight = torch.exp(sinks.float()[:, None] - top) / (
            torch.exp(scores - top[..., None]).sum(-1) + torch.exp(sinks.float()[:, None] - top)
        )
        return out + sink_weight.transpose(0, 1)[..., None]


class ReadsSinksPerKVHead(TorchNaiveBackend):
    """Indexes the sinks by KV head (``sinks[h // group]``) instead of by query head."""

    def request_sinks(self, sinks, query_len):
        if sinks is None:
            return None
        group = self.spec.query_group_size
        return sinks[torch.arange(self.spec.num_heads, device=sinks.device) // group]


class FlashInferClaimingSinks(FlashInferBackend):
    """The real flashinfer adapter, claiming learned sinks and handing them to FlashInfer's
    wrappers (``run(..., sinks=)``), which accept them: what an adapter author would write. On an
    H200 (FlashInfer 0.7.2.post1, FA2) the output misses the sinks."""

    name = "planted_flashinfer_claiming_sinks"
    capabilities = dataclasses.replace(
        FlashInferBackend.capabilities,
        features=FlashInferBackend.capabilities.features | {ATTENTION_SINKS},
        not_claimed={},
    )

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        for call in metadata.calls:
            call.wrapper.run(
                query[call.token_start : call.token_end].contiguous(),
                kv_cache,
                out=out[call.token_start : call.token_end],
                sinks=layer.sinks,
            )
