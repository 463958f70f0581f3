"""dspark.io.storage on local paths (unit) and on the local stack's S3 (integration, `local_stack`)."""

from __future__ import annotations


import socket



import pytest

from dspark.io import storage



def test_local_bytes_text_exists_and_missing(tmp_path):
    target = tmp_path / "a" / "b.bin"
    storage.write_bytes(target, b"\x00\x01")
    assert storage.read_bytes(target) == b"\x00\x01"
    storage.write_text(str(tmp_path / "t.txt"), "héllo")
    assert storage.read_text(str(tmp_path / "t.txt")) == "héllo"
    assert storage.exists(target) and storage.exists(tmp_path / "a")
    assert not storage.exists(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(tmp_path / "nope")
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp files left



def test_local_list_delete_and_dirs(tmp_path):
    src = tmp_path / "src"
    for rel in ("x.txt", "sub/y.txt", "sub/deeper/z.txt"):
        storage.write_text(src / rel, rel)
    assert storage.list_files(src) == sorted(str(src / r) for r in ("x.txt", "sub/y.txt", "sub/deeper/z.txt"))
    assert storage.list_files(src / "x.txt") == [str(src / "x.txt")]
    assert storage.list_files(tmp_path / "missing") == []
    copied = storage.upload_dir(src, tmp_path / "dst")
    assert len(copied) == 3 and storage.read_text(tmp_path / "dst" / "sub" / "deeper" / "z.txt") == "sub/deeper/z.txt"
    assert storage.read_text(tmp_path / "dst" / "sub" / "y.txt") == "sub/y.txt"
    storage.delete(src / "x.txt")
    storage.delete(src / "sub")
    assert storage.list_files(src) == []
    with pytest.raises(FileNotFoundError):
        storage.delete(src / "x.txt")
    storage.delete(src / "x.txt", missing_ok=True)
    with pytest.raises(FileNotFoundError):
        storage.upload_dir(tmp_path / "missing", tmp_path / "dst2")



def test_join_and_uri_parsing():
    assert storage.join("s3://b/run/", "/ckpt/", "step_1") == "s3://b/run/ckpt/step_1"
    assert storage.join("s3://b", "k") == "s3://b/k"
    assert storage.join("/tmp/x", "y", "z") == "/tmp/x/y/z"
    assert storage.split_s3("s3://bucket/a/b") == ("bucket", "a/b")
    assert storage.is_s3("s3://b/k") and not storage.is_s3("/s3/b")
    with pytest.raises(ValueError, match="no bucket"):
        storage.split_s3("s3:///key")



def test_local_copy_and_pyarrow_fs_on_local_paths(tmp_path):
    import pyarrow.fs as pafs

    storage.write_text(tmp_path / "f.txt", "x")
    assert storage.local_copy(tmp_path / "f.txt") == str(tmp_path / "f.txt")
    with pytest.raises(FileNotFoundError):
        storage.local_copy(tmp_path / "missing")
    fs, path = storage.pyarrow_fs(tmp_path / "f.txt")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "f.txt")
    with fs.open_input_stream(path) as stream:
        assert stream.read() == b"x"



def test_check_writable_local(tmp_path):
    storage.check_writable(tmp_path / "new" / "dir")
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # probe removed
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(storage.StorageError, match="cannot write to"):
        storage.check_writable(blocker / "sub")



def test_unreachable_endpoint_is_one_clear_error(monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with pytest.raises(storage.StorageError, match=rf"127.0.0.1:{port} is unreachable.*s3://dspark/x.*dspark stack up"):
        storage.check_writable("s3://dspark/x")
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "0.2")  # retried briefly, then the same clear error
    with pytest.raises(storage.StorageUnavailable, match="unreachable"):
        storage.read_bytes("s3://dspark/x/y")


class FlakyStore:
    """A pyarrow filesystem stand-in whose first `failures` writes fail as an unreachable S3 endpoint does."""

    def __init__(self, root, failures: int):
        import pyarrow.fs as pafs

        self.local, self.root, self.failures, self.calls = pafs.LocalFileSystem(), root, failures, 0

    def open_output_stream(self, path):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("When uploading: AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7")
        return self.local.open_output_stream(str(self.root / path))


def test_store_down_writes_are_retried_until_the_store_returns(tmp_path, monkeypatch, caplog):
    store = FlakyStore(tmp_path, failures=2)
    monkeypatch.setattr(storage, "pyarrow_fs", lambda uri: (store, storage.split_s3(str(uri))[1].replace("/", "_")))
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "30")
    with caplog.at_level("WARNING", logger="dspark.io.storage"):
        storage.write_bytes("s3://dspark/rollouts/shard-0.parquet", b"rows")
    assert store.calls == 3 and (tmp_path / "rollouts_shard-0.parquet").read_bytes() == b"rows"
    assert sum("retrying write_bytes" in r.message for r in caplog.records) == 2


def test_store_down_for_longer_than_the_budget_fails_the_write_cleanly(tmp_path, monkeypatch):
    store = FlakyStore(tmp_path, failures=10**6)
    monkeypatch.setattr(storage, "pyarrow_fs", lambda uri: (store, "shard.parquet"))
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "1")
    with pytest.raises(storage.StorageUnavailable, match="NETWORK_CONNECTION"):
        storage.write_bytes("s3://dspark/rollouts/shard.parquet", b"rows")
    assert store.calls >= 2 and not (tmp_path / "shard.parquet").exists()  # nothing half-written
    monkeypatch.setenv("DSPARK_S3_RETRY_S", "0")
    calls = store.calls
    with pytest.raises(storage.StorageUnavailable):
        storage.write_bytes("s3://dspark/rollouts/shard.parquet", b"rows")
    assert store.calls == calls + 1  # 0: no retry
