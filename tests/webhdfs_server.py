"""A minimal WebHDFS endpoint over a local folder, for tests: `python webhdfs_server.py PORT ROOT`.

It answers the REST calls fsspec's WebHDFS client makes (GETFILESTATUS, LISTSTATUS, MKDIRS, RENAME,
DELETE, CREATE/APPEND/OPEN with the namenode -> datanode 307 redirect) with the semantics of a real
namenode where they matter to us: RENAME onto an existing file does not replace it and answers
{"boolean": false}; missing paths answer 404 with a FileNotFoundException RemoteException.
It is not HDFS: no blocks, replication, permissions or Kerberos.
"""
import json
import os
import shutil
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlparse

PREFIX = "/webhdfs/v1"


class Handler(BaseHTTPRequestHandler):
    root = "."

    def log_message(self, *args):  # quiet
        pass

    # -- plumbing ------------------------------------------------------------------------------
    def _parse(self):
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        hdfs_path = unquote(url.path[len(PREFIX):]) or "/"
        return hdfs_path, query, os.path.join(self.root, hdfs_path.lstrip("/"))

    def _json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, hdfs_path):
        self._json(404, {"RemoteException": {"exception": "FileNotFoundException", "javaClassName":
                                             "java.io.FileNotFoundException", "message": f"File does not exist: {hdfs_path}"}})

    def _redirect(self, hdfs_path, query):
        query = dict(query, datanode="true")
        location = (f"http://127.0.0.1:{self.server.server_port}{PREFIX}{quote(hdfs_path)}?"
                    + "&".join(f"{k}={quote(str(v))}" for k, v in query.items()))
        self.send_response(307)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body(self):
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    @staticmethod
    def _status(local, suffix):
        stat = os.stat(local)
        is_dir = os.path.isdir(local)
        return {"pathSuffix": suffix, "type": "DIRECTORY" if is_dir else "FILE", "length": 0 if is_dir else stat.st_size,
                "modificationTime": int(stat.st_mtime * 1000), "accessTime": int(stat.st_atime * 1000),
                "permission": "755", "owner": "test", "group": "test", "replication": 0 if is_dir else 1,
                "blockSize": 0 if is_dir else 134217728}

    # -- verbs ---------------------------------------------------------------------------------
    def do_GET(self):
        hdfs_path, query, local = self._parse()
        op = query.get("op", "").upper()
        if not os.path.exists(local):
            return self._missing(hdfs_path)
        if op == "GETFILESTATUS":
            return self._json(200, {"FileStatus": self._status(local, "")})
        if op == "LISTSTATUS":
            if not os.path.isdir(local):
                return self._json(200, {"FileStatuses": {"FileStatus": [self._status(local, "")]}})
            entries = [self._status(os.path.join(local, n), n) for n in sorted(os.listdir(local))]
            return self._json(200, {"FileStatuses": {"FileStatus": entries}})
        if op == "OPEN":
            if query.get("datanode") != "true":
                return self._redirect(hdfs_path, query)
            offset = int(query.get("offset", 0))
            with open(local, "rb") as f:
                f.seek(offset)
                data = f.read(int(query["length"])) if "length" in query else f.read()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        return self._json(400, {"RemoteException": {"exception": "UnsupportedOperationException",
                                                    "message": f"op {op} is not served by this test endpoint"}})

    def do_PUT(self):
        hdfs_path, query, local = self._parse()
        op = query.get("op", "").upper()
        if op == "MKDIRS":
            os.makedirs(local, exist_ok=True)
            return self._json(200, {"boolean": True})
        if op == "RENAME":
            target = os.path.join(self.root, unquote(query["destination"]).lstrip("/"))
            if not os.path.exists(local) or os.path.exists(target) or not os.path.isdir(os.path.dirname(target)):
                return self._json(200, {"boolean": False})  # a real namenode does not replace, it answers false
            os.rename(local, target)
            return self._json(200, {"boolean": True})
        if op == "CREATE":
            if query.get("datanode") != "true":
                self._body()
                if os.path.exists(local) and query.get("overwrite", "false") != "true":
                    return self._json(403, {"RemoteException": {"exception": "FileAlreadyExistsException",
                                                                "message": f"{hdfs_path} already exists"}})
                return self._redirect(hdfs_path, query)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as f:
                f.write(self._body())
            self.send_response(201)
            self.send_header("Location", f"hdfs://127.0.0.1{hdfs_path}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return self._json(400, {"RemoteException": {"exception": "UnsupportedOperationException",
                                                    "message": f"op {op} is not served by this test endpoint"}})

    def do_POST(self):
        hdfs_path, query, local = self._parse()
        if query.get("op", "").upper() != "APPEND":
            return self._json(400, {"RemoteException": {"exception": "UnsupportedOperationException", "message": "op"}})
        if not os.path.exists(local):
            self._body()
            return self._missing(hdfs_path)
        if query.get("datanode") != "true":
            self._body()
            return self._redirect(hdfs_path, query)
        with open(local, "ab") as f:
            f.write(self._body())
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return None

    def do_DELETE(self):
        hdfs_path, query, local = self._parse()
        if not os.path.exists(local):
            return self._json(200, {"boolean": False})
        if os.path.isdir(local):
            if os.listdir(local) and query.get("recursive") != "true":
                return self._json(403, {"RemoteException": {"exception": "PathIsNotEmptyDirectoryException",
                                                            "message": f"{hdfs_path} is non empty"}})
            shutil.rmtree(local)
        else:
            os.remove(local)
        return self._json(200, {"boolean": True})


def main():
    port, root = int(sys.argv[1]), sys.argv[2]
    os.makedirs(root, exist_ok=True)
    Handler.root = root
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
