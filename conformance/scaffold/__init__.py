"""``conformance new-backend NAME``: a backend module that passes the smoke suite out of the box,
and a test that runs the suite against it through the pytest plugin.

The two files are ``template_backend.py`` and ``template_test.py`` beside this one, with the
template's names replaced (module ``NAME``, classes ``<Name>Backend`` / ``<Name>Metadata``):
the templates are real modules, run by the project's own tests, so the skeleton cannot rot.
"""

from __future__ import annotations

import importlib.util
import keyword
from pathlib import Path

HERE = Path(__file__).resolve().parent


class ScaffoldError(ValueError):
    """A name or folder the skeleton cannot be written for: one line for the user."""


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def render(template: str, name: str) -> str:
    title = camel(name)
    for old, new in (
        ("template_backend", name),
        ("TemplateBackend", f"{title}Backend"),
        ("TemplateMetadata", f"{title}Metadata"),
        ('"template"', f'"{name}"'),
        ("``template``", f"``{name}``"),
        ("new-backend template", f"new-backend {name}"),
    ):
        template = template.replace(old, new)
    return template


def write_skeleton(name: str, directory: str | Path = ".") -> list[Path]:
    """Write ``NAME.py`` and ``test_NAME.py`` into ``directory``; ScaffoldError, writing nothing,
    for a name that is not a new module name or a file that exists."""
    if not name.isidentifier() or keyword.iskeyword(name) or not camel(name):
        raise ScaffoldError(f"{name!r} is not a Python module name (letters, digits and _, not starting with a digit)")
    directory = Path(directory)
    if not directory.is_dir():
        raise ScaffoldError(f"{directory} is not a folder")
    files = {directory / f"{name}.py": "template_backend.py", directory / f"test_{name}.py": "template_test.py"}
    for path in files:
        if path.exists():
            raise ScaffoldError(f"{path} exists: not overwritten")
    if importlib.util.find_spec(name) is not None:  # `torch`, `backends`: the new module would shadow it
        raise ScaffoldError(f"a module named {name!r} is already importable here: choose another name")
    written: list[Path] = []
    try:
        for path, template in files.items():
            path.write_text(render((HERE / template).read_text(), name))
            written.append(path)
    except OSError as error:  # a read-only folder, a full disk: nothing half-written is left behind
        for path in written:
            path.unlink(missing_ok=True)
        raise ScaffoldError(f"cannot write into {directory}: {error.strerror or error}") from None
    return list(files)
