"""Every package under megalite/ is listed in pyproject.toml: a non-editable install copies only
the listed ones, so a missing entry breaks `pip install .` while the editable install works."""

from __future__ import annotations

import re

from tests.paths import ROOT


def test_every_package_is_listed_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
    listed = set(re.findall(r'"([\w.]+)"', block))
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "megalite").rglob("__init__.py")
    }
    assert found - listed == set(), f"add to pyproject.toml packages: {sorted(found - listed)}"
