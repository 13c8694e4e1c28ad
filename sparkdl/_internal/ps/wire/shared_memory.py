"""Same-host transport: a worker's gradient and weights in a shared-memory segment, not on the socket.

When a worker runs on the parameter server's host (local mode, one node with several GPUs)
the PS creates one segment per worker session under ``/dev/shm``: a gradient region and a
weights region of the model's size.  The worker's replica trains directly in them (its flat
parameter and gradient buffers *are* the regions), so a push is: the worker finishes its
backward pass, then sends a header-only PUSH on the socket; the PS reads the gradient in
place, steps, writes the new weights into the weights region and answers with a header-only
WEIGHTS.  The socket carries only these small control messages and stays the path between
hosts.

Safety: the segment is created by the PS with owner-only permissions (0600) and ``O_EXCL``
(never through an existing file or link), so only processes of the same user can open it; the
same user is inside the trust boundary (it could read the job secret from the broadcast too).
Its name, an HMAC of the per-job secret and the worker's attempt, is distinct per session; it
can be listed in ``/dev/shm`` and is removed as soon as the worker has mapped it.  The PUSH message
is the commit: a worker killed while writing its gradient never sends it, so a torn gradient
is never applied.  Each side writes a region only while the other waits for its message.
Space is reserved with ``posix_fallocate`` so a full ``/dev/shm`` (small in containers) is
found at setup, where the session falls back to TCP, never as a SIGBUS mid-run.  Every process that
maps a shared file holds a shared ``flock`` on it while it does, so the files of a process killed
before it removed them are found and removed by the next one made on the host (:func:`remove_orphans`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import time

import torch

SHM_DIR = "/dev/shm"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_identity() -> bytes:
    """This kernel's boot id: equal on both sides only when they share a host (and /dev/shm is checked too)."""
    try:
        with open(BOOT_ID_PATH, "rb") as source:
            return source.read().strip()
    except OSError:
        return b""


def available() -> bool:
    """Whether this platform has a shared-memory file system to use."""
    return os.path.isdir(SHM_DIR) and bool(host_identity())


def file_name(secret: bytes, label: str) -> str:
    """A shared file's name: an HMAC of ``label`` under the job's secret (unguessable without it)."""
    tag = hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()
    return f"sparkdl-{tag[:32]}"


def segment_name(secret: bytes, worker: int, task_attempt: int, shard: int = 0) -> str:
    """The segment's file name: unguessable without the job's secret, distinct per worker attempt and PS shard."""
    return file_name(secret, f"sparkdl-shm:{worker}:{task_attempt}:{shard}")


def unnamed_path() -> str:
    """A random path in the shared-memory directory, for a file that gets its name once the PS's port is known."""
    return os.path.join(SHM_DIR, f"sparkdl-{secrets.token_hex(16)}")


class SharedFile:
    """A mapped file at :attr:`path`: given its published name by :meth:`publish`, its name removed by
    :meth:`remove` (the memory goes when every mapping of it is dropped)."""

    path: str

    def publish(self, name: str) -> None:
        """Give the file the name the workers look for."""
        path = os.path.join(SHM_DIR, name)
        os.rename(self.path, path)
        self.path = path

    def remove(self) -> None:
        """Remove the file's name (gone already is fine)."""
        remove_name(self.path)


class SharedSegment(SharedFile):
    """A gradient region and a weights region, ``num_params`` float32 values each, in one mapped file.

    Double-buffered (``regions=2``, for overlapped exchanges): two of each.  A push names the
    gradient region ``r`` it filled; the PS writes the new weights into weights region ``1 - r``,
    which the worker is not computing with while that push is in flight, and hands region ``r``
    back zeroed.
    """

    def __init__(self, path: str, buffer: mmap.mmap, num_params: int, regions: int = 1) -> None:
        self.path = path
        self._buffer = buffer
        self.num_params = num_params
        self.regions = regions
        self.gradients = [torch.frombuffer(buffer, dtype=torch.float32, count=num_params, offset=8 * num_params * r)
                          for r in range(regions)]
        self.weight_regions = [torch.frombuffer(buffer, dtype=torch.float32, count=num_params,
                                                offset=8 * num_params * r + 4 * num_params) for r in range(regions)]
        self.gradient, self.weights = self.gradients[0], self.weight_regions[0]

    def reply_region(self, gradient_region: int) -> torch.Tensor:
        """Where the PS writes the weights answering a push of ``gradient_region``."""
        return self.weight_regions[1 - gradient_region] if self.regions == 2 else self.weights

    @classmethod
    def create(cls, name: str, num_params: int, regions: int = 1) -> SharedSegment | None:
        """The PS side: a new segment, or None when this host cannot give one (then TCP is used)."""
        path = os.path.join(SHM_DIR, name)
        buffer = create_mapped(path, 8 * num_params * regions)
        return None if buffer is None else cls(path, buffer, num_params, regions)

    @classmethod
    def attach(cls, name: str, num_params: int, regions: int = 1) -> SharedSegment | None:
        """The worker side: map the segment the PS created and remove its name; None when it is not here."""
        path = os.path.join(SHM_DIR, name)
        buffer = attach_mapped(path, 8 * num_params * regions)
        if buffer is None:
            return None
        remove_name(path)         # mapped: nobody else needs to find it
        return cls(path, buffer, num_params, regions)


