"""Type-checks the package as it is imported: ``ckptstage.daemon`` and the rest, under their package names.

The sources live in directories named for their part (``daemon/``, ``client/``, ...), mapped to
``ckptstage.*`` by pyproject's ``package-dir``. Run on those directories, mypy cannot resolve
``from ckptstage.daemon.tiers.interface import Tier`` to ``daemon/tiers/interface.py`` and types every such name as
``Any``: calls between modules go unchecked. This builds ``build/typed/ckptstage/`` from the same
mapping (one symbolic link per top-level package) and runs mypy there, on every package.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "build" / "typed"


def package_dirs() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def main() -> int:
    mapping = package_dirs()
    shutil.rmtree(ROOT, ignore_errors=True)
    top = {name: source for name, source in mapping.items() if name.rsplit(".", 1)[0] not in mapping}
    for name, source in top.items():
        link = ROOT.joinpath(*name.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(REPO / source, target_is_directory=True)
    packages = [arg for name in sorted(top) for arg in ("-p", name)]
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *packages, *sys.argv[1:]]
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
