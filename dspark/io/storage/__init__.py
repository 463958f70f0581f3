"""Storage: one API for local paths and s3:// URIs, the rollout store and training-run directories.

One API for local paths and `s3://bucket/key` URIs; S3 goes through pyarrow.fs.

S3 settings come from the environment: AWS_ENDPOINT_URL (or DSPARK_S3_ENDPOINT), AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION (default us-east-1). With the local stack, `source .dspark/env.sh`
(or `os.environ.update(dspark.devstack.config.load_env())`) sets all of them.

A "directory" URI is a prefix: `list_files("s3://b/run1")` lists every object under `run1/`
(recursively), just as it lists every file under a local directory. Missing objects raise
FileNotFoundError; an unreachable endpoint, a missing bucket or refused credentials raise
StorageError with the fix. pyarrow emulates directories: a delete can leave an empty `dir/` marker
object behind; listings and `exists` count files only, so a marker alone is not "something in it".
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs
from tqdm.auto import tqdm

from dspark.settings import settings

log = logging.getLogger("dspark.io.storage")
S3_SCHEME = "s3://"
FILE, NOT_FOUND = pafs.FileType.File, pafs.FileType.NotFound
AUTH_ERRORS = ("ACCESS_DENIED", "SIGNATURE_DOES_NOT_MATCH", "INVALID_ACCESS_KEY_ID")  # pyarrow's names


class StorageError(RuntimeError):
    """The storage backend cannot be used (unreachable endpoint, missing bucket, bad credentials)."""


class StorageUnavailable(StorageError):
    """The S3 endpoint did not answer (connection refused, reset or timed out): worth retrying."""


TRANSIENT_ERRORS = ("NETWORK_CONNECTION", "SERVICE_UNAVAILABLE", "SLOW_DOWN", "INTERNAL_FAILURE")  # pyarrow's names


def retried(fn):
    """Retry `fn` while the S3 endpoint is unavailable, with exponential backoff (0.5 s doubling to 8 s) for
    up to DSPARK_S3_RETRY_S seconds, then raise its StorageUnavailable. Only the public calls are wrapped, and
    none calls another wrapped one (budgets never stack). Safe because every retried call is whole: an S3 put is all-or-nothing (an object appears only when its upload completes), a local write
    goes through a temp file, and a retry starts the call again from the beginning."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not any(is_s3(a) for a in args[:2] if isinstance(a, str)):
            return fn(*args, **kwargs)  # local paths: nothing to wait for
        budget = settings().s3_retry_s
        if budget <= 0:
            return fn(*args, **kwargs)
        import tenacity  # here, not at import: the GPU recipe's image has no tenacity and reads local paths

        for attempt in tenacity.Retrying(
                retry=tenacity.retry_if_exception_type(StorageUnavailable), reraise=True,
                stop=tenacity.stop_after_delay(budget), wait=tenacity.wait_exponential(multiplier=0.5, max=8),
                before_sleep=lambda state: log.warning(
                    "%s; retrying %s for up to %.0f s (DSPARK_S3_RETRY_S)", state.outcome.exception(),
                    fn.__name__, budget)):
            with attempt:
                return fn(*args, **kwargs)
    return call


