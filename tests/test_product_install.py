"""The product works without the lab: every module of `kvhandoff` imports, and its commands start, in an interpreter
where the lab and its dependencies cannot be imported (as after `pip install kvhandoff`, without `[lab]`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what only the lab needs: the lab itself and the import names of its extra's packages
LAB_ONLY = ("kvhandoff_lab", "matplotlib", "pyarrow", "lm_eval")
#: the pip names of the same packages, as pyproject's dependencies would spell them
LAB_DISTRIBUTIONS = ("matplotlib", "pyarrow", "lm-eval", "lm_eval")

BLOCKER = f"""
import sys


class LabOnlyImports:
    \"\"\"Refuses the lab and its dependencies, as an interpreter without them would.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {LAB_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a product install has no lab)", name=name)
        return None


sys.meta_path.insert(0, LabOnlyImports())
"""

IMPORT_EVERY_MODULE = """
import importlib
import importlib.util
import pkgutil

import kvhandoff

# a __main__ module runs its command when imported; the commands are started below. The vLLM connector subclasses
# vLLM's own base class: it imports where vLLM is installed (.venv-vllm, tests/test_vllm_connector.py), not here
vllm_absent = importlib.util.find_spec("vllm") is None
names = [info.name for info in pkgutil.walk_packages(kvhandoff.__path__, "kvhandoff.")
         if not info.name.endswith(".__main__") and not (vllm_absent and info.name == "kvhandoff.vllm.connector")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""

#: the commands whose --help runs, each through the console script's `main` (the bare `kvhandoff` first)
COMMANDS = (("fit",), ("serve",), ("prepare",), ("refine",), ("demo",), ("guard-calibrate",))
HELP_OF_EVERY_COMMAND = f"""
import sys

from kvhandoff.cli import main

for command in [(), *{COMMANDS!r}]:
    sys.argv = ["kvhandoff", *command, "--help"]
    try:
        main()
    except SystemExit as done:
        if done.code not in (0, None):
            raise
"""


@pytest.fixture(scope="module")
def without_the_lab(tmp_path_factory) -> dict[str, str]:
    """The environment of an interpreter that cannot import what only the lab needs (a sitecustomize blocks it)."""
    folder = tmp_path_factory.mktemp("product_only")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    paths = [str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_blocked_interpreter_cannot_import_the_lab(without_the_lab):
    for name in LAB_ONLY:
        result = run_python(without_the_lab, "-c", f"import {name}")
        assert result.returncode != 0 and "a product install has no lab" in result.stderr, name


def test_every_product_module_imports_without_the_lab(without_the_lab):
    result = run_python(without_the_lab, "-c", IMPORT_EVERY_MODULE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[0]) > 40  # the walk found the package's modules


def test_the_product_commands_start_without_the_lab(without_the_lab):
    result = run_python(without_the_lab, "-c", HELP_OF_EVERY_COMMAND)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Usage: kvhandoff") == 1 + len(COMMANDS), result.stdout[-3000:]


def test_the_product_dependencies_leave_the_lab_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = [requirement_name(r) for r in project["dependencies"]]
    assert [name for name in names if name in LAB_DISTRIBUTIONS] == []
    lab = {requirement_name(r) for r in project["optional-dependencies"]["lab"]}
    assert {"matplotlib", "pyarrow", "lm-eval"} <= lab  # they are the lab's, not missing


def requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string ("lm-eval==0.4.13" → "lm-eval"), lower-cased."""
    for index, character in enumerate(requirement):
        if not (character.isalnum() or character in "-_."):
            return requirement[:index].lower()
    return requirement.lower()
