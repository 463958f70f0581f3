"""`make test` runs the integration modules named in the Makefile's FAST_INTEGRATION: every module that
holds an integration test not marked slow must be named there, or CI would silently skip it.

The marks are read from the source (module `pytestmark` and each test's decorators, `SLOW = pytest.mark.slow`
style aliases resolved): a `pytest --collect-only` subprocess importing Ray, MLflow and the servers
took ~8 s of the unit suite."""
import ast
import re

from tests.paths import REPO


def _mark_names(node: ast.AST, aliases: dict[str, set[str]]) -> set[str]:
    """Mark names in a decorator / pytestmark expression: pytest.mark.x, pytest.mark.x(...), lists, aliases."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return set().union(*(_mark_names(e, aliases) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Call):
        return _mark_names(node.func, aliases)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
        return {node.attr}
    if isinstance(node, ast.Name):
        return aliases.get(node.id, set())
    return set()


def fast_integration_tests(path) -> list[str]:
    """Names of the tests in `path` marked integration and not slow."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, set[str]] = {}
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            marks = _mark_names(node.value, aliases)
            if node.targets[0].id == "pytestmark":
                module_marks |= marks
            elif marks:
                aliases[node.targets[0].id] = marks
    fast = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
            marks = module_marks.union(*(_mark_names(d, aliases) for d in node.decorator_list))
            if "integration" in marks and "slow" not in marks:
                fast.append(node.name)
    return fast


def test_mark_reader_sees_module_and_decorator_marks(tmp_path):
    source = tmp_path / "test_x.py"
    source.write_text("import pytest\nSLOW = pytest.mark.slow\npytestmark = [pytest.mark.integration]\n"
                      "def test_a(): pass\n@SLOW\ndef test_b(): pass\n@pytest.mark.timeout(9)\ndef test_c(): pass\n"
                      "def helper(): pass\n")
    assert fast_integration_tests(source) == ["test_a", "test_c"]


def test_every_fast_integration_module_runs_in_make_test():
    makefile = (REPO / "Makefile").read_text()
    block = re.search(r"^FAST_INTEGRATION := (.*?)\n\n", makefile, re.S | re.M).group(1)
    listed = set(re.findall(r"tests/integration/test_\w+\.py", block))
    fast = {str(p.relative_to(REPO)) for p in sorted((REPO / "tests/integration").glob("test_*.py"))
            if fast_integration_tests(p)}
    assert fast, "no integration test outside the slow tier found: the mark reader is broken"
    assert fast <= listed, f"add to FAST_INTEGRATION in the Makefile (or mark slow): {sorted(fast - listed)}"
