"""Every package under megalite/ is listed in pyproject.toml: a non-editable install copies only
the listed ones, so a missing entry breaks `pip install .` while the editable install works. And
the checkout runs without any install: the checkout on PYTHONPATH imports all of megalite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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


# Imports megalite's fused-kernel layer with sys.path = the arguments + site-packages, run under
# -I -S: no PYTHONPATH, no current folder, and site-packages' .pth hooks do not run, so an
# editable install of megalite (a finder installed by a .pth file) is hidden while torch is not.
IMPORT_KERNELS = """
import site, sys
sys.path[:0] = sys.argv[1:] + site.getsitepackages()
import megalite.kernels, megalite.core.fusions
print(megalite.kernels.__file__)
"""


def _python(args: list[str], cwd: Path, env: dict | None = None):
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_checkout_imports_without_an_install(tmp_path):
    hidden = _python(["-I", "-S", "-c", IMPORT_KERNELS], tmp_path)
    assert "No module named 'megalite'" in hidden.stderr  # the install is out of sight
    isolated = _python(["-I", "-S", "-c", IMPORT_KERNELS, str(ROOT)], tmp_path)
    assert isolated.returncode == 0, isolated.stderr
    assert Path(isolated.stdout.strip()).parent == ROOT / "megalite" / "kernels"
    # as a user types it, from a folder outside the checkout
    code = "import megalite.kernels, megalite.core.fusions; print(megalite.kernels.__file__)"
    typed = _python(["-c", code], tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert typed.returncode == 0, typed.stderr
    assert Path(typed.stdout.strip()).parent == ROOT / "megalite" / "kernels"
