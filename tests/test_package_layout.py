"""The package's structure, as docs/design.md describes it: role folders whose imports flow one way, no import circle
(function-local and `TYPE_CHECKING` imports count), no private name imported from another module, no module over 500
lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_prefetch"

# Top to bottom: a module may import from its own layer and the layers below it, never from one above.
LAYERS = [
    {"__init__", "__main__", "cli", "demo"},
    {"dispatch", "preview", "stats", "layer_times"},
    {"loading"},
    {"lifecycle"},
    {"runtime"},
    {"planning"},
    {"host"},
    {"formats"},
    {"config", "interrupts", "alignment"},
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name, line) for every import of a package module, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if name == "hf_prefetch.__init__":
        package = "hf_prefetch"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("hf_prefetch"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in modules else (source, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("hf_prefetch.")]
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    role = parts[1] if len(parts) > 1 else "__init__"
    return next(index for index, layer in enumerate(LAYERS) if role in layer)


MODULES = _modules()
IMPORTS = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    assert all(_layer(name) is not None for name in MODULES)


def test_imports_flow_down_the_layers():
    upward = [
        f"{name}:{line} imports {target}"
        for name, imports in IMPORTS.items()
        for target, _, line in imports
        if target in MODULES and target != "hf_prefetch.__init__" and _layer(target) < _layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    edges = {
        name: {t for t, _, _ in imports if t in MODULES and t != name and t != "hf_prefetch.__init__"}
        for name, imports in IMPORTS.items()
    }
    visiting, done, circles = [], set(), []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            circles.append(visiting[visiting.index(name) :] + [name])
            return
        visiting.append(name)
        for target in sorted(edges[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_no_private_name_imported_from_another_module():
    private = [
        f"{name}:{line} imports {source}.{imported}"
        for name, imports in IMPORTS.items()
        for source, imported, line in imports
        if imported.startswith("_") and source != name
    ]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_500_lines(name):
    assert len(MODULES[name].read_text().splitlines()) <= 500
