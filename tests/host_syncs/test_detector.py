"""The sync detector's logic on recorded callback sequences (CPU)."""

import os

import pytest

import conformance  # noqa: F401 - declares the harness and the contract's helpers as infrastructure
from host_syncs.events import (
    ApiCall,
    CopyInfo,
    EventRecorder,
    Frame,
    base_api_name,
    classify,
)
from host_syncs.frames import attribute, is_infrastructure


def runtime(name, enter=True, copy=None, thread=1):
    return ApiCall("runtime", name, enter, thread, copy)


def driver(name, enter=True, copy=None, thread=1):
    return ApiCall("driver", name, enter, thread, copy)


def record(calls):
    recorder = EventRecorder()
    for call in calls:
        recorder.on_call(call)
    return recorder.events


def test_base_names():
    assert base_api_name("cudaMemcpyAsync_v3020") == "cudaMemcpyAsync"
    assert base_api_name("cuMemcpyDtoHAsync_v2") == "cuMemcpyDtoHAsync"
    assert base_api_name("cudaStreamSynchronize_ptsz_v7000") == "cudaStreamSynchronize"
    assert base_api_name("cuMemcpyDtoH_v2_ptds") == "cuMemcpyDtoH"


def test_classification():
    assert classify(runtime("cudaStreamSynchronize_v3020")) == ("sync", True)
    assert classify(driver("cuCtxSynchronize")) == ("sync", True)
    assert classify(runtime("cudaMemcpy_v3020", copy=CopyInfo("h2d", 8, True))) == ("sync-copy", True)
    assert classify(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2h", 8, False))) == ("d2h-copy", True)
    assert classify(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2h", 8, True))) is None  # into pinned memory
    assert classify(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("h2d", 8, True))) is None  # from pinned memory
    assert classify(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("h2d", 8, False))) == ("pageable-h2d-copy", False)
    assert classify(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2d", 8))) is None
    assert classify(runtime("cudaMalloc_v3020")) == ("device-alloc", False)
    assert classify(runtime("cudaLaunchKernel_v7000")) is None


def test_item_is_one_copy_and_one_sync_each_counted_once():
    """What torch's .item() does, as recorded on an H200: runtime calls with nested driver calls."""
    events = record(
        [
            runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2h", 4, False)),
            driver("cuMemcpyDtoHAsync_v2", copy=CopyInfo("d2h", 4, False)),
            driver("cuMemcpyDtoHAsync_v2", enter=False),
            runtime("cudaMemcpyAsync_v3020", enter=False),
            runtime("cudaStreamSynchronize_v3020"),
            driver("cuStreamSynchronize"),
            driver("cuStreamSynchronize", enter=False),
            runtime("cudaStreamSynchronize_v3020", enter=False),
        ]
    )
    assert [(e.kind, e.api, e.nested) for e in events] == [
        ("d2h-copy", "cudaMemcpyAsync", ["cuMemcpyDtoHAsync_v2"]),
        ("sync", "cudaStreamSynchronize", ["cuStreamSynchronize"]),
    ]
    assert events[0].num_bytes == 4 and events[0].direction == "d2h"


def test_driver_call_outside_any_runtime_call_is_its_own_event():
    events = record(
        [driver("cuMemcpyDtoH_v2", copy=CopyInfo("d2h", 64, False)), driver("cuMemcpyDtoH_v2", enter=False)]
    )
    assert [(e.kind, e.api) for e in events] == [("sync-copy", "cuMemcpyDtoH")]


def test_nesting_is_per_thread():
    events = record(
        [
            runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2d", 8), thread=1),  # open on thread 1, no event
            driver("cuStreamSynchronize", thread=2),  # another thread: standalone
            driver("cuStreamSynchronize", thread=1),  # nested in thread 1's runtime call
            runtime("cudaMemcpyAsync_v3020", enter=False, thread=1),
            driver("cuStreamSynchronize", thread=1),  # thread 1 again, nothing open
        ]
    )
    assert [e.api for e in events] == ["cuStreamSynchronize", "cuStreamSynchronize"]


def test_phases_and_pausing():
    recorder = EventRecorder()
    recorder.phase = "build"
    recorder.on_call(driver("cuCtxSynchronize"))
    recorder.recording = False
    recorder.on_call(driver("cuCtxSynchronize"))
    assert [e.phase for e in recorder.events] == ["build"]


def test_stack_is_captured_only_for_events():
    captured = []

    def capture():
        captured.append(1)
        return [Frame("mine.py", 3, "f")], Frame("mine.py", 3, "f")

    recorder = EventRecorder(capture)
    recorder.on_call(runtime("cudaMemcpyAsync_v3020", copy=CopyInfo("d2d", 8)))
    recorder.on_call(runtime("cudaMemcpyAsync_v3020", enter=False))
    recorder.on_call(runtime("cudaDeviceSynchronize_v3020"))
    assert len(captured) == 1 and recorder.events[0].source.filename == "mine.py"


def test_attribution_skips_harness_contract_torch_and_stdlib():
    import contextlib

    import torch

    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    frames = [
        Frame(os.path.join(root, "conformance", "harness.py"), 10, "run_step"),
        Frame(os.path.join(root, "backends", "torch_naive.py"), 77, "build"),
        Frame(os.path.join(root, "backends", "base.py"), 150, "seq_lens_cpu"),
        Frame(os.path.join(os.path.dirname(torch.__file__), "cuda", "__init__.py"), 5, "synchronize"),
        Frame(contextlib.__file__, 1, "inner"),
    ]
    assert attribute(frames) == frames[1]
    assert is_infrastructure(frames[2].filename) and not is_infrastructure(here)
    assert attribute(frames[:1]) is None


def test_the_cupti_strategy_leaves_no_subscriber_after_its_pass(monkeypatch):
    """CUPTI allows one subscriber a process, and a callback left enabled costs every later call it
    watches (timed runs included): stop() must unsubscribe, and a failed start must not leak one."""
    import enum
    import types

    from host_syncs import cupti_strategy

    class Domain(enum.IntEnum):
        RUNTIME_API = 1
        DRIVER_API = 2

    Runtime = enum.IntEnum("Runtime", {"cudaStreamSynchronize_v3020": 1, "cudaLaunchKernel_v7000": 2})
    Driver = enum.IntEnum("Driver", {"cuCtxSynchronize": 1})

    class FakeCupti(types.SimpleNamespace):
        def __init__(self, accepts: bool):
            super().__init__(CallbackDomain=Domain, RuntimeApiTraceCbid=Runtime, DriverApiTraceCbid=Driver)
            self.accepts, self.subscribers, self.enabled = accepts, set(), set()

        def subscribe(self, callback, userdata):
            if self.subscribers:
                raise RuntimeError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")
            self.subscribers.add("handle")
            return "handle"

        def enable_callback(self, enable, subscriber, domain, cbid):
            if not self.accepts:
                raise RuntimeError("CUPTI_ERROR_INVALID_PARAMETER")
            self.enabled.add((domain, int(cbid)))

        def unsubscribe(self, subscriber):
            self.subscribers.discard(subscriber)
            self.enabled.clear()  # cuptiUnsubscribe disables every callback of the subscriber

    monkeypatch.setattr(cupti_strategy, "PointerTypes", lambda: None)
    for accepts in (True, False):
        fake = FakeCupti(accepts)
        monkeypatch.setattr(cupti_strategy, "_import_cupti", lambda: fake)
        strategy = cupti_strategy.CuptiStrategy(EventRecorder())
        if accepts:
            strategy.start()
            assert (
                fake.subscribers
                and (Domain.RUNTIME_API, 1) in fake.enabled
                and (Domain.RUNTIME_API, 2) not in fake.enabled
            )
            strategy.stop()
        else:
            with pytest.raises(cupti_strategy.CuptiUnavailable):
                strategy.start()
        assert not fake.subscribers and not fake.enabled
    fake.accepts = True
    cupti_strategy.CuptiStrategy(EventRecorder()).start()  # the next pass can subscribe again
