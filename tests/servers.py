"""Helpers for tests that start local servers (moto, Azurite, a Spark standalone cluster)."""
import socket
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, process, seconds=90):
    """Wait until something listens on 127.0.0.1:port; fail early if `process` exits first."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            output = process.stdout.read()[-2000:] if process.stdout else ""
            raise RuntimeError(f"the server exited with {process.returncode}: {output}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on port {port} after {seconds} s")
