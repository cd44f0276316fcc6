"""The shape of the house: no import circles, none against the layering, no history in the code.

The import graph is read from the source (``tools/import_graph.py``); every import counts, at module
level or inside a function. The layering is DESIGN.md's: ``core`` imports only kernels, ``models``
only core, ``training`` never ``planning``, and so on (``import_graph.ALLOWED``). Each check is also
run on a planted defect in a copy of a tiny tree, so a check that cannot fail would show here.
"""

from __future__ import annotations

from pathlib import Path

from tests.paths import ROOT
from tools import check_history, import_graph


def test_megalite_has_no_import_circle():
    circles = import_graph.cycles(import_graph.imports(ROOT))
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_import_runs_against_the_layering():
    bad = import_graph.upward(import_graph.imports(ROOT))
    assert not bad, "\n".join(f"{e.source}:{e.line} imports {e.target}" for e in bad)


def test_no_issue_numbers_in_the_code():
    found = check_history.references(ROOT)
    assert not found, "\n".join(found)


def _tiny_tree(tmp_path: Path) -> Path:
    """A package with megalite's shape: kernels, core, models, training, planning, one module each
    (core's fusions the one way into the kernels)."""
    pkg = tmp_path / "megalite"
    for part in ("kernels", "core", "models", "training", "planning"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("class ConfigError(ValueError):\n    pass\n")
    (pkg / "kernels" / "softmax.py").write_text("def softmax_forward(x):\n    return x\n")
    (pkg / "core" / "mesh.py").write_text("from megalite.errors import ConfigError\n")
    (pkg / "core" / "fusions.py").write_text("from megalite.kernels import softmax\n")
    (pkg / "models" / "gpt.py").write_text("from megalite.core import mesh\n")
    (pkg / "training" / "loop.py").write_text("from megalite.models.gpt import *\n")
    (pkg / "planning" / "plan.py").write_text("import megalite.training.loop\n")
    return tmp_path


def test_the_checks_pass_on_a_clean_tree(tmp_path):
    root = _tiny_tree(tmp_path)
    edges = import_graph.imports(root)
    assert len(edges) == 5
    assert import_graph.cycles(edges) == [] and import_graph.upward(edges) == []


def test_a_planted_circle_is_found_even_inside_a_function(tmp_path):
    root = _tiny_tree(tmp_path)
    (root / "megalite" / "core" / "groups.py").write_text(
        "def size(group):\n    from megalite.core.mesh import ConfigError\n    return 1\n"
    )
    with open(root / "megalite" / "core" / "mesh.py", "a") as f:
        f.write("from megalite.core.groups import size\n")
    edges = import_graph.imports(root)
    assert import_graph.cycles(edges) == [["megalite.core.groups", "megalite.core.mesh"]]
    assert any(e.local and e.source == "megalite.core.groups" for e in edges)


def test_a_planted_upward_import_is_found(tmp_path):
    root = _tiny_tree(tmp_path)
    with open(root / "megalite" / "training" / "loop.py", "a") as f:
        f.write("def first_step():\n    from megalite.planning import plan\n")
    with open(root / "megalite" / "core" / "mesh.py", "a") as f:
        f.write("from ..models import gpt\n")  # relative imports resolve too
    with open(root / "megalite" / "models" / "gpt.py", "a") as f:
        f.write(
            "from megalite.kernels.softmax import softmax_forward\n"
        )  # only core reaches kernels
    with open(root / "megalite" / "kernels" / "softmax.py", "a") as f:
        f.write("from megalite.core import mesh\n")
    bad = {(e.source, e.target) for e in import_graph.upward(import_graph.imports(root))}
    assert bad == {
        ("megalite.training.loop", "megalite.planning.plan"),
        ("megalite.core.mesh", "megalite.models.gpt"),
        ("megalite.models.gpt", "megalite.kernels.softmax"),
        ("megalite.kernels.softmax", "megalite.core.mesh"),
    }


def test_a_planted_issue_reference_is_found(tmp_path):
    root = _tiny_tree(tmp_path)
    assert check_history.references(root) == []
    (root / "megalite" / "core" / "mesh.py").write_text("X = 1  # issue 18: the bucket count\n")
    (root / "README.md").write_text("# megalite\n\n## Planning a layout (Issue 19)\n")
    found = check_history.references(root)
    assert [f.split(":")[0] for f in found] == ["megalite/core/mesh.py", "README.md"]
    assert check_history.main(["--root", str(root)]) == 1


def test_the_test_command_runs_the_history_check():
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert "tools/check_history.py" in text  # scripts/test.sh is what .ci/run calls
