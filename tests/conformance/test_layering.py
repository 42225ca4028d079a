"""conformance/ is built in floors, and an import only goes down or sideways (the same floor): the
results model and two file helpers at the ground, then what makes cases (grammar, suites, data,
the oracle), what runs them (batches, the eager and graph harnesses), the checks, the runner, the
reports, and the entry points on top. Every import counts, the ones inside
functions too (a lazy import still ties two floors together: that is how the memory check once
made an import circle, checks → run → checks).

    python -m pytest -q tests/conformance/test_layering.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import conformance

ROOT = Path(conformance.__file__).parent
FLOORS = (
    {"conformance", "results", "atomic_write", "process_exit"},
    {"cases"},
    {"harness"},
    {"checks"},
    {"run"},
    {"report"},
    {"cli", "__main__", "pytest_plugin", "pytest_results", "scaffold", "tuning"},
)


def part_of(module: str) -> str:
    """``conformance.checks.memory.sanitizer`` → ``checks``; ``conformance`` → ``conformance``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("conformance", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def floor_of(part: str) -> int:
    return next(index for index, parts in enumerate(FLOORS) if part in parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """Every ``conformance`` module ``path`` imports, with the line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "conformance":
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "conformance"]
    return found


def upward_imports(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        here = part_of(module_of(path, root))
        for module, line in imports(path):
            there = part_of(module)
            if floor_of(there) > floor_of(here):
                problems.append(
                    f"{path.relative_to(root.parent)}:{line} ({here}) imports {module} ({there}), a floor up"
                )
    return problems


def test_every_part_of_the_package_has_a_floor():
    parts = {part_of(module_of(path)) for path in ROOT.rglob("*.py")}
    assert parts <= set().union(*FLOORS), parts - set().union(*FLOORS)
    assert set().union(*FLOORS) <= parts, set().union(*FLOORS) - parts  # no floor names a module that is gone


def test_no_import_goes_up_a_floor():
    assert upward_imports() == []


def test_an_upward_import_is_found(tmp_path):
    package = tmp_path / "conformance"
    (package / "cases").mkdir(parents=True)
    (package / "results.py").write_text("def save():\n    from conformance.report.output_paths import write\n")
    (package / "cases" / "grammar.py").write_text("from conformance.results import CaseResult\n")
    assert upward_imports(package) == [
        "conformance/results.py:2 (results) imports conformance.report.output_paths (report), a floor up"
    ]
