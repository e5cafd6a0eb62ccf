"""Small shape arithmetic the template renderers of every target share: integer rounding, the
(stride, padding) pairs of a convolution and the checks of a renderer's arguments."""
from __future__ import annotations


def pair(v, what: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair (`what` names the argument in errors)."""
    if isinstance(v, int):
        v = (v, v)
    a, b = (int(t) for t in v)
    return a, b


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def check_positive(**dims: int) -> None:
    """Raises ValueError naming the first dimension below 1."""
    for k, v in dims.items():
        if int(v) < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")
