"""Planted fp8 KV-cache defects, each torch_naive with one bug that reached a real backend: a
scale dropped on one path, swapped, applied twice, kept from the first layer; quantisation by
truncation, without saturation; a device scale read on the host. And flashinfer_mla claiming the
e4m3 cache it does not claim (FlashInfer rounds the scale to bf16: docs/findings.md)."""

from __future__ import annotations

import dataclasses

import torch

from backends.base import PLAIN_LAYER, Fp8Scales, LayerParameters
from backends.features import FP8_E4M3
from backends.flashinfer.mla import FlashInferMLABackend
from backends.fp8 import from_cache, to_cache
from backends.torch_naive import NaiveMetadata, TorchNaiveBackend


class DropsScaleOnDecode(TorchNaiveBackend):
    """Decode rows attend over the raw stored numbers (a fast decode path that forgot k_scale and
    v_scale, vLLM #42580); prefill rows are right."""

    def forward(self, query, kv_cache, metadata: NaiveMetadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        super().forward(query, kv_cache, metadata, out, layer)
        scales = layer.scales
        raw = Fp8Scales(1.0, 1.0, scales.k_scale_tensor, scales.v_scale_tensor)
        for request in range(len(metadata.seq_lens)):
            start, end = metadata.query_start_loc[request], metadata.query_start_loc[request + 1]
            if end - start == 1:
                single = NaiveMetadata(
                    [0, 1], [metadata.seq_lens[request]], metadata.block_table[request : request + 1]
                )
                lse = None if layer.lse is None else layer.lse[start:end]
                super().forward(
                    query[start:end], kv_cache, single, out[start:end], LayerParameters(raw, layer.sinks, lse)
                )


class SwapsFp8Scales(TorchNaiveBackend):
    """k_scale and v_scale passed to the kernel in each other's places (vLLM #34863)."""

    def scale_floats(self, scales):
        key, value = super().scale_floats(scales)
        return [value, key] if self.spec.kind != "mla" else [key, value]


class ScalesTwiceOnRead(TorchNaiveBackend):
    """Dequantizes with the scale applied twice (stored × scale²)."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        scales = layer.scales
        squared = Fp8Scales(scales.k_scale**2, scales.v_scale**2, scales.k_scale_tensor, scales.v_scale_tensor)
        super().forward(query, kv_cache, metadata, out, dataclasses.replace(layer, scales=squared))


class TruncatesOnWrite(TorchNaiveBackend):
    """Quantizes by truncation toward zero (a bit shift of the fp32 mantissa) instead of rounding
    to nearest even; forward attends over what it stored, so only the stored-cache check sees it."""

    def quantize(self, rows, scale, cache_dtype):
        nearest = to_cache(rows, scale, cache_dtype)
        # Where rounding went away from zero, step back one fp8 number toward zero.
        away = from_cache(nearest, 1.0).abs() > (rows.float() / scale).abs()
        bits = nearest.view(torch.uint8)
        return torch.where(away & (bits & 0x7F > 0), bits - 1, bits).view(cache_dtype)


class NoSaturation(TorchNaiveBackend):
    """Converts without saturating: a number past the format's range becomes NaN (e4m3 has no
    infinity), as a conversion without ``satfinite`` gives on a GPU."""

    def quantize(self, rows, scale, cache_dtype):
        scaled = rows.float() / scale
        return torch.where(scaled.abs() > torch.finfo(cache_dtype).max, float("nan"), scaled).to(cache_dtype)


class KeepsFirstLayerScales(TorchNaiveBackend):
    """Keeps the scales of the first forward after a build in the step's metadata, for every layer
    of the step (metadata is shared by the layers; scales are not)."""

    def build(self, common):
        metadata = super().build(common)
        metadata.scales = None
        return metadata

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if getattr(metadata, "scales", None) is None:
            metadata.scales = layer.scales
        super().forward(query, kv_cache, metadata, out, dataclasses.replace(layer, scales=metadata.scales))


class ReadsDeviceScaleOnHost(TorchNaiveBackend):
    """Reads the device scale with ``.item()`` in forward: a host sync per layer (GPU: the syncs
    check sees it)."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        scales = layer.scales
        host = Fp8Scales(
            scales.k_scale_tensor.item(), scales.v_scale_tensor.item(), scales.k_scale_tensor, scales.v_scale_tensor
        )
        super().forward(query, kv_cache, metadata, out, dataclasses.replace(layer, scales=host))


class FlashInferMLAClaimingE4M3(FlashInferMLABackend):
    """The real flashinfer_mla adapter, claiming the e4m3 latent cache it can run (FlashInfer's FA3
    MLA kernel on SM90, the layer's scale as ``ckv_scale`` and ``kpe_scale``). FlashInfer 0.7.2
    rounds that scale to bf16 in the kernel: measured on an H100, outputs up to 1.65x past the
    tolerance where a few large scores share the softmax; a scale exact in bf16 passes."""

    name = "planted_flashinfer_mla_claiming_e4m3"
    capabilities = dataclasses.replace(
        FlashInferMLABackend.capabilities,
        features=FlashInferMLABackend.capabilities.features | {FP8_E4M3},
        not_claimed={},
    )


class RoundsQueryToFp16(TorchNaiveBackend):
    """Over an fp8 cache, multiplies in fp16 (fp8 widens to fp16 in one instruction a pair, to bf16
    in five) and rounds a bf16 query to fp16 as it is: a query element past fp16's range becomes
    inf, one far under it loses its bits. Right for every query within fp16's range."""

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        if self.spec.fp8_kv_cache and query.dtype == torch.bfloat16:
            query = query.to(torch.float16).to(query.dtype)
        super().forward(query, kv_cache, metadata, out, layer)