def master_name(secret: bytes, port: int) -> str:
    """The shared master's file name: unguessable without the job's secret, distinct per PS (by its port)."""
    return file_name(secret, f"sparkdl-master:{port}")


class SharedMaster(SharedFile):
    """The PS's master weights in a mapped file, which the workers on its host compute on in place (sync).

    A sync round steps the master only once every worker in it has pushed and waits for its reply, so no
    worker reads weights while they change; the reply then carries no weights at all, where a copy into
    every worker's segment cost a pass over the model per worker under the PS's lock.  The file has the
    segments' protections (0600, ``O_EXCL``, space reserved up front).  It is made under a random name
    and renamed to its :func:`master_name` once the PS's port is known; that name stays while the PS runs
    (a retried worker maps it again) and goes at :meth:`remove`.
    """

    def __init__(self, path: str, buffer: mmap.mmap, num_params: int) -> None:
        self.path = path
        self._buffer = buffer
        self.weights = torch.frombuffer(buffer, dtype=torch.float32, count=num_params)

    @classmethod
    def create(cls, num_params: int) -> SharedMaster | None:
        """The PS side; None when this host cannot give one (then every reply is copied, as over TCP)."""
        path = unnamed_path()
        buffer = create_mapped(path, 4 * num_params)
        return None if buffer is None else cls(path, buffer, num_params)

    @classmethod
    def attach(cls, name: str, num_params: int) -> SharedMaster | None:
        """The worker side: map the PS's master; None when it is not here (the replies then come in the segment)."""
        path = os.path.join(SHM_DIR, name)
        buffer = attach_mapped(path, 4 * num_params)
        return None if buffer is None else cls(path, buffer, num_params)


#: the names this module gives its files (:func:`file_name`, :func:`unnamed_path`): the only ones swept
SHARED_NAME = re.compile(r"sparkdl-[0-9a-f]{32}")

#: a file left by a process that died is removed by the next one to make a file, once it is this old (seconds):
#: never one whose maker is still between creating and locking it
ORPHAN_AGE_S = 60.0


def remove_orphans() -> None:
    """Remove the names of this user's sparkdl files in the shared-memory directory that no live process maps
    (nobody holds their lock, see :func:`create_mapped`) and that are older than :data:`ORPHAN_AGE_S`: the memory
    of a parameter server or worker killed before it could remove them."""
    now = time.time()
    try:
        names = [name for name in os.listdir(SHM_DIR) if SHARED_NAME.fullmatch(name)]
    except OSError:
        return
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue          # gone already, or not ours to open
        try:
            info = os.fstat(fd)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                    or now - info.st_mtime < ORPHAN_AGE_S):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)    # fails while any process maps it
            named = os.stat(path, follow_symlinks=False)
            if (named.st_dev, named.st_ino) != (info.st_dev, info.st_ino):
                continue      # another file took the name since it was opened: not this one to remove
            remove_name(path)
        except OSError:
            continue
        finally:
            os.close(fd)


def create_mapped(path: str, size: int) -> mmap.mmap | None:
    """A new owner-only file of ``size`` bytes at ``path``, mapped; None when it cannot be made (or exists).

    The mapping holds a shared lock on the file as long as it lives (its process too): what tells
    :func:`remove_orphans`, run here first, that the file is in use."""
    remove_orphans()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        _lock_shared(fd)
        os.posix_fallocate(fd, 0, size)     # ENOSPC here, not SIGBUS on a later write
        return mmap.mmap(fd, size)           # its own duplicate of fd keeps the lock
    except OSError:
        remove_name(path)
        return None
    finally:
        os.close(fd)


def attach_mapped(path: str, size: int) -> mmap.mmap | None:
    """Map the file another process made at ``path``; None unless it is there, this user's, owner-only and ``size``
    bytes."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None       # another host with the same boot id, or another /dev/shm (containers)
    try:
        info = os.fstat(fd)
        if info.st_size != size or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None   # not the PS's file as it made it: use the socket
        _lock_shared(fd)      # in use while mapped here too (see create_mapped)
        return mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _lock_shared(fd: int) -> None:
    """Mark the file in use for as long as this process maps it; where the file system has no locks, the sweep
    cannot take one either, so nothing there is removed as an orphan."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH)


def remove_name(path: str) -> None:
    """Remove a file's name (its memory stays while it is mapped); gone already is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
