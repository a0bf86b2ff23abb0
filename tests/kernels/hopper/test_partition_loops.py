"""The warp-specialised kernels' item loops, read from their source on the CPU.

A producer and its consumers must walk the same work items: each derives them from
``program_items`` (first item, stride, count).  A name bound there and bound again later in
the same function sends that partition to other items than its partners, and the kernel
hangs on a barrier or reads another item's tiles; the GPU tests see it only on shapes with
more items than programs.  Here every Gluon function is checked for such a rebinding.

And ``gl.warp_specialize`` hands a partition its arguments: a constexpr among them stays one
only as an argument of its own.  Inside a nested tuple it arrives as a runtime value, and a
branch on it is compiled (a packed-only branch in a dense kernel, say), so no constexpr of the
kernel may sit in one.
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


def _is_constexpr(annotation) -> bool:
    return annotation is not None and "constexpr" in ast.unparse(annotation)


def constexprs_in_nested_tuples(source: str) -> list[str]:
    """``function: name`` for each constexpr of a function (a parameter or a local annotated
    ``constexpr``) inside a tuple nested in a partition's arguments of ``warp_specialize``
    (written in place, or a name bound to a tuple in the function)."""
    problems = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        constexprs = {a.arg for a in fn.args.args if _is_constexpr(a.annotation)}
        constexprs |= {n.target.id for n in ast.walk(fn) if isinstance(n, ast.AnnAssign)
                       and isinstance(n.target, ast.Name) and _is_constexpr(n.annotation)}
        tuples = {t.id: n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
                  for t in n.targets if isinstance(t, ast.Name)}
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "warp_specialize"):
                continue
            for partition in ast.walk(call.args[0]):
                if not (isinstance(partition, ast.Tuple) and len(partition.elts) == 2):
                    continue
                args = partition.elts[1]
                args = tuples.get(args.id, args) if isinstance(args, ast.Name) else args
                if not isinstance(args, ast.Tuple):
                    continue
                for arg in args.elts:
                    nested = tuples.get(arg.id) if isinstance(arg, ast.Name) else arg
                    if isinstance(nested, ast.Tuple):
                        problems += sorted({f"{fn.name}: {n.id}" for n in ast.walk(nested)
                                            if isinstance(n, ast.Name) and n.id in constexprs})
                # A partition given a bound tuple: its own elements are nested in the call.
                if isinstance(partition.elts[1], ast.Name):
                    problems += sorted({f"{fn.name}: {n.id}" for n in args.elts
                                        if isinstance(n, ast.Name) and n.id in constexprs})
    return problems


@pytest.mark.parametrize("path", sorted(HOPPER.glob("*.py")), ids=lambda p: p.name)
def test_no_constexpr_reaches_a_partition_inside_a_tuple(path):
    assert constexprs_in_nested_tuples(path.read_text()) == []


def test_the_check_finds_a_constexpr_in_a_tuple():
    source = '''
def kernel(X, n, VARLEN: gl.constexpr, BLOCK: gl.constexpr):
    ROWS: gl.constexpr = 2 * BLOCK
    shared = (X, n, ROWS)
    producer = (X, n, VARLEN)
    gl.warp_specialize([(consumer, (shared, BLOCK)), (loader, producer)], [1], [24])
'''
    assert constexprs_in_nested_tuples(source) == ["kernel: ROWS", "kernel: VARLEN"]

