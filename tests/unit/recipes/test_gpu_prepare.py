"""The working tree travels with every device call: it must leave room for the target in three calls."""
from recipes import gpu_prepare
from recipes.gpu_prepare import MiB, WORKING_TREE_BUDGET, travelling_files, working_tree_problems
from tests.paths import REPO


def test_this_checkout_fits_the_device_calls(monkeypatch):
    monkeypatch.chdir(REPO)
    files = travelling_files()
    assert files and working_tree_problems(files) == [], working_tree_problems(files)


def test_an_oversized_tree_is_refused_naming_its_largest_files(tmp_path, monkeypatch):
    small, big = tmp_path / "small.txt", tmp_path / "drafter.safetensors"
    small.write_bytes(b"x" * 10)
    big.write_bytes(b"\0" * (WORKING_TREE_BUDGET + MiB))
    problems = working_tree_problems([small, big])
    assert len(problems) == 1 and "drafter.safetensors" in problems[0] and "> 28 MiB" in problems[0]
    monkeypatch.setattr(gpu_prepare, "travelling_files", lambda: [small, big])
    monkeypatch.setattr(gpu_prepare, "download_wheels", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert gpu_prepare.main() == 1  # stops before downloading or splitting anything
