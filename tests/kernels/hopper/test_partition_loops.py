"""The warp-specialised kernels' item loops, read from their source on the CPU.

A producer and its consumers must walk the same work items: each derives them from
``program_items`` (first item, stride, count).  A name bound there and bound again later in
the same function sends that partition to other items than its partners, and the kernel
hangs on a barrier or reads another item's tiles; the GPU tests see it only on shapes with
more items than programs.  Here every Gluon function is checked for such a rebinding.
"""

import ast
from pathlib import Path

import pytest

pytest.importorskip("flashtile.kernels.hopper")

HOPPER = Path(__file__).resolve().parents[3] / "flashtile" / "kernels" / "hopper"


def _bound_names(node: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every name an assignment, augmented assignment or loop binds in ``node``."""
    found = []
    for sub in ast.walk(node):
        targets = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign, ast.For)):
            targets = [sub.target]
        for target in targets:
            found += [(n.id, n.lineno) for n in ast.walk(target) if isinstance(n, ast.Name)]
    return found


def _calls(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(node))


def item_loop_rebindings(source: str) -> list[str]:
    """``function: name (lines)`` for each name bound from ``program_items`` and bound again."""
    problems = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        item_names = set()
        for stmt in ast.walk(fn):
            if isinstance(stmt, ast.Assign) and _calls(stmt.value, "program_items"):
                item_names |= {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        lines = {}
        for name, line in _bound_names(fn):
            if name in item_names:
                lines.setdefault(name, []).append(line)
        problems += [f"{fn.name}: {name} {where}" for name, where in lines.items() if len(where) > 1]
    return problems


@pytest.mark.parametrize("path", sorted(HOPPER.glob("*.py")), ids=lambda p: p.name)
def test_item_loop_names_are_bound_once(path):
    assert item_loop_rebindings(path.read_text()) == []


def test_the_check_finds_a_rebinding():
    source = '''
def consumer(num_items):
    first, stride, n_items = program_items(num_items, True)
    for it in range(n_items):
        first = it - 1
'''
    assert item_loop_rebindings(source) == ["consumer: first [3, 5]"]
