"""Facts about the filesystem a folder is on, for `fastpersist info` and the
benchmarks' reports: which mount holds it, and whether it takes O_DIRECT."""
from __future__ import annotations

import errno
import mmap
import os
import secrets
from typing import Optional


def errno_text(exc: OSError) -> str:
    """'EINVAL: Invalid argument' style text for an OSError."""
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc)
    return f"{name}: {reason}" if name else reason


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and set(field[i + 1:i + 4]) <= set("01234567"):
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_of(folder: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[dict]:
    """The mount holding folder: {'type', 'mount_point', 'source', 'options',
    'super_options'} (the mount's and the filesystem's options), or None."""
    path = os.path.realpath(folder)
    best: Optional[dict] = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3 or len(fields) < 5:
            continue
        mount_point = _unescape_mountinfo(fields[4])
        inside = (mount_point == "/" or path == mount_point
                  or path.startswith(mount_point.rstrip("/") + "/"))
        if not inside:
            continue
        # ">=": a later mount on the same point hides the earlier one
        if best is None or len(mount_point) >= len(best["mount_point"]):
            best = {"type": fields[sep + 1], "mount_point": mount_point,
                    "source": _unescape_mountinfo(fields[sep + 2]), "options": fields[5],
                    "super_options": fields[sep + 3] if len(fields) > sep + 3 else ""}
    return best


def probe_o_direct(folder: str) -> str:
    """'yes' when folder takes an aligned 4096-byte O_DIRECT write, else 'no (ERRNO)'.

    A temporary file is created in folder and always removed again.
    """
    if not hasattr(os, "O_DIRECT"):
        return "no (O_DIRECT not available on this platform)"
    path = os.path.join(folder, f".fastpersist-info-{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as exc:
        _remove_quietly(path)
        if exc.errno == errno.EINVAL:
            return "no (EINVAL at open)"
        return f"unknown (cannot create a file: {errno_text(exc)})"
    try:
        buf = mmap.mmap(-1, 4096)  # anonymous maps are page-aligned
        try:
            buf.write(b"fastpersist" * 372)
            written = os.pwrite(fd, buf, 0)
        finally:
            buf.close()
        if written != 4096:
            return f"no (short write of {written} bytes)"
        return "yes"
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return f"no ({name})"
    finally:
        os.close(fd)
        _remove_quietly(path)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
