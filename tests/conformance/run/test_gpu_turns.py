"""Big-pool cases take the GPU in turns: the lock is exclusive across holders, and a case without
a big pool (or off the GPU) never waits for it."""

import threading
import time

import torch

from conformance.cases.grammar import parse_case
from conformance.run.gpu_turns import big_pool_turn, exclusive


def test_a_second_holder_waits_for_the_first():
    events, first_holds = [], threading.Event()

    def hold(name, seconds):
        with exclusive("test-turns"):
            events.append(f"{name} in")
            first_holds.set()
            time.sleep(seconds)
            events.append(f"{name} out")

    first = threading.Thread(target=hold, args=("first", 0.3))
    first.start()
    first_holds.wait()
    second = threading.Thread(target=hold, args=("second", 0))
    second.start()
    first.join(), second.join()
    assert events == ["first in", "first out", "second in", "second out"]


def test_only_a_big_pool_on_a_gpu_takes_a_turn_and_frees_its_memory_before_giving_it_back(monkeypatch):
    from types import SimpleNamespace

    from conformance.run import gpu_turns

    calls = []
    monkeypatch.setattr(gpu_turns, "exclusive", lambda name: (calls.append(name), exclusive(name))[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-1234"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    for case, device in (("gqa-bigpool:1+1", "cpu"), ("gqa:1+1", "cuda")):
        with big_pool_turn(parse_case(case), torch.device(device)):
            pass
    assert calls == []
    with big_pool_turn(parse_case("gqa-bigpool:1+1"), torch.device("cuda")):
        calls.append("case")
    assert calls == ["bigpool-GPU-1234", "case", "synchronize", "empty_cache"]
