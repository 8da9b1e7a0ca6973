"""Request bodies kept on disk: a fenced write's body beyond ``limits.body_buffer`` is
written to a file of its own in ``limits.body_temp_path`` as it arrives (as nginx's
``client_body_buffer_size`` and ``client_body_temp_path`` do), sent to the upstream
from there, and removed once the write is over, however it ended.

Each file is made with ``mkstemp`` (``O_EXCL``, mode 0600) in a folder of mode 0700
that the proxy's user owns, and is named ``fenceproxy-body-<pid>-<random>.part``. Its
proxy holds an exclusive ``flock`` on it for as long as the file is open, and the
kernel lets go of that lock when the process dies, however it dies. So at start a
proxy removes every file of that naming whose lock it can take: what a killed proxy
left behind. Several proxies may share the folder: none removes a file another one
still holds, whatever their process ids or PID namespaces.

A proxy uses its file only through the descriptor it made it with, never by name:
should another proxy remove its name in the instant between ``mkstemp`` and the
lock, the body is still whole, and its space is freed when the descriptor closes.

Disk reads and writes go to the event loop's default thread pool, 256 KiB at a
time, so a slow disk (or the kernel throttling writes to it) never stalls the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from .errors import BodySpoolFailed, InsufficientStorage, InvariantError, Refusal
from .fence.fencing import Digest
from .log import server_log

__all__ = ["CHUNK", "SpoolFile", "SpoolFolder", "default_folder"]

T = TypeVar("T")
CHUNK = 256 * 1024
"""How much is read from or written to a body's file at once."""
_PREFIX = "fenceproxy-body-"
_SUFFIX = ".part"
_NAME = re.compile(r"fenceproxy-body-[0-9]+-[A-Za-z0-9_]+\.part", re.ASCII)
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def default_folder() -> str:
    """``fenceproxy-bodies-<uid>`` in the system's temporary folder (``TMPDIR``):
    one per user, so two users' proxies on one host never meet in it."""
    return os.path.join(tempfile.gettempdir(), f"fenceproxy-bodies-{os.getuid()}")


def spool_failure(exc: OSError, doing: str, *, sending: bool = False) -> Refusal:
    """What a disk error while holding a body means to the client: 507 when the disk
    (or the file size limit) has no room, 503 for anything else. Nothing was sent; or,
    ``sending``, part of the body was, and the upstream connection is reset
    (:mod:`fenceproxy.http.http1`), so the upstream never has the whole request."""
    reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
    told = (
        "the upstream got part of it and its connection was reset, so it never had the "
        "whole request"
        if sending
        else "nothing was forwarded"
    )
    if exc.errno in _NO_ROOM:
        return InsufficientStorage(
            f"the proxy has no room on disk for this request body ({reason} while {doing}); "
            + told,
            retry_after=5.0,
        )
    return BodySpoolFailed(
        f"the proxy could not keep this request body on disk ({reason} while {doing}); " + told,
        retry_after=1.0,
    )


class SpoolFolder:
    """The folder bodies are kept in: made and checked by :meth:`prepare`, swept of
    what killed proxies left by :meth:`sweep`."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def prepare(self) -> None:
        """Make the folder (mode 0700) if it is missing, and check that it is a
        folder of this user's that no one else may write to; ValueError saying what
        is wrong otherwise (OSError's message included)."""
        try:
            with contextlib.suppress(FileExistsError):  # checked below, whatever it is
                os.makedirs(self.path, mode=0o700)
            info = os.lstat(self.path)
        except OSError as exc:
            raise ValueError(f"cannot make the folder {self.path}: {exc.strerror}") from None
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{self.path} is not a folder (a link or a file)")
        if info.st_uid != os.geteuid():
            raise ValueError(f"{self.path} belongs to another user (uid {info.st_uid})")
        if info.st_mode & 0o022:
            raise ValueError(
                f"{self.path} may be written by other users (mode {info.st_mode & 0o777:o})"
            )
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ValueError(f"{self.path} is not writable")

    def sweep(self) -> list[str]:
        """Remove the body files no live proxy holds (what a killed one left); the
        names removed. Files of any other naming are never touched."""
        removed = []
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return []
        for entry in entries:
            if not _NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(entry.path)
            except OSError:
                continue  # held by a live proxy, or gone meanwhile
            finally:
                os.close(fd)
            removed.append(entry.name)
        return removed

    def create(self) -> SpoolFile:
        """A new, empty body file, locked as this process's; OSError if it cannot be."""
        prefix = f"{_PREFIX}{os.getpid()}-"
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=_SUFFIX, dir=self.path)
        # Should a sweep hold it this instant, the descriptor still has the body.
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return SpoolFile(fd, path)


class SpoolFile:
    """One body on disk, written and read through its descriptor in the loop's thread
    pool. :meth:`remove` removes it at once and closes the descriptor once no read or
    write of it is under way in a thread (a cancelled request leaves one running)."""

    __slots__ = ("_busy", "_closing", "fd", "path", "size")

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path
        self.size = 0
        self._busy: asyncio.Future[Any] | None = None
        self._closing = False

    async def write(self, data: bytes, digest: Digest | None) -> None:
        """Append ``data`` (hashing it into ``digest`` on the way); a Refusal when the
        disk fails (507 when full)."""
        try:
            await self._run(_write_all, self.fd, data, digest)
        except OSError as exc:
            raise spool_failure(exc, "writing it") from None
        self.size += len(data)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body from its start, ``CHUNK`` bytes at a time: exactly ``size`` bytes,
        or a Refusal if the file cannot give them."""
        offset = 0
        while offset < self.size:
            want = min(CHUNK, self.size - offset)
            try:
                data: bytes = await self._run(os.pread, self.fd, want, offset)
            except OSError as exc:
                raise spool_failure(exc, "reading it back", sending=True) from None
            if len(data) != want:
                cut = OSError(errno.EIO, "the file was cut short")
                raise spool_failure(cut, "reading it back", sending=True)
            offset += want
            yield data

    async def _run(self, call: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise InvariantError("the body's file was removed")
        busy = self._busy = asyncio.get_running_loop().run_in_executor(None, call, *args)
        try:
            # Shielded: a cancelled request must not forget a thread still using the
            # descriptor, which remove() closes only after it.
            return await asyncio.shield(busy)
        finally:
            if busy.done():
                self._busy = None

    def remove(self) -> None:
        """Remove the file; again, nothing more."""
        if self._closing:
            return
        self._closing = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the descriptor is closed all the same; a sweep retries
            server_log.error("could not remove the body file %s: %s", self.path, exc.strerror)
        busy = self._busy
        if busy is not None and not busy.done():
            busy.add_done_callback(self._close_after)
        else:
            os.close(self.fd)

    def _close_after(self, busy: asyncio.Future[Any]) -> None:
        if not busy.cancelled():
            busy.exception()  # seen: the request it was for has ended
        os.close(self.fd)


def _write_all(fd: int, data: bytes, digest: Digest | None) -> None:
    if digest is not None:
        digest.update(data)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
