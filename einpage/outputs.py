"""Files einpage writes, never lost and never half-written.

Every output goes to a temporary file beside its target (`.NAME.XXXXXXXX.tmp`, same directory,
so the rename cannot cross file systems) and is renamed into place with `os.replace` only once it
is complete: a full disk, a file-size limit (`ulimit -f`) or an error while the contents are made
leaves the target as it was (absent, or its old contents) and removes the temporary file. The
failure is an `OutputError`: one line naming the file and the reason. A process killed outright
(SIGKILL, power loss) may leave a `.NAME.*.tmp` beside the target, never a truncated target.

Targets that are not regular files (`/dev/null`, `/dev/stdout`, a named pipe) are written in
place: renaming over them would replace the device node. A symbolic link is followed: the file
it points to is replaced, the link stays. An existing target keeps its permission bits.

`check_writable(path)` is the check a command runs on every output before it starts its work:
the directory exists and a file can be created in it (tried, not guessed from permission bits),
and the path is not a directory.
"""
from __future__ import annotations

import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from einpage.errors import OutputError

__all__ = ["atomic_open", "check_writable", "ignore_file_size_signal", "save_npy", "write_bytes",
           "write_text"]


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _special(path: Path) -> bool:
    """An existing target that is not a regular file (a device, a pipe): written in place."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _resolve(path: str | os.PathLike) -> Path:
    """Where the bytes go: a symbolic link's target (so the link survives), else `path`."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def _temp_in(directory: Path, name: str) -> tuple[int, Path]:
    """A new file beside the target, created exclusively, mode 0666 less the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = directory / f".{name[:200]}.{secrets.token_hex(4)}.tmp"  # within NAME_MAX
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {name}")


def check_writable(path: str | os.PathLike, flag: str | None = None) -> None:
    """Raise `OutputError` (naming `flag`, e.g. `-o`, when given) unless `path` can be written
    the way `atomic_open` writes it: its directory exists, a file can be created there (a probe
    file is created and removed at once), and the path is not a directory. Leaves nothing
    behind."""
    label = f"cannot write {flag} {path}" if flag else f"cannot write {path}"
    if str(path) == "":
        raise OutputError(f"{flag or 'output'}: empty file name")
    target = _resolve(path)
    if target.is_dir():
        raise OutputError(f"{label}: is a directory (name a file in it)")
    if _special(target):
        if not os.access(target, os.W_OK):
            raise OutputError(f"{label}: permission denied")
        return
    directory = target.parent
    if not directory.exists():
        raise OutputError(f"{label}: no such directory {str(directory)!r}")
    if not directory.is_dir():
        raise OutputError(f"{label}: {str(directory)!r} is not a directory")
    if target.exists() and not os.access(target, os.W_OK):
        raise OutputError(f"{label}: permission denied (the file is read-only)")
    try:
        fd, tmp = _temp_in(directory, target.name)
    except OSError as exc:
        raise OutputError(f"{label}: cannot create a file in {str(directory)!r} "
                          f"({_reason(exc)})") from None
    os.close(fd)
    tmp.unlink(missing_ok=True)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *,
                encoding: str | None = None) -> Iterator[IO]:
    """`with atomic_open(path) as fh: ...`: a file object on a temporary file beside `path`,
    renamed onto `path` when the block ends without an exception. Any failure (an `OSError`
    of the write, the close or the rename, or an exception from the block) removes the
    temporary file and leaves `path` untouched; an `OSError` is raised as an `OutputError`
    naming `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    if "b" not in mode and encoding is None:
        encoding = "utf-8"
    target = _resolve(path)
    if _special(target):  # /dev/null, a pipe: no rename over it
        try:
            with open(target, mode, encoding=encoding) as fh:
                yield fh
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
        return
    try:
        fd, tmp = _temp_in(target.parent, target.name)
    except IsADirectoryError:
        raise OutputError(f"cannot write {path}: is a directory") from None
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
    if target.is_dir():
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: is a directory")
    try:
        with os.fdopen(fd, mode, encoding=encoding) as fh:
            yield fh
        try:
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        except FileNotFoundError:
            pass
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {_reason(exc)}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`data` written to `path` whole, or not at all (`OutputError`)."""
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) written to `path` whole, or not at all (`OutputError`)."""
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def save_npy(path: str | os.PathLike, array) -> None:
    """`array` saved as .npy to exactly `path` (no `.npy` is added to a name without it, unlike
    `numpy.save` given a name), whole or not at all (`OutputError`)."""
    import numpy as np
    with atomic_open(path, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def ignore_file_size_signal() -> None:
    """Have a write past the file-size limit (`ulimit -f`) fail with EFBIG, an `OSError` the
    writers above turn into one line, instead of SIGXFSZ killing the process mid-write. Call
    from the main thread (the command line does at start); elsewhere it does nothing."""
    import signal
    import threading
    sig = getattr(signal, "SIGXFSZ", None)
    if sig is not None and threading.current_thread() is threading.main_thread():
        signal.signal(sig, signal.SIG_IGN)
