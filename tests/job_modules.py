"""What tests read from a job module's source: the config class its main validates --config with."""
import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def config_model_name(module_path: Path) -> str:
    """Name of the config class a job module passes to job_main/load_job_config/load_config."""
    for node in ast.walk(ast.parse(module_path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "job_main", "load_job_config", "load_config") and node.args and isinstance(node.args[0], ast.Name):
            return node.args[0].id
    raise AssertionError(f"{module_path}: no job_main(<Model>, ...) or load_job_config(<Model>, ...) call")


def job_config_model(module: str) -> type:
    """The config class `module` (e.g. "jobs.train" or "train") validates its --config with."""
    module = module if module.startswith("jobs.") else f"jobs.{module}"
    path = REPO / (module.replace(".", "/") + ".py")
    return getattr(importlib.import_module(module), config_model_name(path))
