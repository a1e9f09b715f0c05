"""What the import-linter contract (pyproject.toml, run by ./ops/test) cannot see: ``common`` imports torch only
inside functions, so that importing it (the gateway does) never loads torch. import-linter does not tell a
module-level import from a function-level one; this reads the source."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "common"


def module_level_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: outside functions, and outside ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (imp for child in node.orelse for imp in module_level_imports(ast.Module([child], [])))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from module_level_imports(node)


def imports_torch(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] == "torch"
    return any(alias.name.split(".")[0] == "torch" for alias in node.names)


@pytest.mark.parametrize("source", sorted(COMMON.glob("*.py")), ids=lambda p: p.name)
def test_common_imports_no_torch_at_module_level(source: Path) -> None:
    tree = ast.parse(source.read_text(), filename=str(source))
    found = [f"{source.name}:{node.lineno}" for node in module_level_imports(tree) if imports_torch(node)]
    assert not found, f"module-level torch imports in common (import it inside the function that needs it): {found}"


def test_the_check_sees_what_it_must() -> None:
    tree = ast.parse(
        "import os\nimport torch.nn\nif TYPE_CHECKING:\n    import torch\nclass A:\n    from torch import nn\n"
        "try:\n    import torch as t\nexcept ImportError:\n    pass\ndef f():\n    import torch\n"
    )
    assert [node.lineno for node in module_level_imports(tree) if imports_torch(node)] == [2, 6, 8]
