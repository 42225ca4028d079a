"""Measures what the detector costs: ``python -m host_syncs.overhead [--strategy S]``.

(1) per intercepted call: many cudaStreamSynchronize on an idle stream, with and without it;
(2) a launch-heavy loop (small kernels, none intercepted), with and without it; (3) both again
before the process's first detector pass and after its passes ended: whatever a pass leaves
behind (a subscription that outlives it) shows there. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from host_syncs.detector import detect_host_syncs


def _median_seconds(function, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_overhead(strategy: str, calls: int = 2000, launches: int = 5000) -> dict:
    stream = torch.cuda.current_stream()
    x = torch.ones(256, device="cuda")

    def syncs() -> None:
        for _ in range(calls):
            stream.synchronize()

    def kernels() -> None:
        for _ in range(launches):
            x.add_(1.0)

    syncs(), kernels()  # warm-up
    before_sync, before_launch = _median_seconds(syncs, 5), _median_seconds(kernels, 5)  # no detector yet
    samples: dict[str, list[float]] = {
        key: [] for key in ("plain_sync", "plain_launch", "watched_sync", "paused_sync", "watched_launch")
    }
    for _ in range(5):  # interleaved rounds, so clock drift hits both sides alike
        samples["plain_sync"].append(_median_seconds(syncs, 3))
        samples["plain_launch"].append(_median_seconds(kernels, 3))
        with detect_host_syncs(strategy) as detector:
            samples["watched_sync"].append(_median_seconds(syncs, 3))
            with detector.paused():  # the callbacks alone, without recording events and their stacks
                samples["paused_sync"].append(_median_seconds(syncs, 3))
            samples["watched_launch"].append(_median_seconds(kernels, 3))
    after_sync, after_launch = _median_seconds(syncs, 5), _median_seconds(kernels, 5)  # every pass has ended
    plain_sync, plain_launch, watched_sync, paused_sync, watched_launch = (
        statistics.median(samples[key])
        for key in ("plain_sync", "plain_launch", "watched_sync", "paused_sync", "watched_launch")
    )
    return {
        "strategy": detector.strategy_name,
        "gpu": torch.cuda.get_device_name(),
        "intercepted_call_us_plain": plain_sync / calls * 1e6,
        "intercepted_call_us_recorded": watched_sync / calls * 1e6,
        "intercepted_call_us_callback_only": paused_sync / calls * 1e6,
        "overhead_per_recorded_call_us": (watched_sync - plain_sync) / calls * 1e6,
        "overhead_per_callback_us": (paused_sync - plain_sync) / calls * 1e6,
        "launch_loop_us_per_launch_plain": plain_launch / launches * 1e6,
        "launch_loop_us_per_launch_watched": watched_launch / launches * 1e6,
        "launch_loop_overhead_percent": (watched_launch / plain_launch - 1) * 100,
        "events_recorded": len(detector.events),
        "intercepted_call_us_before_any_pass": before_sync / calls * 1e6,
        "intercepted_call_us_after_the_passes": after_sync / calls * 1e6,
        "launch_loop_us_per_launch_before_any_pass": before_launch / launches * 1e6,
        "launch_loop_us_per_launch_after_the_passes": after_launch / launches * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="cupti", choices=["cupti", "torch"])
    print(json.dumps(measure_overhead(parser.parse_args().strategy), indent=1))


if __name__ == "__main__":
    main()
