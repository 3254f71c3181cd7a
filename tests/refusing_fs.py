"""A file system that refuses writes under one folder, as a full disk
(ENOSPC) or a read-only mount (EROFS) does. A stub (os and io functions
monkeypatched), since the tests run as root, whom chmod stops from nothing,
and a mount needs privileges a test cannot count on.

    refuse_writes(monkeypatch, home, errno.EROFS)   # nothing under home is created, changed or removed
    refuse_writes(monkeypatch, home, errno.ENOSPC)  # nothing new under home: files open as they are
"""
from __future__ import annotations

import builtins
import errno
import io
import os

_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def refuse_writes(monkeypatch, folder: os.PathLike | str, code: int) -> None:
    folder = os.path.realpath(folder)
    read_only = code == errno.EROFS

    def inside(path) -> bool:
        if isinstance(path, int):
            return False   # a descriptor, opened before
        real = os.path.realpath(os.fsdecode(path))
        return real == folder or real.startswith(folder + os.sep)

    def refused(path, *, new_only: bool = False) -> bool:
        # A full disk still opens and renames what exists; it has no room for what does not.
        return inside(path) and (read_only or not (new_only and os.path.lexists(path)))

    def fail(path):
        raise OSError(code, os.strerror(code), os.fsdecode(path))

    os_open, io_open = os.open, io.open

    def open_fd(path, flags, *args, **kwargs):
        if flags & _WRITES and refused(path, new_only=not flags & os.O_TRUNC):
            fail(path)
        return os_open(path, flags, *args, **kwargs)

    def open_file(file, mode="r", *args, **kwargs):
        if set(mode) & set("wax+") and refused(file, new_only="w" not in mode):
            fail(file)
        return io_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_fd)
    monkeypatch.setattr(io, "open", open_file)
    monkeypatch.setattr(builtins, "open", open_file)

    def one_path(name: str, new_only: bool) -> None:
        real = getattr(os, name)

        def call(path, *args, **kwargs):
            if refused(path, new_only=new_only):
                fail(path)
            return real(path, *args, **kwargs)
        monkeypatch.setattr(os, name, call)

    one_path("mkdir", new_only=True)
    if read_only:
        for name in ("chmod", "utime", "unlink", "remove", "rmdir"):
            one_path(name, new_only=False)
        for name in ("replace", "rename"):
            real = getattr(os, name)

            def move(src, dst, *args, _real=real, **kwargs):
                if inside(src) or inside(dst):
                    fail(dst)
                return _real(src, dst, *args, **kwargs)
            monkeypatch.setattr(os, name, move)
