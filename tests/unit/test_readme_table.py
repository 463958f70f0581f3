"""Every module is one hop from the README: its folder's row in the README's folder table names it."""
import re

from tests.paths import REPO

FOLDERS = ("dspark", "pipelines", "jobs", "recipes")


def readme_rows() -> dict[str, str]:
    """folder -> the text of its row in the README's folder table."""
    rows = re.findall(r"^\| `([\w/]+)/` \| (.*) \|$", (REPO / "README.md").read_text(), re.M)
    return dict(rows)


def named_in(row: str) -> set[str]:
    """The words inside the row's `code spans` (`service` + `app`, `gpu_recipe` (+ `gpu_prepare`, ...))."""
    return set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", row))))


def test_every_module_is_named_in_its_folders_readme_row():
    rows, missing = readme_rows(), []
    for top in FOLDERS:
        for path in sorted((REPO / top).rglob("*.py")):
            folder = str(path.parent.relative_to(REPO))
            if path.name != "__init__.py" and path.stem not in named_in(rows.get(folder, "")):
                missing.append(str(path.relative_to(REPO)))
    assert not missing, f"name these modules in their folder's row of the README table: {missing}"


def test_the_stage_table_names_one_job_config_folder_and_existing_files_per_stage():
    """The README's stage table: each stage's job is jobs/<stage>.py with a `run` (serve: `deploy`), its configs folder
    exists, and every file it points to is there (a rename cannot leave the map behind)."""
    import importlib

    rows = re.findall(r"^\| (\w+) \| `jobs/(\w+)\.py` (.*) \|$", (REPO / "README.md").read_text(), re.M)
    assert {stage for stage, _, _ in rows} >= {"synthesize", "generate", "train", "calibrate", "evaluate", "drift",
                                               "retrain_data", "promote"}
    for stage, job, rest in rows:
        entry = "deploy" if stage == "serve" else "run"  # serve deploys and stays up instead of returning a result
        assert job == stage and callable(getattr(importlib.import_module(f"jobs.{stage}"), entry, None)), stage
        paths = re.findall(r"`((?:dspark|pipelines|configs)/[\w/.]*)`", rest)
        missing = [p for p in paths if not (REPO / p).exists()]
        assert paths and not missing, f"stage {stage}: {missing or 'no paths'}"