# ---------------------------------------------------------------------------- URIs
def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith(S3_SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b")."""
    if not is_s3(uri):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket; write it as s3://BUCKET/KEY")
    return bucket, key


def join(uri: str | os.PathLike, *parts: str) -> str:
    """Append path parts to a local path or s3 URI (no duplicate slashes)."""
    uri = str(uri)
    if not is_s3(uri):
        return os.path.join(uri, *parts)
    pieces = [uri.rstrip("/")] + [p.strip("/") for p in parts if p.strip("/")]
    return "/".join(pieces)


# ---------------------------------------------------------------------------- S3 filesystem and errors
def s3_settings() -> dict:
    """Endpoint and credentials from the environment (endpoint None = AWS itself)."""
    env = settings()
    return {"endpoint": env.s3_endpoint_url, "key": env.aws_access_key_id, "secret": env.aws_secret_access_key,
            "region": env.aws_region}


def pyarrow_fs(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(pyarrow FileSystem, path inside it): what every S3 call here uses, and what Ray Data's
    `filesystem=` / `paths=` arguments take."""
    uri = str(uri)
    if not is_s3(uri):
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    s3 = s3_settings()
    bucket, key = split_s3(uri)
    return _s3_filesystem(s3["endpoint"], s3["key"], s3["secret"], s3["region"]), f"{bucket}/{key}".rstrip("/")


@functools.lru_cache(maxsize=8)
def _s3_filesystem(endpoint: str | None, key: str | None, secret: str | None, region: str) -> pafs.S3FileSystem:
    """One S3FileSystem per settings (thread-safe). The endpoint is passed explicitly (pyarrow does
    not honour AWS_ENDPOINT_URL everywhere); no keys = the AWS default credential chain."""
    options = {"region": region} | ({"access_key": key, "secret_key": secret} if key and secret else {})
    if endpoint:
        parsed = urlparse(endpoint)
        options |= {"endpoint_override": parsed.netloc or parsed.path, "scheme": parsed.scheme or "https",
                    "force_virtual_addressing": False}
    return pafs.S3FileSystem(**options)


def _endpoint_hint() -> str:
    return ("start the local stack with `dspark stack up` and `source .dspark/env.sh`, "
            "or set AWS_ENDPOINT_URL/AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")


@contextmanager
def _s3_errors(uri: str):
    """Translate pyarrow's S3 errors: missing object -> FileNotFoundError, the rest -> StorageError.
    OSErrors with an errno other than ENOENT are local (disk full, permissions) and pass unchanged."""
    try:
        yield
    except FileNotFoundError:
        _require_bucket(uri)  # pyarrow reports a missing bucket as a missing path
        raise FileNotFoundError(f"no such object: {uri}") from None
    except OSError as err:
        if err.errno is not None:
            raise
        raise _storage_error(uri, str(err)) from None


def aws_error_code(message: str) -> str:
    """The AWS SDK's error name in a pyarrow S3 error message ("... AWS Error ACCESS_DENIED during ..."), or ""."""
    match = re.search(r"AWS Error (\w+)", message)
    return match.group(1) if match else ""


def _storage_error(uri: str, message: str) -> StorageError:
    code = aws_error_code(message)
    if code in TRANSIENT_ERRORS:
        return StorageUnavailable(f"S3 endpoint {_endpoint()} is unreachable for {uri} ({code}); {_endpoint_hint()}")
    if code == "NO_SUCH_BUCKET":
        return _no_bucket(uri)
    if code in AUTH_ERRORS and not s3_settings()["key"]:
        return StorageError(f"no S3 credentials for {uri}; {_endpoint_hint()}")
    if code in AUTH_ERRORS:
        return StorageError(f"S3 refused access to {uri} ({code}); check AWS_ACCESS_KEY_ID/"
                            f"AWS_SECRET_ACCESS_KEY ({_endpoint_hint()})")
    return StorageError(f"S3 request for {uri} failed ({' '.join(message.split())}); {_endpoint_hint()}")


def _endpoint() -> str:
    return s3_settings()["endpoint"] or "AWS"


def _no_bucket(uri: str) -> StorageError:
    return StorageError(f"bucket of {uri} does not exist at {_endpoint()}; "
                        f"create it or use s3://dspark/... with the local stack")


def _require_bucket(uri: str) -> None:
    """StorageError when the bucket of `uri` does not exist."""
    fs, _ = pyarrow_fs(uri)
    with _s3_errors(uri):
        missing = fs.get_file_info(split_s3(uri)[0]).type == NOT_FOUND
    if missing:
        raise _no_bucket(uri)


# ---------------------------------------------------------------------------- bytes / text
@retried
def read_bytes(uri: str | os.PathLike) -> bytes:
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).read_bytes()
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri), fs.open_input_stream(path) as stream:
        return stream.read()


