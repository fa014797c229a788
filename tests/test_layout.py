"""The dependency rules and size limits of the code base, read from the source.

- ``compiler`` never imports ``server``;
- the runtime (``server.runtime``) never imports FastAPI, Starlette or uvicorn;
- no import cycle among project modules (imports inside functions count);
- only ``compiler.tvm`` imports TVM's compile side (the ONNX frontend, the
  Relax pipeline and passes, schedule rules, MetaSchedule) or onnxsim;
- no class over 250 lines, no module over 450 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("compiler", "server")
COMPILE_SIDE = (
    "onnxsim",
    "tvm.relax.frontend",
    "tvm.relax.transform",
    "tvm.relax.backend",
    "tvm.s_tir",
    "tvm.dlight",
    "tvm.meta_schedule",
    "tvm.driver",
    "tvm.transform",
)
# Attribute chains that reach the compile side without an import statement naming it.
COMPILE_SIDE_ATTRIBUTES = ("tvm.compile", "relax.transform", "relax.frontend", "relax.get_pipeline", "tvm.transform")
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn")
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def is_within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, absolute, at any depth of its code."""
    path = SOURCES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from package import submodule` imports the submodule.
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base)
    return found


def attribute_chains(module: str) -> set[str]:
    chains = set()
    for node in ast.walk(ast.parse(SOURCES[module].read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            chains.add(f"{node.value.id}.{node.attr}")
    return chains


def project_graph() -> dict[str, set[str]]:
    return {module: {i for i in imports_of(module) if i in SOURCES and i != module} for module in SOURCES}


def test_the_project_is_found():
    assert {"compiler.building.build", "compiler.tvm.build", "server.app", "server.runtime.service"} <= set(SOURCES)
    # The resolver sees relative imports, nested ones included.
    assert "compiler.tvm.build" in imports_of("compiler.building.build")
    assert "compiler.building.options" in imports_of("compiler.tvm.build")


def test_compiler_never_imports_server():
    offenders = {
        m: sorted(i for i in imports_of(m) if is_within(i, ["server"])) for m in SOURCES if m.startswith("compiler")
    }
    assert {m: i for m, i in offenders.items() if i} == {}


def test_runtime_never_imports_a_web_framework():
    runtime = [m for m in SOURCES if is_within(m, ["server.runtime"])]
    assert len(runtime) >= 10
    offenders = {m: sorted(i for i in imports_of(m) if is_within(i, WEB_FRAMEWORKS)) for m in runtime}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_only_compiler_tvm_imports_the_compile_side():
    offenders = {}
    for module in SOURCES:
        if is_within(module, ["compiler.tvm"]):
            continue
        bad = sorted(i for i in imports_of(module) if is_within(i, COMPILE_SIDE))
        bad += sorted(c for c in attribute_chains(module) if c in COMPILE_SIDE_ATTRIBUTES)
        if bad:
            offenders[module] = bad
    assert offenders == {}
    # ... and it does import them: the rule is not vacuous.
    assert any(is_within(i, COMPILE_SIDE) for m in SOURCES if is_within(m, ["compiler.tvm"]) for i in imports_of(m))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting, done = [], set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_no_import_cycle():
    assert find_cycle(project_graph()) is None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_size_limits(module):
    source = SOURCES[module].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"class {node.name} has {lines} lines"
