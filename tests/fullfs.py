"""A full disk for tests: a tiny tmpfs mounted under the test's temporary folder (root only; the
test is skipped where mounting is not permitted), and a filler that leaves exactly `room` bytes.

tmpfs counts whole pages, so `room` is rounded to the page size, and a write that crosses the
last free page is cut short by the kernel before the next one fails with ENOSPC: the partial
writes a real full disk makes.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

PAGE = os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def tiny_tmpfs(where: Path, size: int = 64 * 1024) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `where` (created), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command to make a small tmpfs")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or proc.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, room: int = 0) -> Path:
    """Fills `fs` with one file until only `room` bytes (rounded up to whole pages) are left."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        chunk = b"\0" * PAGE
        while True:
            os.write(fd, chunk)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    pages = -(-room // PAGE)
    os.truncate(filler, max(0, filler.stat().st_size - pages * PAGE))
    return filler
