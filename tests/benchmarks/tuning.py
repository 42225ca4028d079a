"""Shared by the tiling sweeps (tune_triton.py, tune_triton_mla.py): one case prepared once on the
GPU, its forward timed as ``conformance bench`` times it (CUDA events, L2 flushed, median)."""
from __future__ import annotations

import torch

from backends import registry
from conformance.checks.bench import _l2_flusher, time_gpu, traffic
from conformance.inputs.cases import parse_case
from conformance.inputs.harness import poisoned_output, prepare_case


class TimedCase:
    def __init__(self, backend_name: str, case_text: str, device: torch.device) -> None:
        self.case = parse_case(case_text)
        self.prepared = prepare_case(registry.load(backend_name), self.case, device, random_on_device=True)
        batch = self.prepared.batch
        key, value, slots = batch.step_rows()
        self.backend = self.prepared.backend
        self.backend.write_kv(self.prepared.kv_cache, key, value, slots)
        self.metadata = self.backend.build(batch.common_metadata(with_host_lengths=True))
        self.query = torch.cat([batch.query, torch.zeros_like(batch.query[:3])])
        self.out = poisoned_output(batch)
        self.flush = _l2_flusher(device)

    def forward(self) -> torch.Tensor:
        self.backend.forward(self.query, self.prepared.kv_cache, self.metadata, self.out)
        return self.out

    def micros(self) -> float:
        return time_gpu(self.forward, self.flush)

    def gigabytes_per_second(self, micros: float) -> float:
        return traffic(self.case)[0] / micros / 1e3


def sweep_line(name: str, setting: str, timed: TimedCase, vendor_micros: float, reference: torch.Tensor | None) -> str:
    """One sweep result: µs, GB/s, the ratio to the vendor's time, and the largest difference from
    the first setting's output (a setting that changes the answer is not a tiling to keep)."""
    try:
        micros = timed.micros()
    except Exception as error:  # noqa: BLE001 - out of resources for a setting is a result here
        return f"{name:24s} {setting}: {type(error).__name__}: {str(error)[:80]}"
    rows = timed.case.num_tokens  # the rows after them are padding, left poisoned
    drift = "" if reference is None else f" maxdiff {float((timed.out[:rows].float() - reference[:rows]).abs().max()):.2e}"
    return (f"{name:24s} {setting}: {micros:8.1f} µs {timed.gigabytes_per_second(micros):6.0f} GB/s "
            f"x{micros / vendor_micros:5.2f} of vendor{drift}")
