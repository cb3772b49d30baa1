"""Disk space: whether a folder's disk can take what is about to be written, and telling a full disk
from other write errors (torch.save does not say "no space left"), for clear errors instead of a
traceback minutes into a run. Nothing here knows about runs or models beyond their tensors."""
from __future__ import annotations

import errno
import shutil
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from reflrl.errors import DiskSpaceError

__all__ = ["DiskSpaceError", "check_disk_space", "disk_full", "human_bytes", "release_frames", "tensor_bytes",
           "tree_bytes"]


def tensor_bytes(module: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Bytes of ``module``'s parameters (a tensor shared by two names, e.g. a tied embedding, once)."""
    seen: set[int] = set()
    n = 0
    for p in module.parameters():
        if (trainable_only and not p.requires_grad) or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        n += p.numel() * p.element_size()
    return n


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a folder), as their sizes say."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def human_bytes(n: float) -> str:
    """``n`` bytes for a message: GB from 1 GB up, MB below."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def check_disk_space(path: str | Path, need_bytes: int, what: str, *, hint: str = "",
                     disk_usage: Callable[[Path], Any] | None = None) -> int:
    """Raise :class:`DiskSpaceError` if the disk that holds (or will hold) ``path`` has less than
    ``need_bytes`` free; ``what`` says what needs them, ``hint`` what to do. Returns the free bytes.
    ``disk_usage`` (default ``shutil.disk_usage``) is asked for ``path``'s nearest existing folder."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = int((disk_usage or shutil.disk_usage)(where).free)
    if free < need_bytes:
        raise DiskSpaceError(errno.ENOSPC, f"not enough disk space for {what}: the disk of {path} has "
                                           f"{human_bytes(free)} free, about {human_bytes(need_bytes)} are needed"
                                           + (f"; {hint}" if hint else ""))
    return free


def disk_full(e: BaseException | None, path: Path, size: int) -> bool:
    """Did writing ``size`` bytes under ``path`` fail with "no space left on device" (``e``)?
    An OSError says so by its errno, safetensors' error in its message; torch.save's RuntimeError does
    not say it (torch 2.13: "unexpected pos ..."), so for it the disk's free space decides."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            return True
        if isinstance(e, RuntimeError):
            return shutil.disk_usage(path).free < size
        e = e.__cause__ or e.__context__
    return False


def release_frames(e: BaseException | None) -> None:
    """Clear the local variables of the frames in ``e``'s traceback and in those of the exceptions it
    was raised from, so that an error kept by a caller does not keep files open."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
