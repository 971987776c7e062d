"""Local files that are regular: a store never opens a FIFO, a socket or a device planted in it.

:class:`RegularLocalFileSystem` judges a path from ``lstat`` before opening it, opens it non-blocking and checks it
again with ``fstat``, so a file swapped for a FIFO in between is refused too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

__all__ = ["NotRegularFileError", "RegularLocalFileSystem", "check_regular", "describe_mode", "url_to_regular_fs"]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


class NotRegularFileError(OSError):
    """A path read (or written over) as a file is a FIFO, a socket, a device or a folder: refused, never opened.

    Opening a FIFO blocks until another process opens its other end (forever, in a store nobody writes to), and
    opening a device can act on it; a store's objects, manifests and claims are only ever regular files.
    """


def describe_mode(mode: int) -> str:
    """What a stat mode is, in words (``"a FIFO (named pipe)"``), for what is not a regular file."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str, *, missing_ok: bool = False) -> None:
    """Refuse ``path`` when it is a FIFO, socket or device (a symlink is judged by its target), from ``lstat``/``stat``
    only. A folder passes: opening it fails at once (``IsADirectoryError``), as it always did.

    Raises:
        NotRegularFileError: ``path`` is a FIFO, socket or device (its kind is in the message).
        FileNotFoundError: ``path`` does not exist (unless ``missing_ok``).
    """
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            mode = os.stat(path).st_mode
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # a folder fails its open at once (IsADirectoryError)
        raise NotRegularFileError(errno.EINVAL, f"{describe_mode(mode)}, not a regular file: not opened", path)


def _open_regular_fd(path: str) -> int:
    """Open a regular file for reading: checked before (``lstat``) and after (``fstat`` of a non-blocking open, so a
    file swapped for a FIFO in between cannot block), then made blocking again."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)  # what a plain open says
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{describe_mode(mode)}, not a regular file: not read", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _RegularFileOpener(LocalFileOpener):
    """fsspec's local file, opened for reading only when it is a regular file."""

    def _open(self) -> None:
        if (self.f is None or self.f.closed) and set(self.mode) <= {"r", "b"} and not self.compression:
            self.f = os.fdopen(_open_regular_fd(self.path), self.mode)
            self.size = self.f.seek(0, 2)
            self.f.seek(0)
            self.f.size = self.size
            return
        super()._open()


class RegularLocalFileSystem(LocalFileSystem):
    """fsspec's local filesystem that opens only regular files (:class:`NotRegularFileError` otherwise).

    Every read of a local store goes through it (manifests, claims, objects, verification), so a FIFO, socket or
    device planted in a store is refused from ``lstat`` and never opened; a write never opens one either.
    """

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        check_regular(path, missing_ok="r" not in mode)
        if self.auto_mkdir and ("w" in mode or "x" in mode or "a" in mode):
            self.makedirs(self._parent(path), exist_ok=True)
        return _RegularFileOpener(path, mode, fs=self, **kwargs)


def url_to_regular_fs(uri: str, **options: Any) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs``, with a local filesystem replaced by a :class:`RegularLocalFileSystem`."""
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(uri, **options)
    if type(fs) is LocalFileSystem:
        fs = RegularLocalFileSystem(**fs.storage_options)
    return fs, path
