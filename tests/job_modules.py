"""What tests read from a job module's source: the config class its main validates --config with."""
import ast
from pathlib import Path


def config_model_name(module_path: Path) -> str:
    """Name of the config class a job module passes to job_main/load_job_config/load_config."""
    for node in ast.walk(ast.parse(module_path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "job_main", "load_job_config", "load_config") and node.args and isinstance(node.args[0], ast.Name):
            return node.args[0].id
    raise AssertionError(f"{module_path}: no job_main(<Model>, ...) or load_job_config(<Model>, ...) call")
