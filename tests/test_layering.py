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
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvhandoff"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)  # may be a submodule (from kvhandoff import cache)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvhandoff"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules
                and (SRC / "kvhandoff" / f"{node.value.id}.py").exists()):
            found.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for path in sorted(SRC.rglob("*.py")) for use in private_uses(path)]
    assert found == []


def test_private_use_is_detected(tmp_path):
    module = tmp_path / "bad.py"
    module.write_text("from kvhandoff.mapper import _rotate\nfrom kvhandoff import mapper\nmapper._short(1)\n")
    assert private_uses(module) == ["bad.py:1 imports kvhandoff.mapper._rotate", "bad.py:3 uses mapper._short"]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=SRC.parent)
    assert result.returncode == 0, result.stdout[-3000:]
