"""The engine's seams: adapters and benchmarks use only the published API, and the engine's
layers import one way (api.annotate -> ir -> passes -> api.schedule -> scheduler -> compiler ->
runtime -> the launch and CLI modules). Both walk the source, so a new import that crosses a
seam fails here, naming the file, the line and the import."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import piper_plugin

ROOT = Path(__file__).resolve().parents[1]

# modules whose ``__all__`` is published, and who may import them
PUBLISHED = ("piper_plugin", "piper_plugin.recipes", "piper_plugin.models", "piper_plugin.autograd")
ADAPTER_API = ("piper_plugin.adapters.torchtitan", "piper_plugin.adapters.megatron")  # adapters' faces, for benchmarks


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(path: Path):
    """(line, module, name or None) of every executed import of ``piper_plugin`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "piper_plugin":
                for alias in node.names:
                    yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "piper_plugin":
                    yield node.lineno, alias.name, None


def _module_of(path: Path, package_root: Path, package: str) -> str:
    rel = path.relative_to(package_root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def _problems(path: Path, allowed_own: tuple[str, ...], published: tuple[str, ...]) -> list[str]:
    out = []
    for line, module, name in _imports(path):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: "
        if any(module == own or module.startswith(own + ".") for own in allowed_own):
            if name is not None and name.startswith("_"):
                out.append(where + f"private name {name!r} from {module}")
            continue
        if module not in published:
            out.append(where + f"{module} is not a published module (use {', '.join(published)})")
            continue
        if name is None:
            continue
        exported = getattr(importlib.import_module(module), "__all__", ())
        if name not in exported:
            out.append(where + f"{name!r} is not in {module}.__all__")
    return out


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_adapters_import_only_the_published_api():
    problems = []
    for path in _files("adapters"):
        own = "piper_plugin.adapters." + path.relative_to(ROOT / "adapters").parts[0]
        problems += _problems(path, (own,), PUBLISHED)
    assert not problems, "\n".join(problems)


def test_benchmarks_import_only_the_published_api():
    problems = []
    for path in _files("benchmarks"):
        problems += _problems(path, (), PUBLISHED + ADAPTER_API)
    assert not problems, "\n".join(problems)


def test_every_published_name_exists():
    for module in PUBLISHED + ADAPTER_API:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            assert hasattr(mod, name), f"{module}.__all__ lists {name!r}, which it does not define"
    assert "compile" in piper_plugin.__all__ and "Executor" in piper_plugin.__all__


# -- layers ------------------------------------------------------------------------------------
# rank of each engine module (longest matching prefix wins); a module may import only modules
# of a lower or equal rank, and modules of equal rank must not import each other both ways.
LAYERS = {
    "piper_plugin.autograd": 0,
    "piper_plugin.data": 0,
    "piper_plugin.api.annotate": 1,
    "piper_plugin.api.errors": 1,
    "piper_plugin.ir": 2,
    "piper_plugin.models": 2,
    "piper_plugin.api.filters": 3,
    "piper_plugin.passes": 3,
    "piper_plugin.api.schedule": 4,
    "piper_plugin.recipes": 5,
    "piper_plugin.scheduler": 6,
    "piper_plugin.compiler": 7,
    "piper_plugin.runtime": 8,
    "piper_plugin.training": 9,
    "piper_plugin.train_report": 9,
    "piper_plugin.cli_args": 9,
    "piper_plugin.tune": 9,
    "piper_plugin.overlap_report": 9,
    "piper_plugin.step_trace": 9,
    "piper_plugin.trace_samples": 9,
    "piper_plugin.measured_memory": 9,
    "piper_plugin.calibrate": 10,
    "piper_plugin.calibrate_host": 10,
    "piper_plugin.cli_train": 10,
    "piper_plugin.cli_tune": 10,
    "piper_plugin.cli": 11,
    "piper_plugin": 12,
}
FORBIDDEN = {  # the rule, stated as it is: these never import those
    "piper_plugin.ir": ("piper_plugin.runtime", "piper_plugin.cli", "piper_plugin.adapters", "piper_plugin.recipes"),
    "piper_plugin.passes": ("piper_plugin.runtime", "piper_plugin.cli", "piper_plugin.adapters", "piper_plugin.recipes"),
    "piper_plugin.scheduler": ("piper_plugin.runtime", "piper_plugin.cli", "piper_plugin.adapters",
                               "piper_plugin.recipes"),
    "piper_plugin.runtime": ("piper_plugin.recipes", "piper_plugin.cli", "piper_plugin.adapters"),  # invariant 4
}


def _rank(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def _engine_imports():
    """(importer, imported, file:line) for every engine module's imports of the engine."""
    for path in _files("piper_plugin"):
        me = _module_of(path, ROOT / "piper_plugin", "piper_plugin")
        for line, module, name in _imports(path):
            target = f"{module}.{name}" if name and _is_submodule(module, name) else module
            yield me, target, f"{path.relative_to(ROOT)}:{line}"
    for path in _files("recipes"):
        me = _module_of(path, ROOT / "recipes", "piper_plugin.recipes")
        for line, module, name in _imports(path):
            target = f"{module}.{name}" if name and _is_submodule(module, name) else module
            yield me, target, f"{path.relative_to(ROOT)}:{line}"


def _is_submodule(module: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except (ImportError, ValueError):
        return False


def _layer_problems(me: str, target: str, where: str) -> list[str]:
    out = []
    if target.startswith("piper_plugin.adapters"):
        out.append(f"{where}: {me} imports an adapter ({target}); adapters register themselves")
    elif me != "piper_plugin" and _rank(target) > _rank(me):
        out.append(f"{where}: {me} (layer {_rank(me)}) imports {target} (layer {_rank(target)})")
    for layer, banned in FORBIDDEN.items():
        if me.startswith(layer + ".") and any(target.startswith(b) for b in banned):
            out.append(f"{where}: {me} imports {target}")
    return out


def test_layers_import_downward_only():
    problems = [p for me, target, where in _engine_imports() for p in _layer_problems(me, target, where)]
    assert not problems, "\n".join(problems)


def test_no_two_engine_modules_import_each_other():
    edges = {(me, target) for me, target, _ in _engine_imports()}
    both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges and e[0] != e[1]})
    assert not both, f"modules importing each other: {both}"


@pytest.mark.parametrize("me,source", [
    ("piper_plugin.ir.graph", "from piper_plugin.runtime.worker import Worker\n"),
    ("piper_plugin.scheduler.plan", "if True:\n    from piper_plugin.recipes import load\n"),
    ("piper_plugin.cli", "import piper_plugin.adapters.torchtitan.launch\n"),
])
def test_the_checks_catch_a_crossing_import(tmp_path, me, source):
    """Both checks are live: an upward import, an adapter import and a private name are reported."""
    path = tmp_path / "m.py"
    path.write_text(source)
    problems = [p for _, module, _ in _imports(path) for p in _layer_problems(me, module, "m.py")]
    assert problems, source
    path.write_text("from piper_plugin.runtime.executor import Executor\nfrom piper_plugin import _private\n")
    assert len(_problems(path, (), PUBLISHED)) == 2
