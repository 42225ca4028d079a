"""Shared by the tiling sweeps (tune_triton, tune_triton_mla): one shape prepared once on the
GPU for the vendor and for ours, forwards timed as ``conformance bench`` times them (CUDA events,
L2 flushed, median)."""

from __future__ import annotations

import torch

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.checks.bench import _l2_flusher, time_gpu, timed_inputs, traffic
from conformance.harness.step import prepare_case


class TimedCase:
    def __init__(self, backend_name: str, case_text: str, device: torch.device) -> None:
        self.case = parse_case(case_text)
        self.prepared = prepare_case(registry.load(backend_name), self.case, device)
        self.backend = self.prepared.backend
        inputs = timed_inputs(self.prepared)  # as ``conformance bench`` hands them, padding rows too
        self.metadata, self.query, self.out = inputs.metadata, inputs.query, inputs.out
        self.flush = _l2_flusher(device)

    def forward(self) -> torch.Tensor:
        self.backend.forward(
            self.query, self.prepared.kv_cache, self.metadata, self.out, layer=self.prepared.forward_layer
        )
        return self.out

    def micros(self) -> float:
        return time_gpu(self.forward, self.flush)

    def gigabytes_per_second(self, micros: float) -> float:
        return traffic(self.case)[0] / micros / 1e3


class Sweep:
    """One shape's sweep: the vendor's time and output first (printed), then ours, prepared once,
    timed per setting by ``line``."""

    def __init__(
        self,
        name: str,
        case_text: str,
        vendor: str,
        ours: str,
        device: torch.device,
        vendor_case_text: str | None = None,
    ) -> None:
        # vendor_case_text: the vendor is timed on another case (e.g. ours over bf16, against our fp8
        # cache); its data differ, so the outputs are then compared with ours at the shipped settings.
        vendor_case = TimedCase(vendor, vendor_case_text or case_text, device)
        self.vendor_micros = vendor_case.micros()
        print(f"{name:24s} {vendor}: {self.vendor_micros:8.1f} µs", flush=True)
        self.reference = vendor_case.forward().float().clone()
        del vendor_case
        self.name = name
        self.timed = TimedCase(ours, case_text, device)
        if vendor_case_text is not None:
            self.reference = self.timed.forward().float().clone()

    def line(self, setting: str) -> str:
        """µs, GB/s, the ratio to the vendor's time, and the largest difference from the vendor's
        output, or from ours at the shipped settings where the vendor ran another case (a setting
        that changes the answer is not a tiling to keep)."""
        timed = self.timed
        try:
            micros = timed.micros()
        except Exception as error:  # noqa: BLE001 - out of resources for a setting is a result here
            return f"{self.name:24s} {setting}: {type(error).__name__}: {str(error)[:80]}"
        rows = timed.case.num_tokens  # the rows after them are padding, left poisoned
        drift = float((timed.out[:rows].float() - self.reference[:rows]).abs().max())
        return (
            f"{self.name:24s} {setting}: {micros:8.1f} µs {timed.gigabytes_per_second(micros):6.0f} GB/s "
            f"x{micros / self.vendor_micros:5.2f} of vendor maxdiff {drift:.2e}"
        )
