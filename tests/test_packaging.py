"""Package metadata: the license that pyproject.toml declares ships as a file."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_license_is_an_spdx_expression_with_its_file():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    project = meta["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))  # not with an expression
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("BSD 3-Clause License") and "the flashtile authors" in text
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])
