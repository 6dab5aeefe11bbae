"""docs/API.md against the code: the public API, the modules and the commands it documents (its conventions are
stated at its top)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "API.md"
SOURCES = ROOT / "src"
PUBLIC_SECTION = "## The public API"
#: a dotted path of the product or the lab, e.g. `kvhandoff.fit.pipeline` or `kvhandoff.mapper.mapper.Mapper.load`
DOTTED = re.compile(r"`((?:kvhandoff|kvhandoff_lab)(?:\.\w+)+)`")
MODULE_HEADING = re.compile(r"^#{2,4} `((?:kvhandoff|kvhandoff_lab)(?:\.\w+)*)`")
BULLET_NAME = re.compile(r"^- `([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")
FIRST_BACKTICKED = re.compile(r"`([^`]+)`")


def doc_lines() -> list[str]:
    return API_DOC.read_text(encoding="utf-8").splitlines()


def is_entry(line: str) -> bool:
    """A heading or a table row (not the table's header separator)."""
    return line.startswith("#") or (line.startswith("|") and not set(line) <= set("|-: "))


def entry_name(line: str) -> str | None:
    """The name an entry documents: its first backticked item."""
    found = FIRST_BACKTICKED.search(line)
    return found.group(1) if found else None


def public_entries(lines: list[str]) -> set[str]:
    """The names of the rows under the public API's heading (up to the next heading of its level)."""
    start = lines.index(PUBLIC_SECTION) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return {entry_name(line) for line in lines[start:end] if line.startswith("|") and is_entry(line)} - {None}


def module_file(dotted: str) -> Path | None:
    """The source file of module ``dotted`` (a package's __init__.py), or None when it is no module."""
    base = SOURCES.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def module_names(path: Path) -> dict[str, ast.AST]:
    """The names a module defines at its top level (definitions, assignments, imports), each with its node."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def class_names(node: ast.ClassDef) -> set[str]:
    """What a class body defines: methods, properties and fields."""
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return names


def defines(path: Path, name: str, member: str | None = None) -> bool:
    """Whether the module at ``path`` defines ``name`` (and, for a class defined there, its ``member``)."""
    node = module_names(path).get(name)
    if node is None:
        return False
    if member is None or not isinstance(node, ast.ClassDef):
        return True
    return member in class_names(node)


def resolves(dotted: str) -> bool:
    """Whether a dotted path names a module of src/, or a name (and a class member) one defines."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:split]))
        if path is not None:
            rest = parts[split:]
            return not rest or (len(rest) <= 2 and defines(path, *rest))
    return False


def module_sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(module, its bullet lines) of every heading that names a module."""
    sections: list[tuple[str, list[str]]] = []
    for line in lines:
        heading = MODULE_HEADING.match(line)
        if heading:
            sections.append((heading.group(1), []))
        elif line.startswith("#"):
            sections.append(("", []))
        elif sections and line.startswith("- `"):
            sections[-1][1].append(line)
    return [(module, bullets) for module, bullets in sections if module]


def command_names(cli_package: Path) -> list[str]:
    """The commands a command-line package registers, ``app.command([name])(callback)`` in its __init__.py, read
    without importing it (a command without a name is its callback's, dashed, as typer names it)."""
    names = []
    for node in ast.walk(ast.parse((cli_package / "__init__.py").read_text(encoding="utf-8"))):
        register = node.func if isinstance(node, ast.Call) else None
        if (isinstance(register, ast.Call) and isinstance(register.func, ast.Attribute)
                and register.func.attr == "command" and node.args):
            if register.args and isinstance(register.args[0], ast.Constant):
                names.append(register.args[0].value)
            else:
                callback = node.args[0]
                names.append((callback.attr if isinstance(callback, ast.Attribute) else callback.id).replace("_", "-"))
    return sorted(names)


def test_every_public_name_has_its_row_and_only_those():
    import kvhandoff

    documented = public_entries(doc_lines())
    assert sorted(set(kvhandoff.__all__) - documented) == [], "names of kvhandoff.__all__ without a row"
    assert sorted(documented - set(kvhandoff.__all__)) == [], "rows of the public API that kvhandoff does not export"


def test_every_dotted_path_in_the_doc_exists():
    text = API_DOC.read_text(encoding="utf-8")
    missing = sorted({path for path in DOTTED.findall(text) if not resolves(path)})
    assert missing == []


def test_every_name_a_module_section_lists_is_defined_there():
    missing = []
    for module, bullets in module_sections(doc_lines()):
        path = module_file(module)
        assert path is not None, f"{module} is no module"
        for line in bullets:
            found = BULLET_NAME.match(line)
            if found and not defines(path, found.group(1), found.group(2)):
                missing.append(f"{module}: {found.group(0)[3:]}")
    assert missing == []


@pytest.mark.parametrize("script, package", [("kvhandoff", "kvhandoff/cli"), ("kvhandoff-lab", "kvhandoff_lab/cli")])
def test_every_command_has_its_row(script, package):
    rows = {entry_name(line) for line in doc_lines() if line.startswith("|") and is_entry(line)}
    commands = command_names(SOURCES / package)
    assert len(commands) >= 5, f"{package} registers {commands}"
    assert [name for name in commands if f"{script} {name}" not in rows] == []


@pytest.mark.parametrize("dotted, expected", [
    ("kvhandoff.fit.pipeline", True),
    ("kvhandoff.fit.pipeline.collect_statistics", True),
    ("kvhandoff.mapper.mapper.Mapper.load", True),
    ("kvhandoff.FitConfig", True),
    ("kvhandoff.fit.pipeline.no_such_function", False),
    ("kvhandoff.mapper.mapper.Mapper.no_such_method", False),
    ("kvhandoff.no_such_module", False),
])
def test_a_dotted_path_resolves_only_when_it_exists(dotted, expected):
    assert resolves(dotted) is expected
