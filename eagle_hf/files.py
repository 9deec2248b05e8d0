"""Writes that can fail: a full disk or a read-only folder is one clear error, never a half-written file.

Every file eagle_hf writes (the default target's converted copy, training states, logs and drafters, benchmark
results and plots) goes through `write_file` or `write_folder`: the content is written to a temporary name beside
its place and renamed over it only once complete. When the write fails, the temporary file is removed, the
previous file stays as it was, and a `WriteError` names the path and, for a full disk, the free space there and
about how much the write needs. `append_line` does the same for a line added to a log.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: words in the errors of writers that do not raise OSError (torch.save: "[enforce fail at inline_container.cc]
#: ... unexpected pos"; safetensors: "I/O error: No space left on device (os error 28)")
_IO_HINTS = ("no space left", "os error", "i/o error", "ioerror", "inline_container", "file write failed",
             "storagefull", "disk quota")


class WriteError(OSError):
    """A file eagle_hf could not write (a full disk, a read-only folder): the message names the path and what to
    do; the previous file at that path is unchanged."""

    def __str__(self) -> str:  # the message alone (an OSError's would start with "[Errno 28]")
        return str(self.strerror)


def write_file(path: str | os.PathLike, content: str | bytes | Callable[[Path], object], *,
               size: int | None = None) -> Path:
    """Write `path` whole or not at all: `content` (text, bytes, or a function that writes the file it is given)
    goes to a temporary file beside `path`, which then replaces it. `size`: about how many bytes it takes (for
    the message of a full disk; the text's own length by default)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if size is None and isinstance(content, (str, bytes)):
        size = len(content.encode() if isinstance(content, str) else content)
    with failing_write(path, tmp, size):
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            content(tmp)
        os.replace(tmp, path)
    return path


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """A matplotlib figure written to `path` (its format from the suffix) whole or not at all (`write_file`)."""
    path = Path(path)
    return write_file(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **savefig_kwargs))


def write_folder(path: str | os.PathLike, fill: Callable[[Path], object], *, size: int | None = None) -> Path:
    """Write the folder `path` whole or not at all: ``fill(tmp)`` writes into a new temporary folder beside it,
    which then takes its place (a previous folder is kept until then, as ``<name>.old``)."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    recover_folder(path)  # (a previous folder left between the renames is the one to keep)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    with failing_write(path, tmp, size):
        tmp.mkdir(parents=True)
        fill(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def recover_folder(path: str | os.PathLike) -> None:
    """After a stop between `write_folder`'s two renames: the previous folder (``<name>.old``) is put back."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        old.rename(path)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (and a newline) to the file `path`, unbuffered: a line that does not fit is cut back off, so
    the file keeps whole lines, and a `WriteError` names the file."""
    path = Path(path)
    data = memoryview((line + "\n").encode())
    with open(path, "ab", buffering=0) as f:  # (no buffer: nothing is left to flush, and fail, at close)
        start = f.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[f.write(data):]
        except OSError as err:
            try:  # whatever part of the line reached the disk is removed again
                f.truncate(start)
            except OSError:
                pass
            raise write_error(path, err, len(line) + 1) from err


@contextmanager
def failing_write(path: Path, tmp: Path, size: int | None = None) -> Iterator[None]:
    """Around a write of `path` through `tmp`: when it fails, `tmp` (a file or a folder) is removed and a failure
    to write becomes a `WriteError` naming `path`; any other error passes unchanged."""
    try:
        yield
    except BaseException as err:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if isinstance(err, Exception) and not isinstance(err, WriteError) and is_write_failure(err, path, size):
            raise write_error(path, err, size) from err
        raise


def is_write_failure(err: BaseException, path: Path, size: int | None = None) -> bool:
    """Whether `err` (raised while writing `path`) is the disk's or the folder's doing rather than a bug."""
    if isinstance(err, OSError):
        return True
    text = str(err).lower()
    return any(hint in text for hint in _IO_HINTS) or (size is not None and free_bytes(path) < size)


def write_error(path: Path, err: BaseException, size: int | None = None) -> WriteError:
    """The one-line error of a failed write of `path`: for a full disk, the free space and what is needed."""
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "no space left" in str(err).lower() \
        or (not isinstance(err, OSError) and (size is None or free_bytes(path) < size))
    previous = f" The previous {path.name} is unchanged." if path.exists() else ""
    if full:
        need = f", about {_human(size)} needed" if size else ""
        reason = f"no space left on its disk ({_human(free_bytes(path))} free there{need})"
        error = WriteError(errno.ENOSPC, f"Could not write {path}: {reason}. Free some space, or write to another "
                           f"folder.{previous}")
    else:
        reason = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
        error = WriteError(getattr(err, "errno", None) or errno.EIO,
                           f"Could not write {path}: {reason}. Check that the folder is writable.{previous}")
    error.reason = reason  # (the cause alone, for messages that name the path themselves)
    return error


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing folder)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors in `tensors` (a state dict, a module's parameters, nested dicts / lists of them): about
    what saving them takes."""
    import torch

    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(tensor_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)) or hasattr(tensors, "__next__"):
        return sum(tensor_bytes(v) for v in tensors)
    return 0


def _human(n: int | None) -> str:
    n = int(n or 0)
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            break
        n /= 1000
    return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
