import textwrap

import pytest

from backends import registry
from backends.torch_naive import TorchNaiveBackend


def test_builtin_by_name():
    assert registry.load("torch_naive") is TorchNaiveBackend
    assert registry.resolve("torch_naive").origin == "builtin"


def test_module_colon_class():
    ref = registry.resolve("tests.planted.defects:WrongScale")
    assert ref.origin == "module:Class"
    assert registry.load(ref).name == "planted_wrong_scale"


@pytest.mark.parametrize(
    "name,message",
    [
        ("no_such", "unknown backend 'no_such'"),
        ("tests.planted.no_module:X", "cannot import"),
        ("tests.planted.defects:Missing", "tests.planted.defects has no Missing \\(its backend classes: "),
        ("tests.planted.defects:WrongScal", "did you mean tests.planted.defects:WrongScale\\?"),
        ("tests.planted.defects:NotABackend", "not an AttentionBackend"),
        ("tests.planted.defects:", "not of the form"),
    ],
)
def test_bad_names_give_one_line(name, message):
    with pytest.raises(registry.BackendLookupError, match=message) as error:
        registry.load(name)
    assert "\n" not in str(error.value)


def test_entry_point_group(tmp_path, monkeypatch):
    """A distribution that registers a backend under conformance.backends is found by name."""
    dist = tmp_path / "mybackend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mybackend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [conformance.backends]
            my_attention = tests.planted.defects:WrongScale
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {ref.name: ref for ref in registry.known_backends()}
    assert names["my_attention"].origin == "entry point"
    assert registry.load("my_attention").name == "planted_wrong_scale"
