"""The public modules raise no argument errors of their own: every rule is a function of
``flashtile.validation``, which they call (checked on the source tree)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flashtile"
PUBLIC = ["compat.py", "cpu/__init__.py", "cpu/attention.py", "cpu/fused.py", "cpu/numerics.py", "cpu/varlen.py",
          "distributed.py", "fp8.py", "integrations/transformers.py", "interface.py",
          "kvcache.py", "merging.py", "packed.py", "padding.py", "rotary.py", "sdpa.py", "ops/softmax.py"]
ARGUMENT_ERRORS = {"TypeError", "ValueError", "NotImplementedError"}


def _raised_here(tree: ast.Module) -> list[int]:
    """Lines that raise an argument error built in place (``raise ValueError(...)``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in ARGUMENT_ERRORS:
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", PUBLIC)
def test_public_module_leaves_its_argument_rules_to_validation(module):
    assert _raised_here(ast.parse((PACKAGE / module).read_text())) == []


def test_the_check_can_fail():
    assert _raised_here(ast.parse("def f(x):\n    raise ValueError('x')\n")) == [2]
