"""dspark.io.storage on local paths (unit) and on the local stack's S3 (integration, `local_stack`)."""

from __future__ import annotations

import os
import time
import uuid

from pathlib import Path

import pytest

from dspark.io import storage



@pytest.fixture
def s3_root(local_stack):
    """A fresh prefix in the stack's data bucket, removed afterwards."""
    root = f"s3://{local_stack.env['DSPARK_S3_BUCKET']}/tests/{uuid.uuid4().hex[:10]}"
    yield root
    storage.delete(root, missing_ok=True)



@pytest.mark.integration
def test_s3_round_trip_exists_and_missing(s3_root):
    uri = storage.join(s3_root, "a", "b.bin")
    storage.write_bytes(uri, b"\x00payload")
    assert storage.read_bytes(uri) == b"\x00payload"
    storage.write_text(storage.join(s3_root, "t.txt"), "héllo")
    assert storage.read_text(storage.join(s3_root, "t.txt")) == "héllo"
    assert storage.exists(uri) and storage.exists(storage.join(s3_root, "a"))
    assert not storage.exists(storage.join(s3_root, "nope"))
    with pytest.raises(FileNotFoundError, match="no such object"):
        storage.read_bytes(storage.join(s3_root, "nope"))



@pytest.mark.integration
def test_s3_list_is_recursive_with_directory_semantics(s3_root):
    for rel in ("run/x", "run/sub/y", "run2/z"):
        storage.write_text(storage.join(s3_root, rel), rel)
    run = storage.join(s3_root, "run")
    assert storage.list_files(run) == [f"{run}/sub/y", f"{run}/x"]  # run2/ is not under run/
    assert storage.list_files(run + "/") == [f"{run}/sub/y", f"{run}/x"]
    assert storage.list_files(f"{run}/x") == [f"{run}/x"]
    assert storage.list_files(storage.join(s3_root, "none")) == []
    storage.delete(run)
    assert not storage.exists(run)  # a directory marker pyarrow may leave behind is not "something in it"
    assert storage.list_files(s3_root) == [storage.join(s3_root, "run2/z")]
    with pytest.raises(FileNotFoundError):
        storage.delete(run)



@pytest.mark.integration
def test_s3_upload_dir_and_local_copy_cache(s3_root, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "ckpt"
    storage.write_text(src / "config.json", "{}")
    storage.write_bytes(src / "weights" / "model.bin", os.urandom(6 * 1024 * 1024))  # multipart-sized
    written = storage.upload_dir(src, storage.join(s3_root, "ckpt"))
    assert len(written) == 2
    assert storage.read_bytes(storage.join(s3_root, "ckpt", "weights", "model.bin")) == (
        src / "weights" / "model.bin").read_bytes()

    cached = Path(storage.local_copy(storage.join(s3_root, "ckpt")))
    assert cached.is_dir() and str(cached).startswith(str(tmp_path / "cache" / "s3"))
    assert (cached / "config.json").read_text() == "{}"
    # a changed object is refreshed, an unchanged one is not rewritten
    untouched_mtime = (cached / "weights" / "model.bin").stat().st_mtime_ns
    storage.write_text(storage.join(s3_root, "ckpt", "config.json"), '{"v": 2}')
    assert Path(storage.local_copy(storage.join(s3_root, "ckpt"))) == cached
    assert (cached / "config.json").read_text() == '{"v": 2}'
    assert (cached / "weights" / "model.bin").stat().st_mtime_ns == untouched_mtime
    time.sleep(1.1)  # S3 modification times have 1 s resolution
    storage.write_text(storage.join(s3_root, "ckpt", "config.json"), '{"v": 3}')  # same size, newer mtime
    assert (Path(storage.local_copy(storage.join(s3_root, "ckpt"))) / "config.json").read_text() == '{"v": 3}'
    single = storage.local_copy(storage.join(s3_root, "ckpt", "config.json"))
    assert Path(single).read_text() == '{"v": 3}'
    with pytest.raises(FileNotFoundError):
        storage.local_copy(storage.join(s3_root, "missing"))



@pytest.mark.integration
def test_s3_pyarrow_fs_writes_and_reads_parquet(s3_root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = storage.pyarrow_fs(storage.join(s3_root, "table.parquet"))
    assert not path.startswith("s3://")
    table = pa.table({"ids": [1, 2, 3], "text": ["a", "b", "c"]})
    pq.write_table(table, path, filesystem=fs)
    assert storage.exists(storage.join(s3_root, "table.parquet"))
    assert pq.read_table(path, filesystem=fs).equals(table)



@pytest.mark.integration
def test_s3_check_writable_and_missing_bucket(local_stack):
    storage.check_writable("s3://dspark/tests/writable")
    assert storage.list_files("s3://dspark/tests/writable") == []  # probe removed
    with pytest.raises(storage.StorageError, match="does not exist"):
        storage.check_writable("s3://no-such-bucket-dspark/x")
    with pytest.raises(storage.StorageError, match="does not exist"):  # not FileNotFoundError: the bucket is missing
        storage.read_bytes("s3://no-such-bucket-dspark/x")



@pytest.mark.integration
def test_s3_wrong_credentials_is_one_clear_error(local_stack, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(storage.StorageError, match="refused access.*AWS_SECRET_ACCESS_KEY"):
        storage.read_bytes("s3://dspark/anything")
