"""jobs.common.job_main: every job's main — config, run, one JSON line; an error the user can act on is one
stderr line and exit status 2, anything else keeps its traceback."""
from __future__ import annotations

import json

import pytest
from pydantic import Field

from dspark.config import StrictModel
from dspark.io.storage import StorageError
from jobs.common import job_main


class _Cfg(StrictModel):
    n: int = Field(1, description="a number")


def _config(tmp_path, text: str = "n: 3\n") -> list[str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_the_summary_is_one_json_line_and_status_0(tmp_path, capsys):
    assert job_main(_Cfg, lambda cfg: cfg.n * 2, _config(tmp_path), "d", summary=lambda cfg, r: {"n": cfg.n, "r": r}) == 0
    assert json.loads(capsys.readouterr().out.strip()) == {"n": 3, "r": 6}


@pytest.mark.parametrize("err", [ValueError("bad row 7"), FileNotFoundError("no such file: x"),
                                 StorageError("s3://b/k: unreachable"), TimeoutError("not healthy")])
def test_an_actionable_error_is_one_line_and_status_2(tmp_path, capsys, err):
    def run(cfg):
        raise err

    assert job_main(_Cfg, run, _config(tmp_path), "d") == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: {err}" and captured.out == ""


def test_a_bug_keeps_its_traceback_and_a_bad_config_exits_naming_the_key(tmp_path):
    def run(cfg):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        job_main(_Cfg, run, _config(tmp_path), "d")
    with pytest.raises(SystemExit, match="nope"):
        job_main(_Cfg, lambda cfg: None, _config(tmp_path, "nope: 1\n"), "d")
