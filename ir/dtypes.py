"""Element types and tensor types.

A dtype is a small frozen record rather than a NumPy dtype so that the IR can name types NumPy
lacks (bfloat16 is declared for later backends) and so that every backend reads its own spelling
(C type, short printer name) from one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    short: str
    itemsize: int
    is_float: bool
    ctype: str
    numpy_name: str | None  # None: declared, no NumPy equivalent yet

    @property
    def numpy(self) -> np.dtype:
        if self.numpy_name is None:
            raise NotImplementedError(f"dtype {self.name} has no NumPy equivalent yet (declared for later backends)")
        return np.dtype(self.numpy_name)

    def __repr__(self) -> str:
        return f"ember.{self.name}"


float32 = DType("float32", "f32", 4, True, "float", "float32")
float64 = DType("float64", "f64", 8, True, "double", "float64")
bfloat16 = DType("bfloat16", "bf16", 2, True, "__nv_bfloat16", None)
int32 = DType("int32", "i32", 4, False, "int32_t", "int32")
int64 = DType("int64", "i64", 8, False, "int64_t", "int64")
bool_ = DType("bool", "bool", 1, False, "bool", "bool")

DTYPES: dict[str, DType] = {d.name: d for d in (float32, float64, bfloat16, int32, int64, bool_)}
_BY_NUMPY = {d.numpy_name: d for d in DTYPES.values() if d.numpy_name}


def as_dtype(x: DType | str | np.dtype | type) -> DType:
    """Accepts an ember dtype, its name, or a NumPy dtype/scalar type."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in DTYPES:
        return DTYPES[x]
    try:
        name = np.dtype(x).name
    except TypeError:
        name = None
    if name in _BY_NUMPY:
        return _BY_NUMPY[name]
    raise TypeError(f"unsupported dtype {x!r}; expected one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: DType = float32

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape: tuple[int, ...]) -> "TensorType":
        return TensorType(shape, self.dtype)

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"

    @staticmethod
    def of(array: np.ndarray) -> "TensorType":
        return TensorType(np.shape(array), as_dtype(np.asarray(array).dtype))
