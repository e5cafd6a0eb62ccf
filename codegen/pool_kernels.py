"""Max pooling kernels for the code-generating targets: `max_pool2d` and its gradient, in C++ and
CUDA (templates `templates/<target>/max_pool2d.j2`).

Semantics are the interpreter's (PyTorch's): windows of `kernel` at `stride`, `padding` on both
sides counting as -inf, ceil_mode's overhanging last windows clipped to the input; a NaN in a
window is its maximum; the gradient goes to each window's first maximal element in row-major
order. Ties between a window's elements are common after a ReLU (all-zero windows), so "first"
must be exact: every kernel scans a window in row-major order with a strict `>`.

Determinism: no atomics. The C++ gradient scatters one (image, channel) plane per task, visiting
windows in row-major order; the CUDA gradient gathers, one thread an input element, summing the
windows that chose it in the same row-major order. Both add the cotangents of an element in the
order the interpreter's `np.add.at` does, so all three agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.ir.ops import pool_out_dim

from .cpp_kernels import MAX_THREADS, PARALLEL_MIN, KernelSource
from .cuda_kernels import CudaKernel, Launch
from .shapes import ceil_div, check_positive
from .templates_env import environment

POOL_KINDS = ("max_pool2d", "max_pool2d_grad")
CUDA_THREADS = 256


@dataclass(frozen=True)
class PoolGeometry:
    N: int
    C: int
    H: int
    W: int
    KH: int
    KW: int
    SH: int
    SW: int
    PH: int
    PW: int
    HO: int
    WO: int

    @property
    def tiles_exactly(self) -> bool:
        """Windows that cover the input once each (2x2 stride 2 on an even size, no padding)."""
        return (self.SH, self.SW, self.PH, self.PW) == (self.KH, self.KW, 0, 0) and \
            (self.HO * self.KH, self.WO * self.KW) == (self.H, self.W)

    @property
    def windows_inside(self) -> bool:
        """Whether every window lies inside the input (no padding, no ceil_mode overhang)."""
        return self.PH == 0 and self.PW == 0 and (self.HO - 1) * self.SH + self.KH <= self.H and \
            (self.WO - 1) * self.SW + self.KW <= self.W

    @property
    def windows_disjoint(self) -> bool:
        """Whether no input element lies in two windows (each window inside its stride's tile)."""
        return self.KH <= self.SH and self.KW <= self.SW and self.PH == 0 and self.PW == 0

    def context(self) -> dict[str, int]:
        return dict(self.__dict__)


GEOMETRY_FIELDS = tuple(PoolGeometry.__dataclass_fields__)


def geometry(x_shape: tuple[int, ...], attrs: dict[str, Any]) -> PoolGeometry:
    """The pooling of an NCHW input of `x_shape` under a max_pool2d node's attributes."""
    n, c, h, w = x_shape
    check_positive(N=n, C=c, H=h, W=w)
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    ceil = bool(attrs.get("ceil_mode", False))
    ho, wo = pool_out_dim(h, kh, sh, ph, ceil), pool_out_dim(w, kw, sw, pw, ceil)
    if ho < 1 or wo < 1:
        raise ValueError(f"empty pooling output ({ho}x{wo}) for input {h}x{w}, kernel {kh}x{kw}")
    if n * c * h * w >= 2**31 or n * c * ho * wo >= 2**31:
        raise ValueError("tensor too large for 32-bit indexing")  # the kernels index in int
    return PoolGeometry(n, c, h, w, kh, kw, sh, sw, ph, pw, ho, wo)


def _check_name(name: str) -> None:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")


def cpp_scratch_bytes(kind: str, g: PoolGeometry, bf16: bool = False) -> int:
    """Scratch of the C++ kernel: a bfloat16 gradient whose windows overlap sums each plane in
    float (one plane per thread, up to `MAX_THREADS`) before rounding it once; else none."""
    return 4 * MAX_THREADS * g.H * g.W if bf16 and kind == "max_pool2d_grad" and not g.tiles_exactly else 0


def render_cpp(name: str, kind: str, g: PoolGeometry, bf16: bool = False) -> tuple[KernelSource, list[str | None]]:
    """The C++ kernel of `kind` (on bfloat16 values with `bf16`) and its argument order as roles
    (then the step passes scratch)."""
    _check_name(name)
    if kind not in POOL_KINDS:
        raise ValueError(f"unknown pooling kernel {kind!r}; expected one of {POOL_KINDS}")
    # N is no part of the code (the kernel takes it at run time, and parallelises at run time)
    ctx = {k: v for k, v in g.context().items() if k != "N"}
    code = environment("cpp").get_template("max_pool2d.j2").render(
        name=name, grad=kind == "max_pool2d_grad", parallel_min=PARALLEL_MIN, tiled=g.tiles_exactly, inside=g.windows_inside, bf16=bf16,
        max_threads=MAX_THREADS, **ctx)
    return (KernelSource(name, code, cpp_scratch_bytes(kind, g, bf16), (g.N,)),
            (["x", "dy", "out"] if kind == "max_pool2d_grad" else ["x", "out"]))


def render_cuda(name: str, kind: str, g: PoolGeometry, bf16: bool = False, tile: bool = False,
                runtime_images: bool = False) -> CudaKernel:
    """The CUDA kernel of `kind` (on bfloat16 values with `bf16`): one thread an output (forward)
    or, for the gradient, an input element (summing in float, rounded once) or, with `tile` (windows
    that do not overlap), a window's tile of SH x SW inputs. `runtime_images`: the images N a
    by-value argument, so one text serves every batch size."""
    _check_name(name)
    if kind not in POOL_KINDS:
        raise ValueError(f"unknown pooling kernel {kind!r}; expected one of {POOL_KINDS}")
    grad = kind == "max_pool2d_grad"
    if tile and not (grad and g.windows_disjoint):
        raise ValueError(f"{name}: the tile mode is a gradient's, of windows that do not overlap; got {kind} with "
                         f"kernel {g.KH}x{g.KW}, stride {g.SH}x{g.SW}, padding {g.PH}x{g.PW}")
    code = environment("cuda").get_template("max_pool2d.j2").render(name=name, grad=grad, threads=CUDA_THREADS,
                                                                    bf16=bf16, tile=tile, runtime=runtime_images,
                                                                    **g.context())
    items = g.N * g.C * (ceil_div(g.H, g.SH) * ceil_div(g.W, g.SW) if tile else g.H * g.W if grad else g.HO * g.WO)
    function = f"{name}_{'grad' if grad else 'fwd'}"
    roles = ("x", "dy", "out") if grad else ("x", "out")
    scalars = (("int", g.N),) if runtime_images else ()
    return CudaKernel(name, code, (Launch(function, (ceil_div(items, CUDA_THREADS), 1, 1), (CUDA_THREADS, 1, 1), 0,
                                          roles, scalars),), 0)
