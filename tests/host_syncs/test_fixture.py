"""``host_syncs`` stands alone: the fixture imports into a conftest without the conformance plugin."""

import pytest


@pytest.mark.slow
def test_fixture_imports_alone_and_skips_without_cuda(pytester):
    import torch

    pytester.makeconftest("from host_syncs import forbid_host_syncs  # noqa: F401\n")
    pytester.makepyfile("def test_body(forbid_host_syncs):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:conformance")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(skipped=1)


def test_host_syncs_imports_nothing_of_the_harness_or_the_engine():
    import subprocess
    import sys

    code = (
        "import sys, host_syncs, host_syncs.pytest_fixture; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('conformance', 'reference_engine', 'backends')))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"
