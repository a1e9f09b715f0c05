"""Every third-party module the serving processes import is one that installing the package brings.

A module only the test extras bring (as jsonschema once was for the gateway) works in ``./ops/test`` and breaks
``pip install .`` on a fresh host; this finds such an import before a deployment does.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVING_PACKAGES = ("common", "gateway", "workers")
FIRST_PARTY = {*SERVING_PACKAGES, "benchmarks", "tests"}
# Imported by the serving code but not required on every host, each for the reason given.
OPTIONAL = {"triton": "CUDA builds of torch bring it; the Triton kernels load only where CUDA is"}


def imported_modules(package_dir: Path) -> dict[str, Path]:
    """Top-level names of every module imported anywhere under ``package_dir`` (first file seen for each),
    imports inside functions included: a lazy import fails as surely, only later."""
    found: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path)
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_normal(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0]) for spec in project["dependencies"]}


def _normal(distribution: str) -> str:
    return distribution.lower().replace("_", "-")


def undeclared(package_dir: Path, declared: set[str]) -> list[str]:
    providers = packages_distributions()
    missing = []
    for module, path in imported_modules(package_dir).items():
        if module in sys.stdlib_module_names or module in FIRST_PARTY or module in OPTIONAL:
            continue
        distributions = {_normal(d) for d in providers.get(module, [])}
        if not distributions & declared:
            missing.append(f"{module} ({path.name}; installed by {sorted(distributions) or 'nothing'})")
    return missing


def test_every_serving_import_is_a_declared_dependency() -> None:
    declared = declared_distributions()
    missing = [m for package in SERVING_PACKAGES for m in undeclared(REPO / package, declared)]
    assert not missing, f"imported by the serving code but not in pyproject's dependencies: {missing}"


def test_an_import_only_the_test_extras_bring_is_found(tmp_path: Path) -> None:
    source = "import json\nfrom numpy import ndarray\n\n\ndef check():\n    import jsonschema\n"
    (tmp_path / "tools.py").write_text(source)
    declared = declared_distributions()
    assert undeclared(tmp_path, declared) == []
    found = undeclared(tmp_path, declared - {"jsonschema"})
    assert len(found) == 1 and found[0].startswith("jsonschema (tools.py")
