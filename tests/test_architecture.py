"""The repository's structural rules, checked on the source tree (no imports of the modules).

* A module reaches another module's public names only: no ``from flashtile.x import _name``
  and no ``module._name`` on an imported flashtile module (tests and benchmarks may look
  inside; the package may not depend on another module's internals).
* A module over ~600 lines says at its top, in its docstring, why it is one file.
* ``benchmarks/results`` holds one current ``.jsonl`` with its ``.png`` per benchmark, and no
  run folders.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flashtile"
MAX_LINES = 600
LONG_MODULE_NOTE = "over 600 lines on purpose"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(tree: ast.Module) -> list[str]:
    """``module:name`` for every private name this module takes from another flashtile module."""
    modules = {}  # local name -> flashtile module (or module.member) it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashtile"):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.module}:{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flashtile"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            found.append(f"{modules[node.value.id]}:{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = _private_uses(ast.parse(path.read_text()))
        if uses:
            offenders[str(path.relative_to(ROOT))] = sorted(set(uses))
    assert not offenders, offenders


def test_the_private_name_check_can_fail():
    tree = ast.parse("from flashtile.kernels import decode as kd\nfrom flashtile.cpu import _x\nkd._plans\n")
    assert _private_uses(tree) == ["flashtile.cpu:_x", "flashtile.kernels.decode:_plans"]


def test_long_modules_say_why_they_are_one_file():
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if LONG_MODULE_NOTE not in " ".join(doc.split()):
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, unexplained


def test_results_hold_one_jsonl_and_png_per_benchmark():
    results = ROOT / "benchmarks" / "results"
    entries = list(results.iterdir())
    assert not [p.name for p in entries if p.is_dir()], "run folders under benchmarks/results"
    jsonl = {p.stem for p in entries if p.suffix == ".jsonl"}
    png = {p.stem for p in entries if p.suffix == ".png"}
    assert jsonl, "no results"
    assert jsonl == png, {"without a plot": sorted(jsonl - png), "without records": sorted(png - jsonl)}
