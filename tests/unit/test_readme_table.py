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
