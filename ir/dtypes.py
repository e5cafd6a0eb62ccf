"""Element types and tensor types.

A dtype is a small frozen record rather than a NumPy dtype so that the IR can name types NumPy
lacks (bfloat16) and so that every backend reads its own spelling (C type, short printer name)
from one place.

bfloat16 has no NumPy dtype. Its values are held two ways: as their bits in `uint16` arrays (its
`numpy` dtype: what a constant node, a buffer in memory and a checkpoint hold, 2 bytes each) and,
while the interpreter computes, as float32 arrays whose every element is a bfloat16 value (its
`compute` dtype: float32 holds every bfloat16 exactly). `round_bf16` rounds to the nearest
bfloat16 (ties to even, as PyTorch and the hardware conversions do; NaN stays NaN, overflow gives
inf); `as_array` and `as_values` convert between a value and its held form for any dtype. So a
`uint16` array given to ember is read as bfloat16 bits (ember has no 16-bit integer type).
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
    numpy_name: str  # the NumPy dtype of arrays holding its values (bfloat16: its bits, uint16)
    compute_name: str | None = None  # the NumPy dtype the interpreter computes it in, if not numpy_name

    @property
    def numpy(self) -> np.dtype:
        """The dtype of arrays that hold its values in memory (bfloat16: uint16 bits)."""
        return np.dtype(self.numpy_name)

    @property
    def compute(self) -> np.dtype:
        """The dtype the interpreter computes its values in (bfloat16: float32, rounded)."""
        return np.dtype(self.compute_name or self.numpy_name)

    def __repr__(self) -> str:
        return f"ember.{self.name}"


float32 = DType("float32", "f32", 4, True, "float", "float32")
float64 = DType("float64", "f64", 8, True, "double", "float64")
bfloat16 = DType("bfloat16", "bf16", 2, True, "__nv_bfloat16", "uint16", "float32")
int32 = DType("int32", "i32", 4, False, "int32_t", "int32")
int64 = DType("int64", "i64", 8, False, "int64_t", "int64")
bool_ = DType("bool", "bool", 1, False, "bool", "bool")

DTYPES: dict[str, DType] = {d.name: d for d in (float32, float64, bfloat16, int32, int64, bool_)}
_BY_NUMPY = {d.numpy_name: d for d in DTYPES.values()}


def round_bf16(x: np.ndarray) -> np.ndarray:
    """`x` (float32 or float64) rounded to the nearest bfloat16, ties to even, in x's dtype.
    A float64 value is rounded once (not through float32 first, which could round twice)."""
    x = np.asarray(x)
    if x.dtype == np.float64:
        near = x.astype(np.float32)
        bits = near.view(np.uint32)
        # a float32 exactly halfway between two bfloat16 values that is not x itself: the tie is
        # float32's rounding, so x lies on one side of it; move off the tie towards x
        tie = ((bits & 0xFFFF) == 0x8000) & (near.astype(np.float64) != x) & np.isfinite(x)
        if np.any(tie):
            toward = np.where((x > near.astype(np.float64)) == (near > 0), 1, -1).astype(np.int64)
            bits = np.where(tie, (bits.astype(np.int64) + toward).astype(np.uint32), bits)
            near = bits.view(np.float32)
        return bf16_values(bf16_bits(near)).astype(np.float64)
    return bf16_values(bf16_bits(x.astype(np.float32, copy=False)))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16) of the float32 values `x`, rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if np.any(nan):  # keep the sign, make it quiet (the rounding increment could carry into inf)
        rounded = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
    return rounded.reshape(np.shape(x))


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bits (uint16): exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_array(value: object, dtype: "DType | str") -> np.ndarray:
    """`value` held as `dtype` holds it in memory (bfloat16: the bits of its nearest value)."""
    dtype = as_dtype(dtype)
    if dtype.compute_name is None:
        return np.asarray(value, dtype=dtype.numpy)
    arr = np.asarray(value)
    if arr.dtype == dtype.numpy:  # already held
        return arr
    if arr.dtype == np.float64:
        return bf16_bits(round_bf16(arr).astype(np.float32))
    return bf16_bits(np.asarray(arr, dtype=np.float32))


def as_values(array: np.ndarray, dtype: "DType | str") -> np.ndarray:
    """The values held in `array` as `dtype` holds them, in its compute dtype (bfloat16: the
    float32 values of uint16 bits; a float array already holding values is rounded)."""
    dtype = as_dtype(dtype)
    arr = np.asarray(array)
    if dtype.compute_name is None:
        return arr.astype(dtype.numpy, copy=False)
    if arr.dtype == dtype.numpy:
        return bf16_values(arr)
    return round_bf16(arr.astype(np.float64 if arr.dtype == np.float64 else np.float32, copy=False))


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
