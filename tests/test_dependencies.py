"""Every third-party package the project imports is declared in pyproject.toml.

Two checks, both against the checkout's own files, so nothing installed by hand can hide a gap:
- every import statement anywhere in the source (inside functions too: a lazy import fails only
  when the feature runs) names the standard library, the project itself, or a package whose
  distribution ``[project] dependencies`` or an extra of ``[project.optional-dependencies]``
  declares;
- every module of the package, adapters, recipes and benchmarks included, imports in a fresh
  interpreter.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from test_public_api import _type_checking_blocks  # ids of imports only annotations see

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("piper_plugin", "adapters", "recipes", "benchmarks", "tests")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """Normalized distribution name -> where it is declared ("dependencies" or "extra NAME")."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = {}
    groups = [("dependencies", project.get("dependencies", []))]
    groups += [(f"extra {extra}", reqs) for extra, reqs in project.get("optional-dependencies", {}).items()]
    for where, requirements in groups:
        for requirement in requirements:
            out.setdefault(_normalize(re.match(r"[A-Za-z0-9._-]+", requirement).group()), where)
    return out


def imported_top_levels(path: Path):
    """(line, top-level name) of every executed absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def _local_names(path: Path) -> set[str]:
    """Top-level names a file may import from the project: the checkout's top-level packages and
    modules, and the modules beside it (tests and scripts import their siblings)."""
    names = {"piper_plugin"}
    for folder in (ROOT, path.parent):
        names |= {p.stem for p in folder.glob("*.py")}
        names |= {p.name for p in folder.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    return names


def undeclared_imports(files: list[Path], declared: dict[str, str]) -> list[str]:
    """One line per import whose package is not declared. A package not installed here (an extra's)
    passes only if a declared distribution has its import name."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for path in files:
        local = _local_names(path)
        for line, name in imported_top_levels(path):
            if name in sys.stdlib_module_names or name in local or name == "__future__":
                continue
            where = f"{path.relative_to(ROOT)}:{line}: import {name}"
            dists = providers.get(name)
            if not dists:  # an extra's package not installed here: declared under its import name
                if _normalize(name) not in declared:
                    problems.append(f"{where}: no installed distribution provides it; declare it in pyproject.toml")
            elif not any(_normalize(d) in declared for d in dists):
                problems.append(f"{where}: its distribution {'/'.join(dists)} is not declared in pyproject.toml "
                                "(add it to [project] dependencies, or to the extra of the feature that needs it)")
    return problems


def _source_files() -> list[Path]:
    return sorted(p for folder in SOURCE for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_third_party_import_is_declared():
    assert not undeclared_imports(_source_files(), declared_distributions())


def test_the_check_finds_a_package_removed_from_the_metadata(tmp_path):
    """The check reads pyproject.toml itself: without scipy's line, calibrate's nnls import fails it."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"scipy[^"]*",.*\n', text, flags=re.M)
    stripped = tmp_path / "pyproject.toml"
    stripped.write_text(re.sub(r'^\s*"scipy[^"]*",.*\n', "", text, flags=re.M))
    problems = undeclared_imports(_source_files(), declared_distributions(stripped))
    assert problems and all("import scipy" in p for p in problems)
    assert any(p.startswith("piper_plugin/calibrate.py") for p in problems)


def _modules() -> list[str]:
    out = []
    for folder, package in (("piper_plugin", "piper_plugin"), ("adapters", "piper_plugin.adapters"),
                            ("recipes", "piper_plugin.recipes"), ("benchmarks", "benchmarks")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out.append(".".join([package, *parts]))
    return out


_IMPORT_ALL = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_in_a_fresh_interpreter():
    modules = _modules()
    assert "piper_plugin.calibrate" in modules and "piper_plugin.adapters.megatron.schedule" in modules
    assert "benchmarks.torchtitan_ab" in modules
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *modules], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]

