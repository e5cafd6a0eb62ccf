"""One Jinja environment per target, shared by that target's step renderer and its kernel
templates (templates live in `codegen/templates/<target>/`)."""
from __future__ import annotations

import functools
import io
import os
import tempfile
from pathlib import Path

import jinja2

from .compiler import cache_dir

TEMPLATES = Path(__file__).resolve().parent / "templates"


class _CompiledTemplates(jinja2.BytecodeCache):
    """Jinja's compiled templates kept under `$EMBER_CACHE_DIR/templates` (found by the template's
    name, checked against its source's checksum, as Jinja does), so a process does not compile the
    templates again before its first render: 0.05-0.2 s of a cold compile, or of a new batch size
    in a process whose first step came from the plan cache. The folder is looked up at each use
    (it follows $EMBER_CACHE_DIR); an entry that cannot be read or written is a miss."""

    def _path(self, bucket: jinja2.bccache.Bucket) -> Path:
        return cache_dir() / "templates" / f"{bucket.key}.jinja"

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            data = self._path(bucket).read_bytes()
        except OSError:
            return
        bucket.load_bytecode(io.BytesIO(data))  # a stale or damaged entry resets the bucket

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            path = self._path(bucket)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    bucket.write_bytecode(f)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError:
            pass  # a read-only or missing cache folder costs the compile next time, nothing else


@functools.cache
def environment(target: str) -> jinja2.Environment:
    """The environment of `codegen/templates/<target>/`: undefined names are errors, and block
    tags leave no blank lines behind."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES / target)),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True, bytecode_cache=_CompiledTemplates())