@retried
def write_bytes(uri: str | os.PathLike, data: bytes) -> None:
    """Write a whole object/file (local writes are atomic: temp file + rename)."""
    uri = str(uri)
    if not is_s3(uri):
        with _atomic_path(Path(uri)) as tmp:
            Path(tmp).write_bytes(data)
        return
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri), fs.open_output_stream(path) as stream:
        stream.write(data)


def read_text(uri: str | os.PathLike) -> str:
    return read_bytes(uri).decode("utf-8")


def write_text(uri: str | os.PathLike, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


@contextmanager
def _atomic_path(path: Path):
    """A temp file beside `path` that replaces `path` when the block succeeds (removed when it fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- listing
@retried
def exists(uri: str | os.PathLike) -> bool:
    """True for an existing file/object, or a directory/prefix with something in it."""
    uri = str(uri)
    if not is_s3(uri):
        return os.path.exists(uri)
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri):
        kind = fs.get_file_info(path).type
    if kind == NOT_FOUND:
        _require_bucket(uri)
        return False
    return kind == FILE or not split_s3(uri)[1].strip("/") or bool(_s3_files(uri))


def _s3_files(uri: str) -> dict[str, pafs.FileInfo]:
    """URI -> FileInfo (size, mtime) of the object at `uri` and of every object below it as a prefix."""
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri):
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        if split_s3(uri)[1] and not uri.endswith("/"):
            infos.append(fs.get_file_info(path))
    files = {S3_SCHEME + info.path: info for info in infos if info.type == FILE}
    if not files:
        _require_bucket(uri)
    return files


@retried
def list_files(uri_prefix: str | os.PathLike) -> list[str]:
    """Every file under a directory/prefix, recursively, as full URIs (sorted). A file URI lists
    itself; a missing one gives []."""
    uri = str(uri_prefix)
    if not is_s3(uri):
        root = Path(uri)
        if root.is_file():
            return [str(root)]
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    return sorted(_s3_files(uri))


@retried
def delete(uri: str | os.PathLike, missing_ok: bool = False) -> None:
    """Delete a file/object, or a whole directory/prefix."""
    uri = str(uri)
    if not is_s3(uri):
        path = Path(uri)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        elif not missing_ok:
            raise FileNotFoundError(f"no such file or directory: {uri}")
        return
    targets = sorted(_s3_files(uri))  # (delete is retried as a whole: not list_files, which retries too)
    if not targets and not missing_ok:
        raise FileNotFoundError(f"no such object or prefix: {uri}")
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri):
        if uri in targets:
            fs.delete_file(path)
        if any(target != uri for target in targets):
            fs.delete_dir_contents(path, missing_dir_ok=True)  # batched DeleteObjects


# ---------------------------------------------------------------------------- files and directories
def upload_dir(local_dir: str | os.PathLike, uri: str | os.PathLike) -> list[str]:
    """Copy every file under `local_dir` to `uri` (keeping relative paths); returns written URIs."""
    root, uri = Path(local_dir), str(uri)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    written = []
    for path in tqdm(files, desc=f"upload {uri}", unit="file", disable=len(files) < 10 or None):
        target = join(uri, path.relative_to(root).as_posix())
        put_file(path, target)
        written.append(target)
    return written


@retried
def put_file(local_path: str | os.PathLike, uri: str | os.PathLike) -> None:
    """Copy one local file to a path or URI (pyarrow uploads large files in parts)."""
    uri = str(uri)
    if not is_s3(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local_path, uri)
        return
    os.stat(local_path)  # a missing local file raises here, not as a missing S3 object
    fs, path = pyarrow_fs(uri)
    with _s3_errors(uri):
        pafs.copy_files(os.path.abspath(local_path), path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)


@retried
def get_file(uri: str | os.PathLike, local_path: str | os.PathLike) -> None:
    """Copy one file/object to a local path (atomically: temp file + rename)."""
    uri = str(uri)
    with _atomic_path(Path(local_path)) as tmp:
        if not is_s3(uri):
            shutil.copyfile(uri, tmp)
            return
        fs, path = pyarrow_fs(uri)
        with _s3_errors(uri):
            pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())


def _relative(file_uri: str, dir_uri: str) -> str:
    rel = file_uri[len(dir_uri.rstrip("/")):].lstrip("/")
    return rel or os.path.basename(file_uri)


# ---------------------------------------------------------------------------- local cache
def cache_dir() -> Path:
    root = settings().cache
    return root / "s3"


def local_copy(uri: str | os.PathLike) -> str:
    """A local path holding `uri`: the path itself when local; for S3 a cached download under
    $DSPARK_CACHE/s3/<endpoint>/<bucket>/<key> (a file or a directory), refreshed only for objects
    whose size or modification time changed. Safe to call from many processes at once (file lock
    per URI)."""
    uri = str(uri)
    if not is_s3(uri):
        if not os.path.exists(uri):
            raise FileNotFoundError(f"no such file or directory: {uri}")
        return uri
    bucket, key = split_s3(uri)
    endpoint = urlparse(s3_settings()["endpoint"] or "https://aws").netloc.replace(":", "_")
    target = cache_dir() / endpoint / bucket / key.strip("/")
    objects = _s3_files(uri)
    if not objects:
        raise FileNotFoundError(f"no such object or prefix: {uri}")
    with _file_lock(target.with_name(target.name + ".lock")):
        manifest_path = target.with_name(target.name + ".manifest.json")
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        is_single_file = list(objects) == [uri]
        for source, info in objects.items():
            local = target if is_single_file else target / _relative(source, uri)
            version = f"{info.size}:{info.mtime_ns}"  # an object rewritten in place gets a new mtime
            if manifest.get(source) != version or not local.exists():
                get_file(source, local)
                manifest[source] = version
        write_bytes(manifest_path, json.dumps(manifest).encode())
    return str(target)


@contextmanager
def _file_lock(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------- checks and digests
def check_writable(uri: str | os.PathLike) -> None:
    """Fail fast (StorageError, one line with the fix) if `uri` cannot be written: writes and
    deletes a small probe object/file below it."""
    uri = str(uri)
    probe = join(uri, f".dspark-write-check-{uuid.uuid4().hex[:12]}")
    if not is_s3(uri):
        try:
            write_bytes(probe, b"ok")
            os.unlink(probe)
        except OSError as err:
            raise StorageError(f"cannot write to {uri} ({err.strerror or err}); choose a writable directory") from None
        return
    try:
        write_bytes.__wrapped__(probe, b"ok")  # not retried: a wrong endpoint fails the job at once
        delete(probe)
    except (StorageError, FileNotFoundError) as err:
        raise StorageError(str(err).replace(probe, uri)) from None


def content_hash(uri: str | os.PathLike) -> str:
    """sha256 of a file's/object's bytes (for manifests and tests)."""
    return hashlib.sha256(read_bytes(uri)).hexdigest()


def dataset_digest(uri: str) -> str:
    """Content digest of a file, or of every file under a directory/prefix: sha256 over each file's
    path relative to `uri` and the sha256 of its bytes (so renames and edits both change it).
    Reads the data: give large datasets' digest explicitly (e.g. from their manifest)."""
    files = list_files(uri)
    if not files:
        raise FileNotFoundError(f"no file at {uri}")
    total = hashlib.sha256()
    base = uri.rstrip("/")
    for file in files:
        relative = file[len(base):].lstrip("/") if file.startswith(base) else file
        total.update(f"{relative}\0{content_hash(file)}\n".encode())
    return total.hexdigest()[:32]
