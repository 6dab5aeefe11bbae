"""The package's layering: import-linter checks the import contracts (pyproject.toml); this checks that no module
uses another module's private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def private_uses(path: Path) -> list[str]:
    """`from kvhandoff.x import _y` and `module._y` where `module` is an imported kvhandoff module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: dict[str, str] = {}  # local name → the kvhandoff module it names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvhandoff"):
            package = node.module
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                if _module_path(f"{package}.{alias.name}").exists():  # a submodule (from kvhandoff.model import cache)
                    modules[alias.asname or alias.name] = f"{package}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvhandoff") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def _module_path(module: str) -> Path:
    return SRC.joinpath(*module.split(".")).with_suffix(".py")


def test_no_module_uses_another_modules_private_names():
    found = [use for path in sorted(SRC.rglob("*.py")) for use in private_uses(path)]
    assert found == []


def test_private_use_is_detected(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("from kvhandoff.mapper.mapper import _rotate\nfrom kvhandoff.mapper import mapper\n"
                      "mapper._short(1)\n"
                      "import kvhandoff.runtime.handoff as handoff\nhandoff._check_ids(1)\n")
    assert private_uses(module) == ["bad.py:1 imports kvhandoff.mapper.mapper._rotate", "bad.py:3 uses mapper._short",
                                    "bad.py:5 uses handoff._check_ids"]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=SRC.parent)
    assert result.returncode == 0, result.stdout[-3000:]
