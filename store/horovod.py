"""The store classes a Horovod user looks for, as thin subclasses of `Store`."""
from __future__ import annotations

from typing import Any, Dict, Optional

from store.store import LocalStore, Store


class HDFSStore(Store):
    """`hdfs://namenode:8020/prefix` (or a path plus host/port), through pyarrow's HadoopFileSystem.

    Needs libhdfs and a Hadoop client on every machine, as pyarrow does; `user`, `kerb_ticket` and
    `extra_conf` are passed to it.
    """

    url_prefixes = ("hdfs://",)

    def __init__(self, prefix_path: str, host: Optional[str] = None, port: Optional[int] = None,
                 user: Optional[str] = None, kerb_ticket: Optional[str] = None, driver: str = "libhdfs",
                 extra_conf: Optional[Dict[str, str]] = None, temp_dir: Optional[str] = None,
                 storage_options: Optional[Dict[str, Any]] = None, **kwargs: Any):
        options = {k: v for k, v in (("user", user), ("kerb_ticket", kerb_ticket), ("extra_conf", extra_conf))
                   if v is not None}
        options.update(storage_options or {})
        super().__init__(hdfs_url(prefix_path, host, port), options, **kwargs)


class DBFSLocalStore(LocalStore):
    """Databricks File System through its local mount: `dbfs:/path` and `/dbfs/path` are `/dbfs/path`."""

    url_prefixes = ("dbfs:", "/dbfs/")

    def __init__(self, prefix_path: str, *args: Any, **kwargs: Any):
        super().__init__(dbfs_local_path(prefix_path), *args, **kwargs)


class AdlsStore(Store):
    """Azure Data Lake Storage Gen2 through adlfs: `abfs://container@account.dfs.core.windows.net/prefix`,
    with `storage_options={'account_name': ..., 'sas_token': ...}` (or account_key, connection_string, ...)."""


def hdfs_url(prefix_path: str, host: Optional[str], port: Optional[int]) -> str:
    if prefix_path.startswith("hdfs://"):
        return prefix_path
    path = "/" + prefix_path.lstrip("/")
    authority = f"{host or 'default'}{f':{port}' if port else ''}"
    return f"hdfs://{authority}{path}"


def dbfs_local_path(prefix_path: str) -> str:
    if prefix_path.startswith("dbfs:"):
        return "/dbfs/" + prefix_path[len("dbfs:"):].lstrip("/")
    return prefix_path
