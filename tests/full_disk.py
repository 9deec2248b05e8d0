"""A folder on a full disk, for tests of writes that fail.

Where the test runs as root and may mount a tmpfs (and asks for one), the folder is a real one of a few MB that
`fill()` fills to the last byte. Elsewhere `fill()` patches the writers eagle_hf uses so that, inside the folder, they fail as they do on
a full disk (measured on a full tmpfs): no free space is left, a file opened for writing takes half of what is written and then raises
``OSError(28)``; ``torch.save`` leaves a partial file and raises torch's ``RuntimeError('[enforce fail at
inline_container.cc:672] . unexpected pos ...')``; safetensors leaves a partial file and raises ``SafetensorError('Error
while serializing: I/O error: No space left on device (os error 28)')``.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
from pathlib import Path


def _mount(folder: Path, size: str = "16m") -> bool:
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          check=False, capture_output=True)
    return done.returncode == 0


class _FullFile:
    """A file opened for writing on a full disk: half of the first write lands, then ENOSPC."""

    def __init__(self, real):
        self._real = real

    def write(self, data):
        self._real.write(data[: len(data) // 2])
        self._real.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()


class FullDisk:
    """`folder` has room until `fill()`; afterwards every write into it fails as on a full disk."""

    def __init__(self, folder: Path, monkeypatch, real: bool = True):
        self.folder = folder
        self.real = real and _mount(folder)
        self._monkeypatch = monkeypatch
        folder.mkdir(parents=True, exist_ok=True)

    def _inside(self, path) -> bool:
        try:
            return Path(os.fspath(path)).resolve().is_relative_to(self.folder.resolve())
        except TypeError:  # a file descriptor or a file object
            return False

    def fill(self) -> None:
        if self.real:  # the last byte of the tmpfs taken
            with open(self.folder / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
            return
        self._simulate()

    def _simulate(self) -> None:
        import safetensors.torch
        import torch
        import transformers.modeling_utils
        from safetensors import SafetensorError

        mp, inside = self._monkeypatch, self._inside
        real_open, real_save, real_st = builtins.open, torch.save, safetensors.torch.save_file

        def open_(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            if any(m in mode for m in "wax+") and inside(file):
                return _FullFile(handle)
            return handle

        def partial(path, n=100):
            with real_open(path, "wb") as f:
                f.write(b"\0" * n)

        def torch_save(obj, f, *args, **kwargs):
            if inside(f):
                partial(f)
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
            return real_save(obj, f, *args, **kwargs)

        def st_save(tensors, filename, *args, **kwargs):
            if inside(filename):
                partial(filename)
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_st(tensors, filename, *args, **kwargs)

        real_usage = shutil.disk_usage

        def disk_usage(path):
            usage = real_usage(path)
            return usage._replace(used=usage.total, free=0) if inside(path) else usage

        mp.setattr(shutil, "disk_usage", disk_usage)
        mp.setattr(builtins, "open", open_)
        mp.setattr(io, "open", open_)
        mp.setattr(torch, "save", torch_save)
        mp.setattr(safetensors.torch, "save_file", st_save)
        mp.setattr(transformers.modeling_utils, "safe_save_file", st_save)
        from eagle_hf.training import data

        mp.setattr(data, "save_file", st_save)

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.folder)], check=False, capture_output=True)
