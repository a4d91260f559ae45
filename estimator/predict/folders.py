"""A saved Hugging Face folder at a remote URL (s3://, abfss://, gs://), read where its model is built, not on the
driver: a TorchModel loaded from such a URL holds a handle (estimator.core.handle) whose factory is a
`RemoteFolder`, and transform sends that, not the weights. Each machine that builds the model copies the folder
once to its local disk (`local_copy`, under the temporary folder, shared by its processes) and loads it with the
class's own from_pretrained. The driver's skeleton (its parameters on the meta device) needs the folder's shapes
only: its copy holds the config and each safetensors file's header, the rest of the file left a hole (a sparse
file: no byte of the weights read or stored). torch and fsspec only, no pyspark: executors unpickle this."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import posixpath
import shutil
import struct
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Tuple

FOLDERS = "spark-torch-estimator-folders"  # under the temporary folder of each machine that builds a model
WEIGHT_FILES = ".safetensors"
# what a listing gives of a file's version besides its size, by the file systems' names for it
VERSION_FIELDS = ("ETag", "etag", "mtime", "LastModified", "last_modified", "modificationTime", "created")


def class_named(name: str) -> Any:
    """The object at 'module:qualified.name'."""
    module, _, qualname = name.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def folder_key(fs: Any, folder: str) -> str:
    """What tells one version of the folder from another: its files' names, sizes and versions (an object
    store's ETag, a file's modification time), as its file system lists them."""
    found = fs.find(folder, detail=True)
    files: List[Tuple[str, Any, str]] = []
    for path, info in sorted(found.items()):
        version = next((str(info[k]) for k in VERSION_FIELDS if info.get(k) is not None), "")
        files.append((posixpath.relpath(path, folder), info.get("size"), version))
    return hashlib.sha256(repr(files).encode()).hexdigest()


@dataclass(frozen=True)
class RemoteFolder:
    """`from_pretrained` of the Hugging Face folder at `url` by the class named `class_name` ('module:Class');
    `key`: the folder's version (folder_key), so that a folder saved over is another model for the executors'
    cache; `fs`: the file system it was found on, whose storage options travel with it as a Store's do to the
    ranks (None: made from the URL where it is called, with the environment's or fsspec's configured
    credentials). Called with device_map='meta' (a skeleton), it reads the config and the weights' headers."""

    url: str
    class_name: str
    key: str
    fs: Any = None
    pretrained = True  # a from_pretrained: estimator.core.recipe builds its skeleton with device_map='meta'

    def __call__(self, **kwargs: Any) -> Any:
        fs, folder = self.located()
        local = local_copy(fs, folder, self.key, weights=kwargs.get("device_map") != "meta")
        return class_named(self.class_name).from_pretrained(local, **kwargs)

    def located(self) -> Tuple[Any, str]:
        """(the file system, the folder's path on it)."""
        if self.fs is None:
            from fsspec.core import url_to_fs

            return url_to_fs(self.url)
        return self.fs, self.fs._strip_protocol(self.url)

    def __repr__(self) -> str:  # no storage option (a credential) in a message
        return f"RemoteFolder({self.url!r}, {self.class_name!r})"

    def without_credentials(self) -> "RemoteFolder":
        """The same folder, its file system made again from the URL where it is called: what a saved model
        keeps (no storage option written into a file)."""
        return replace(self, fs=None)


def local_copy(fs: Any, folder: str, key: str, weights: bool = True) -> str:
    """A local folder with `folder`'s files (its version `key`), copied once a machine: the first process to
    ask copies it into a temporary folder and renames it into place, under a lock; the others wait and find it.
    `weights` False: each safetensors file only up to its header, the rest a hole (what a skeleton reads). A
    new version's copy removes the copies of the folder's earlier versions (their processes keep what they
    read: a file removed stays readable while open or mapped)."""
    root = os.path.join(tempfile.gettempdir(), FOLDERS)
    place = hashlib.sha256(fs.unstrip_protocol(folder).encode()).hexdigest()[:16]
    name = f"{place}-{hashlib.sha256(key.encode()).hexdigest()[:16]}" + ("" if weights else "-shapes")
    target = os.path.join(root, name)
    if os.path.isdir(target):
        return target
    os.makedirs(root, exist_ok=True)
    with _locked(target + ".lock"):
        if os.path.isdir(target):  # another process copied it while this one waited
            return target
        part = tempfile.mkdtemp(prefix=os.path.basename(target) + ".part-", dir=root)
        try:
            get_folder(fs, folder, part, None if weights else header_only)
            try:
                os.rename(part, target)
            except OSError:  # no lock on this platform, and another process's copy came first
                if not os.path.isdir(target):
                    raise
                shutil.rmtree(part, ignore_errors=True)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
    for other in os.listdir(root):  # the folder's earlier versions, of the same kind (weights or shapes)
        earlier = os.path.join(root, other)
        same_kind = other.endswith("-shapes") == name.endswith("-shapes")
        if (other.startswith(place + "-") and other != name and same_kind and ".part-" not in other
                and os.path.isdir(earlier)):
            shutil.rmtree(earlier, ignore_errors=True)
            try:
                os.remove(earlier + ".lock")
            except OSError:
                pass
    return target


def get_folder(fs: Any, remote: str, local: str, weights: Any = None) -> None:
    """Every file under `remote` to the same relative path under `local`; `weights`: how a safetensors file is
    copied instead (header_only), where given."""
    for path in fs.find(remote):
        target = os.path.join(local, *posixpath.relpath(path, remote).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if weights is not None and path.endswith(WEIGHT_FILES):
            weights(fs, path, target)
        else:
            fs.get_file(path, target)


def header_only(fs: Any, path: str, local: str) -> None:
    """The safetensors file at `path` as a local file of its size holding its header only (the tensors' names,
    dtypes, shapes and offsets), the tensors' bytes a hole that reads as zeros and takes no disk."""
    with fs.open(path, "rb") as remote:
        head = remote.read(8)
        (length,) = struct.unpack("<Q", head)
        header = remote.read(length)
    tensors: Dict[str, Any] = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    with open(local, "wb") as out:
        out.write(head + header)
        out.truncate(8 + length + end)


class _locked:
    """An exclusive lock on a file (fcntl's; none where the platform has no fcntl: then two processes may copy
    the same folder, and the second rename fails harmlessly into the first's copy)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> "_locked":
        self.handle = open(self.path, "a")
        try:
            import fcntl

            fcntl.flock(self.handle, fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.close()  # releases the lock
