"""The dependency directions of the layout, checked over the import graph of every project module
(imports at any depth, function-local ones included):

- the pure library packages (drafters, decoding, training, data, eval, models) and dspark/config.py
  never import dspark.io — io may import them, not the reverse (KNOWN_IO_DEBT lists what is left to
  move; it may only shrink);
- nothing imports jobs/ but jobs/ itself; benchmarks/ and recipes/ import no jobs;
- mlflow only in dspark/io/tracking/__init__.py; ray only in pipelines/, jobs/, benchmarks/ and
  dspark/serve/deployment.py (recipes run without Ray);
- every pipelines/ module is Ray code (Ray-free code belongs in the library);
- no import loops between modules.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGES = ("dspark", "pipelines", "jobs", "benchmarks", "recipes")
PURE = ("drafters", "decoding", "training", "data", "eval", "models")
KNOWN_IO_DEBT: dict[str, str] = {}  # module -> why it still reads object storage itself (none left: the
# edges pass dspark.io.storage in — prompts' `files`, load_target's `local_copy` — and the rollout store is in io)
RAY_ALLOWED = ("pipelines.", "jobs.", "benchmarks.", "dspark.serve.deployment")


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, module: str) -> set[str]:
    """Absolute names imported anywhere in the file (relative imports resolved against `module`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(p, m) for m, p in modules.items()}


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_pure_packages_never_import_io(graph):
    pure = [m for m in graph if m == "dspark.config" or any(_in(m, f"dspark.{p}") for p in PURE)]
    offenders = {m for m in pure if any(_in(n, "dspark.io") for n in graph[m])}
    assert offenders <= set(KNOWN_IO_DEBT), f"new io imports in the pure layers: {sorted(offenders - set(KNOWN_IO_DEBT))}"
    assert set(KNOWN_IO_DEBT) <= offenders, f"fixed, drop from KNOWN_IO_DEBT: {sorted(set(KNOWN_IO_DEBT) - offenders)}"


def test_nothing_outside_jobs_imports_jobs(graph):
    offenders = {m: sorted(n for n in imports if _in(n, "jobs")) for m, imports in graph.items()
                 if not _in(m, "jobs") and any(_in(n, "jobs") for n in imports)}
    assert not offenders


def test_mlflow_and_ray_only_at_their_edges(graph):
    mlflow = {m for m, imports in graph.items() if any(_in(n, "mlflow") for n in imports)}
    assert mlflow <= {"dspark.io.tracking"}, sorted(mlflow)
    ray = {m for m, imports in graph.items() if any(_in(n, "ray") for n in imports)}
    assert {m for m in ray if not m.startswith(RAY_ALLOWED)} == set()


def test_every_pipelines_module_is_ray_code(graph):
    pipelines = {m for m in graph if m.startswith("pipelines.")}
    ray = {m for m in pipelines if any(_in(n, "ray") for n in graph[m])}
    changed = True
    while changed:  # a module building on Ray code of pipelines/ counts as Ray code
        grown = {m for m in pipelines - ray if any(n in ray or n.rsplit(".", 1)[0] in ray for n in graph[m])}
        changed, ray = bool(grown), ray | grown
    assert pipelines - ray == set(), "Ray-free code belongs in dspark/"


def test_no_import_loops(graph):
    edges = {m: {n if n in graph else n.rsplit(".", 1)[0] for n in imports} & set(graph) - {m}
             for m, imports in graph.items()}
    edges = {m: {n for n in targets if not m.startswith(n + ".")} for m, targets in edges.items()}  # package inits
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                raise AssertionError("import loop: " + " -> ".join(trail[trail.index(n):] + [n]))
            if n not in state:
                visit(n, trail + [n])
        state[m] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
