"""JUnit XML: one testcase per backend x check x case (CI systems render these natively).

FAIL → <failure>, ERROR and CRASH → <error>, SKIP → <skipped>; an unavailable backend or a
skipped check is one skipped testcase carrying the reason.
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from conformance.checks import check_class
from conformance.harness.evidence import plain_lines
from conformance.report.reproduce import reproduce_command
from conformance.report.safe_text import xml_safe
from conformance.results import CaseResult, RunResult, Verdict


def _evidence_text(check_name: str, case: CaseResult) -> str:
    return "\n".join([case.reason] + plain_lines(check_class(check_name).describe_evidence(case.evidence)))


def _testcase(
    suite: ElementTree.Element,
    classname: str,
    name: str,
    verdict: Verdict,
    message: str,
    text: str = "",
    seconds: float | None = None,
) -> None:
    """Every string through ``xml_safe``: a backend's reason or stderr may hold any character,
    and one that XML forbids would make the whole file unreadable to the CI system."""
    testcase = ElementTree.SubElement(
        suite, "testcase", classname=xml_safe(classname), name=xml_safe(name), time=f"{seconds or 0:.3f}"
    )
    message = xml_safe(message)[:1000]
    if verdict == Verdict.FAIL:
        ElementTree.SubElement(testcase, "failure", message=message, type="FAIL").text = xml_safe(text)
    elif verdict in (Verdict.ERROR, Verdict.CRASH):
        ElementTree.SubElement(testcase, "error", message=message, type=verdict.value).text = xml_safe(text)
    elif verdict == Verdict.SKIP:
        ElementTree.SubElement(testcase, "skipped", message=message)


def render(run: RunResult) -> str:
    root = ElementTree.Element("testsuites", name="conformance")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for backend in run.backends:
        for check in backend.checks:
            suite = ElementTree.SubElement(root, "testsuite", name=xml_safe(f"{backend.name}/{check.name}"))
            classname = f"conformance.{backend.name}.{check.name}"
            if not check.cases:
                _testcase(
                    suite,
                    classname,
                    check.name,
                    check.verdict if check.verdict != Verdict.PASS else Verdict.SKIP,
                    check.summary,
                )
            for case in check.cases:
                text = _evidence_text(check.name, case)
                if case.verdict.is_failure:
                    text = f"reproduce: {reproduce_command(run, backend.name, check.name, case.case)}\n{text}"
                _testcase(suite, classname, case.case, case.verdict, case.reason, text, case.seconds)
            counts = {
                "tests": len(suite),
                "failures": len(suite.findall("testcase/failure")),
                "errors": len(suite.findall("testcase/error")),
                "skipped": len(suite.findall("testcase/skipped")),
            }
            for key, value in counts.items():
                suite.set(key, str(value))
                totals[key] += value
    for key, value in totals.items():
        root.set(key, str(value))
    ElementTree.indent(root)
    return ElementTree.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
