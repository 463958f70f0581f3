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
    storage.download_dir(str(tmp_path / "dst"), tmp_path / "back")
    assert storage.read_text(tmp_path / "back" / "sub" / "y.txt") == "sub/y.txt"
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
    with pytest.raises(storage.StorageError, match="unreachable"):
        storage.read_bytes("s3://dspark/x/y")
