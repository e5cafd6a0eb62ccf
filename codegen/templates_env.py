"""One Jinja environment per target, shared by that target's step renderer and its kernel
templates (templates live in `codegen/templates/<target>/`)."""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

TEMPLATES = Path(__file__).resolve().parent / "templates"


@functools.cache
def environment(target: str) -> jinja2.Environment:
    """The environment of `codegen/templates/<target>/`: undefined names are errors, and block
    tags leave no blank lines behind."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES / target)),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True)
