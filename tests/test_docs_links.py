"""The documentation's relative links resolve: every Markdown link in README.md, docs/*.md and
reports/README.md names a file of this repository that exists and, where it carries a #anchor into
a Markdown file, a heading of that file (GitHub's slugs). README stays a front door: at most 300
lines, linking every page under docs/."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(?<!\\)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:


def documentation_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "reports" / "README.md"]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without Markdown marks, lower-cased, every
    character but letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays
    text = re.sub(r"[*]|(?<!\w)_|_(?!\w)", "", text)  # emphasis marks, not snake_case
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path):
    """(line number, target) of every Markdown link outside code."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub(lambda m: "`" + " " * len(m.group(2)) + "`" if "](" in m.group(2) else m.group(0), line)
        for match in _LINK.finditer(line):
            yield number, match.group(1)


def broken_links(paths: list[Path], root: Path = ROOT) -> list[str]:
    problems = []
    for path in paths:
        for number, target in links(path):
            where = f"{path.relative_to(root)}:{number}: ({target})"
            if _EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
            try:
                inside = resolved.relative_to(root)
            except ValueError:
                problems.append(f"{where} points outside the repository")
                continue
            if inside.parts[:1] == ("shared",):
                problems.append(f"{where} points into shared/")
                continue
            if not resolved.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
                problems.append(f"{where}: no heading #{anchor} in {inside}")
    return problems


def test_every_relative_link_resolves_to_a_file_and_heading():
    assert not broken_links(documentation_files()), "\n".join(broken_links(documentation_files()))


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for _, target in links(ROOT / "README.md")
        if not _EXTERNAL.match(target) and target.partition("#")[0]
    }
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md links no page {unlinked}"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page\n\n## Kernel speed (`conformance bench`, H100)\n\n## Where a run's time goes\n\n"
        "```yaml\n# not a heading\n```\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "[fine](docs/a.md) [fine](docs/a.md#kernel-speed-conformance-bench-h100) "
        "[fine](docs/a.md#where-a-runs-time-goes) [fine](#top) [web](https://example.com/x.md)\n"
        "# Top\n"
        "[gone](docs/missing.md) [no heading](docs/a.md#not-a-heading) [out](../elsewhere.md)\n"
        "`[in code](docs/missing.md)`\n"
        "```\n[in a block](docs/missing.md)\n```\n"
    )
    problems = broken_links([page, tmp_path / "docs" / "a.md"], root=tmp_path)
    assert [p.split(": (")[1].split(")")[0] for p in problems] == [
        "docs/missing.md",
        "docs/a.md#not-a-heading",
        "../elsewhere.md",
    ], problems
    assert "no heading #not-a-heading" in problems[1]


def test_github_slugs():
    assert (
        github_slug("Kernel speed (`conformance bench`, H100 and H200)")
        == "kernel-speed-conformance-bench-h100-and-h200"
    )
    assert github_slug("The memory check (`reports/memory/`)") == "the-memory-check-reportsmemory"
    assert github_slug("`conformance compare`, the gate") == "conformance-compare-the-gate"
    assert github_slug("flash_attn beside flashinfer") == "flash_attn-beside-flashinfer"
    assert github_slug("Part 2: batched, async") == "part-2-batched-async"
