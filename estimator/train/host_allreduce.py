"""Gradient averaging through shared memory when every rank runs on one host (CPU training).

On CPU, DistributedDataParallel averages gradients with gloo over TCP loopback. For the small models people
train on CPU a step's allreduce is latency, not bandwidth: about 2 ms per step on a 2-core machine, as long
as the forward and backward pass themselves. When all ranks share a host, each rank instead copies its bucket
into its slot of one shared-memory file, publishes a step counter, waits (spinning briefly, then yielding,
then sleeping) until every rank has published, and sums the slots in rank order. Every rank computes the
same sum in the same order, so the replicas stay bit-identical, as DDP requires.

`HostAllreduce.connect` is collective: rank 0 creates the file in /dev/shm, the others open it and check a
random token, and the ranks agree over the process group; if any rank cannot attach (ranks on different
hosts, no /dev/shm, too little space, not x86), every rank keeps gloo. The file is unlinked as soon as all
ranks have mapped it, so nothing is left behind when a process dies.

A rank that raises marks the shared header (`abort`); a rank that dies is noticed by its pid; a peer that
never arrives ends the wait after `timeout` seconds. Each case raises on the waiting ranks, naming the rank.
Memory ordering: a rank writes its slot, then its counter; readers read the counter, then the slots. x86
keeps stores and loads in program order, which this relies on; other architectures keep gloo.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import time
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from estimator.failures import FailureKind

log = logging.getLogger("estimator")

SHM_DIR = "/dev/shm"
MAX_SLOT_BYTES = 4 << 20  # per rank and parity: larger buckets go through in chunks
HEADER_WORDS = 8  # per rank, int64: [0] published step, [1] abort flag, [2] pid (one 64-byte line per rank)
TOKEN_BYTES = 16
SPIN_BEFORE_YIELD = 50  # spinning holds the GIL, which the rank's feeding thread needs: yield soon (2,000 spins:
#                          streaming W2 trained 7% slower, benchmarks/RESULTS.md seventh measurement)
YIELD_SECONDS = 0.005  # then sched_yield for this long, then sleep between checks
SLEEP_SECONDS = 0.0002
LIVENESS_EVERY = 0.5  # seconds between checks that waited-for peers are alive
ECHO_DELAY = 2.0  # seconds a rank waits before reporting a peer's failure (as the rendezvous does)


class PeerFailed(RuntimeError):
    """A peer raised, died or timed out during the shared-memory gradient allreduce."""

    failure_kind = FailureKind.PEER  # never the cause: the driver looks for another


class HostAllreduce:
    """Mean of equally shaped contiguous tensors over the ranks of one host. Use `hook` as a DDP comm hook."""

    def __init__(self, mapped: mmap.mmap, rank: int, world: int, slot_bytes: int, timeout: float):
        self.rank, self.world, self.slot_bytes, self.timeout = rank, world, slot_bytes, timeout
        self._mmap = mapped
        header = world * HEADER_WORDS * 8
        self._header = np.ndarray((world, HEADER_WORDS), np.int64, mapped, TOKEN_BYTES)
        self._slots = torch.frombuffer(mapped, dtype=torch.uint8, offset=TOKEN_BYTES + header,
                                       count=2 * world * slot_bytes).view(2, world, slot_bytes)
        self._step = 0

    # -- setup ---------------------------------------------------------------------------------------------

    @classmethod
    def connect(cls, rank: int, world: int, payload_bytes: int, timeout: float) -> Optional["HostAllreduce"]:
        """Collective over the default process group. Returns None on every rank when any rank cannot
        attach; the reason is logged on rank 0."""
        slot_bytes = max(64, min(MAX_SLOT_BYTES, -(-payload_bytes // 64) * 64))
        size = TOKEN_BYTES + world * HEADER_WORDS * 8 + 2 * world * slot_bytes
        reason = ""
        path = token = ""
        mapped: Optional[mmap.mmap] = None
        if rank == 0:
            path = os.path.join(SHM_DIR, f"spark-torch-estimator-{os.getpid()}-{secrets.token_hex(8)}")
            token = secrets.token_hex(TOKEN_BYTES)
            mapped, reason = _guarded(_create, path, size, token) if platform.machine() in ("x86_64", "AMD64") \
                else (None, f"not an x86 host ({platform.machine()})")
        shared: List[object] = [path if mapped is not None else "", token, reason]
        dist.broadcast_object_list(shared, src=0)
        path, token, reason = shared  # type: ignore[assignment]
        if rank != 0 and path:
            mapped, reason = _guarded(_attach, str(path), size, str(token))
        ok = torch.tensor([1 if mapped is not None else 0], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        comm: Optional[HostAllreduce] = None
        if ok.item() == 1 and mapped is not None:
            comm = cls(mapped, rank, world, slot_bytes, timeout)
            comm._header[rank, 2] = os.getpid()
        dist.barrier()  # every rank has mapped the file (or given up) and written its pid
        if rank == 0 and path:
            try:
                os.unlink(str(path))
            except OSError:
                pass
        if comm is None:
            if mapped is not None:
                mapped.close()
            if rank == 0:
                log.info("gradients are averaged with gloo: %s", reason or "a rank could not open the shared "
                         "memory file (ranks on different hosts, or no shared /dev/shm)")
            return None
        if not all(_alive(int(pid)) for pid in comm._header[:, 2]):
            # pids from another pid namespace: a dead peer could not be noticed, so do not use it
            comm.close()
            comm = None
        flags = torch.tensor([1 if comm is not None else 0], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if flags.item() != 1:
            if comm is not None:
                comm.close()
            if rank == 0:
                log.info("gradients are averaged with gloo: the ranks cannot see each other's processes")
            return None
        return comm

    # -- the allreduce -------------------------------------------------------------------------------------

    def hook(self, state, bucket):  # no annotations: DDP checks them, and this module's are strings
        """DDP comm hook: average the bucket (a dist.GradBucket) in place, synchronously."""
        buffer = bucket.buffer()
        self.mean_(buffer)
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` (contiguous, CPU) with its mean over the ranks."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("HostAllreduce needs a contiguous CPU tensor")
        flat = tensor.view(-1)
        per_chunk = max(1, self.slot_bytes // flat.element_size())
        for start in range(0, flat.numel(), per_chunk):
            self._mean_chunk_(flat[start:start + per_chunk])
        return tensor

    def _mean_chunk_(self, chunk: torch.Tensor) -> None:
        self._step += 1
        parity = self._step & 1
        nbytes = chunk.numel() * chunk.element_size()
        # Double buffering: a rank writes step s+2 into this parity only after it saw every rank publish
        # s+1, and a rank publishes s+1 only after it finished reading step s.
        self._slots[parity, self.rank, :nbytes].copy_(chunk.view(torch.uint8))
        self._header[self.rank, 0] = self._step
        self._wait(self._step)
        slots = self._slots[parity, :, :nbytes]
        chunk.copy_(slots[0].view(chunk.dtype))
        for other in range(1, self.world):
            chunk.add_(slots[other].view(chunk.dtype))
        chunk.div_(self.world)

    def _wait(self, step: int) -> None:
        published = self._header[:, 0]
        if (published >= step).all():
            return
        started = time.monotonic()
        spins = 0
        next_check = started + LIVENESS_EVERY
        while not (published >= step).all():
            spins += 1
            if spins < SPIN_BEFORE_YIELD:
                continue
            now = time.monotonic()
            if now - started < YIELD_SECONDS:
                os.sched_yield()
                continue
            time.sleep(SLEEP_SECONDS)
            if now >= next_check:
                next_check = now + LIVENESS_EVERY
                self._check_peers(step, now - started)

    def _check_peers(self, step: int, waited: float) -> None:
        late = [r for r in range(self.world) if self._header[r, 0] < step]
        aborted = [r for r in range(self.world) if self._header[r, 1]]
        dead = [r for r in late if not _alive(int(self._header[r, 2]))]
        if aborted or dead:
            time.sleep(ECHO_DELAY)  # the failed rank's own error should reach the driver before this echo
        if aborted:
            raise PeerFailed(f"rank {aborted[0]} failed during training; rank {self.rank} stops waiting for it "
                             "in the gradient allreduce (its own error is reported separately)")
        if dead:
            raise PeerFailed(f"rank {dead[0]} (pid {int(self._header[dead[0], 2])}) died during training; rank "
                             f"{self.rank} was waiting for it in the gradient allreduce")
        if waited > self.timeout:
            raise PeerFailed(f"rank {self.rank} waited {waited:.0f} s for ranks {late} in the gradient allreduce, "
                             f"longer than collective_timeout={self.timeout:g} s. Raise collective_timeout if a "
                             "rank legitimately takes that long between steps.")

    # -- teardown ------------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Tell the peers this rank failed, so they stop waiting for it."""
        if self._header is not None:
            self._header[self.rank, 1] = 1

    def close(self) -> None:
        self._header = self._slots = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with it
            pass


def _guarded(attempt, *args):
    """(mapping, "") or (None, why): nothing raised here may stop training; gloo is always there."""
    try:
        return attempt(*args)
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def _create(path: str, size: int, token: str):
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot create {path}: {exc}"
    try:
        os.posix_fallocate(fd, 0, size)  # reserve the tmpfs pages now: a full /dev/shm fails here, not with SIGBUS
        mapped = mmap.mmap(fd, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        return None, f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR}: {exc}"
    os.close(fd)
    mapped[:TOKEN_BYTES] = bytes.fromhex(token)
    return mapped, ""


def _attach(path: str, size: int, token: str):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return None, f"cannot open {path}: {exc}"
    try:
        if os.fstat(fd).st_size != size:
            return None, f"{path} has an unexpected size"
        mapped = mmap.mmap(fd, size)
    except OSError as exc:
        return None, f"cannot map {path}: {exc}"
    finally:
        os.close(fd)
    if mapped[:TOKEN_BYTES] != bytes.fromhex(token):
        mapped.close()
        return None, f"{path} is not rank 0's file"
    return mapped, ""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a Spark worker that died stays a zombie until reaped)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
