"""Every case id the grammar prints parses back to the same case, whatever its numbers (tiny and
huge scales, awkward floats, the largest seed), and every value the grammar accepts runs: what it
cannot run is refused when parsed."""

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from backends.base import DTYPE_NAMES
from backends.torch_naive import TorchNaiveBackend
from conformance.cases.grammar import FLOAT_RANGES, MAX_SEED, CaseSyntaxError, _format_number, float_range, parse_case
from conformance.cases.suites import SUITES, chosen_cases
from conformance.checks.numerics import NumericsCheck
from conformance.run.execution import judge

ATTRIBUTE = {"scale": "scale", "soft cap": "cap", "key scale": "kscale", "value scale": "vscale"}


def in_range(name: str):
    low, high = FLOAT_RANGES[name]
    edges = st.sampled_from([low, high, math.nextafter(low, math.inf), math.nextafter(high, -math.inf)])
    return st.one_of(edges, st.floats(min_value=low, max_value=high, allow_nan=False, allow_infinity=False))


@st.composite
def case_texts(draw) -> str:
    kind = draw(st.sampled_from(["gqa", "mha", "mla"]))
    parts = [kind]
    if kind == "mla":
        parts.append(f"h{draw(st.integers(1, 128))}")
        parts.append(f"d{draw(st.integers(3, 512))}+{draw(st.integers(1, 64))}")
    else:
        kv = draw(st.integers(1, 8))
        parts.append(f"h{kv * draw(st.integers(1, 8)) if kind == 'gqa' else kv}" + (f"/{kv}" if kind == "gqa" else ""))
        head = draw(st.integers(3, 256))
        parts.append(f"d{head}" + (f"/{draw(st.integers(3, 256))}" if draw(st.booleans()) else ""))
    parts.append(draw(st.sampled_from(["fp16", "bf16", "fp32"])))
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from(["fp8e4m3", "fp8e5m2"])))
        if draw(st.booleans()):
            parts.append(f"kscale{_format_number(draw(in_range('key scale')))}")
        if kind != "mla" and draw(st.booleans()):
            parts.append(f"vscale{_format_number(draw(in_range('value scale')))}")
    block = draw(st.sampled_from([1, 2, 16, 64]))
    parts.append(f"p{block}")
    for attribute, name in (("cap", "soft cap"), ("scale", "scale")):
        if draw(st.booleans()):
            parts.append(f"{attribute}{_format_number(draw(in_range(name)))}")
    if draw(st.booleans()):
        parts.append(f"w{draw(st.integers(1, 5000))}")
    share = draw(st.integers(0, 2))
    if share:
        parts.append(f"share{share}")
    for flag in ("linear", "strided", "lse", "bigpool") + (() if kind == "mla" else ("attnsinks",)):
        if draw(st.booleans()):
            parts.append(flag)
    if draw(st.booleans()):
        parts.append(f"pad{draw(st.integers(0, 1024))}")
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from(["outliers", "edges"])))
    requests = draw(
        st.lists(
            st.tuples(st.integers(share * block, 5000), st.integers(1, 300), st.integers(1, 3)), min_size=1, max_size=4
        )
    )
    batch = ",".join(f"{context}+{query}" + (f"x{count}" if count > 1 else "") for context, query, count in requests)
    return f"{'-'.join(parts)}:{batch}@{draw(st.integers(0, MAX_SEED))}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_texts())
def test_every_printed_id_parses_back_to_the_same_case(text):
    try:
        case = parse_case(text)
    except CaseSyntaxError:
        assume(False)
    again = parse_case(case.id)
    assert again == case and again.id == case.id


@pytest.mark.parametrize("name", sorted(SUITES))
@pytest.mark.parametrize("seed", [None, MAX_SEED])
def test_every_suite_case_round_trips_with_any_seed(name, seed):
    for case in chosen_cases(None, name, seed):
        assert parse_case(case.id) == case


@pytest.mark.parametrize("name", sorted(FLOAT_RANGES))
def test_a_number_outside_its_range_is_refused_when_parsed(name):
    low, high = FLOAT_RANGES[name]
    prefix = "fp8e4m3-" if name in ("key scale", "value scale") else ""
    for value in (math.nextafter(low, 0), math.nextafter(high, math.inf), 0.0):
        with pytest.raises(CaseSyntaxError, match="must be a finite number from"):
            parse_case(f"gqa-h2/1-d16-{prefix}{ATTRIBUTE[name]}{_format_number(value)}:5+1")


def test_an_exponent_is_refused_with_the_form_to_write_instead():
    with pytest.raises(CaseSyntaxError, match="write it without an exponent"):
        parse_case("gqa-h8/2-d128-bf16-scale1e-05:300+4")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("name", sorted(FLOAT_RANGES))
def test_the_ends_of_every_range_run_and_pass_a_correct_backend(name, dtype):
    # fp16 is where the harness's data runs out of range first; every kind of layer the number reaches.
    layers = ["gqa-h4/2-d16", "mla-h2-d16+8"] if name != "value scale" else ["gqa-h4/2-d16"]
    prefix = "fp8e5m2-" if name in ("key scale", "value scale") else ""
    for value in float_range(name, DTYPE_NAMES[dtype]):
        for layer in layers:
            case = parse_case(f"{layer}-{dtype}-{prefix}{ATTRIBUTE[name]}{_format_number(value)}-outliers:40+4,9+1")
            result = judge(NumericsCheck(), TorchNaiveBackend, case, torch.device("cpu"))
            assert result.verdict.value == "PASS", (case.id, result.reason)


@pytest.mark.parametrize("text", ["mla-h4-d32+8-fp32-w24:60+4,9+1", "mla-h4-d32+8-bf16-cap5-outliers:60+4,9+1"])
def test_an_mla_layers_window_and_cap_are_the_oracles_too(text):
    # The oracle once dropped them for MLA: a correct backend failed every such case.
    result = judge(NumericsCheck(), TorchNaiveBackend, parse_case(text), torch.device("cpu"))
    assert result.verdict.value == "PASS", result.reason


@pytest.mark.parametrize("path", [[], ["--workers", "1"]])
@pytest.mark.slow
def test_a_tiny_scale_case_runs_end_to_end_serially_and_over_workers(tmp_path, path):
    import json
    import subprocess
    import sys

    case = parse_case("gqa-h2/1-d16-fp32-scale0.00001:5+1")
    completed = subprocess.run(
        [sys.executable, "-m", "conformance", "run", "--case", case.id, "--check", "numerics", "--device", "cpu"]
        + ["--quiet", "--json", str(tmp_path / "r.json"), *path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    cases = json.loads((tmp_path / "r.json").read_text())["backends"][0]["checks"][0]["cases"]
    assert [(row["case"], row["verdict"]) for row in cases] == [(case.id, "PASS")]
