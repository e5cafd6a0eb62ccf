"""The vector ISA the CPU kernels are generated for, and the g++ flags that go with it.

The contraction templates (``cpp_kernels``) are written for a vector of ``lanes`` fp32 values
and register tiles sized to ``registers`` vector registers. Two variants:

* ``avx2``: 8 lanes (one ymm register), 16 registers;
* ``avx512``: 16 lanes (one zmm register), 32 registers.

By default the variant follows the compiler's view of this CPU (``g++ -march=native`` with
``-mavx512f`` enabled -> avx512, else avx2) and the step is compiled with ``-march=native``.
``EMBER_CPU_VECTOR=avx2|avx512`` forces one; a forced variant that is not the native one is
compiled for the matching x86-64 level (``-march=x86-64-v3`` / ``-march=x86-64-v4``, tuned for
this CPU), so the AVX-512 variant can be built (and its source tested) on any x86-64 machine
with g++; running it needs a CPU with AVX-512F (``host_supports``).

The choice changes the source (vector width, tiles, scratch sizes), so it is read once per
rendering of a step and recorded on it; select (scratch sizes) and the step renderer resolve it
from the same environment.

bfloat16 contractions (``cpp_bf16``) multiply pairs of bfloat16 with ``vdpbf16ps``
(``_mm512_dpbf16_ps``) where the avx512 variant is native and the compiler enables
``-mavx512bf16`` for this CPU (``bf16_dot``: "avx512bf16"), else with the same arithmetic in
float32 FMAs ("emulated", any variant). ``EMBER_CPU_BF16=emulated|avx512bf16`` forces one (a
forced "avx512bf16" needs the avx512 variant; the step is then built with ``-mavx512bf16``, so
its source compiles anywhere, and running it needs a CPU with AVX512-BF16). The choice is part of
each bfloat16 kernel's geometry, so dumps show it (``bf16_dot`` in the choice's key) and the
tuning database keys it.

Where the CPU also has AMX (``amx_bf16`` and ``amx_tile``, and Linux grants this process the tile
state) ``bf16_dot`` is "amx": the same ``vdpbf16ps`` for the vector modes, and the bfloat16 GEMM
mode may multiply on the AMX tiles (``cpp_bf16``'s "amx" mode, chosen like any plan).
``EMBER_CPU_BF16=amx`` forces it (the step is built with ``-mamx-tile -mamx-bf16 -mavx512bf16``;
running an "amx" plan needs such a CPU); the "amx" mode rendered for "emulated" products runs the
tile instructions in scalar C++ (tests: the same packing and tile order on any CPU).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from .compiler import DEFAULT_CXX_FLAGS, native_target_enables

__all__ = ["AVX2", "AVX512", "ENV_VAR", "VARIANTS", "VectorISA", "cxx_flags", "host_supports",
           "native_isa", "resolve", "BF16_ENV_VAR", "BF16_DOTS", "bf16_dot", "bf16_flags", "native_amx"]

#: Environment variable that forces a variant ("avx2", "avx512"; "", "auto" or "native": follow
#: the compiler's -march=native).
ENV_VAR = "EMBER_CPU_VECTOR"


@dataclass(frozen=True)
class VectorISA:
    name: str                    # the variant's name, as EMBER_CPU_VECTOR spells it
    lanes: int                   # fp32 lanes of one vector register
    registers: int               # architectural vector registers the register tiles may fill
    march: tuple[str, ...]       # flags that select it when it is forced and not native
    cpu_flag: str                # /proc/cpuinfo flag a CPU needs to run it
    compiler_option: str         # -m option that `-march=native -Q --help=target` reports enabled

    @property
    def vector_bytes(self) -> int:
        return 4 * self.lanes


AVX2 = VectorISA("avx2", 8, 16, ("-march=x86-64-v3", "-mtune=native"), "avx2", "-mavx2")
AVX512 = VectorISA("avx512", 16, 32, ("-march=x86-64-v4", "-mtune=native"), "avx512f", "-mavx512f")
VARIANTS: dict[str, VectorISA] = {v.name: v for v in (AVX2, AVX512)}
_NATIVE_WORDS = ("", "auto", "native")


def native_isa() -> VectorISA:
    """The variant ``-march=native`` gives: avx512 where the compiler enables -mavx512f for this
    CPU, avx2 otherwise (also on CPUs without AVX2, where the 8-lane vectors still compile, as
    pairs of SSE registers or scalars). Without a compiler to ask (a step cached earlier can
    still load), /proc/cpuinfo decides."""
    enabled = native_target_enables(AVX512.compiler_option)
    if enabled is None:
        enabled = AVX512.cpu_flag in _cpu_flags()
    return AVX512 if enabled else AVX2


def _cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where the file cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return set()


def resolve(choice: str | None = None) -> VectorISA:
    """The variant to generate: ``choice`` if given, else ``$EMBER_CPU_VECTOR``, else native."""
    word = (os.environ.get(ENV_VAR, "") if choice is None else choice).strip().lower()
    if word in _NATIVE_WORDS:
        return native_isa()
    if word not in VARIANTS:
        raise ValueError(f"{ENV_VAR}={word!r} is not a CPU vector variant; choose one of "
                         f"{', '.join(VARIANTS)} (or 'native' to follow g++ -march=native)")
    return VARIANTS[word]


#: Environment variable that forces how bfloat16 pairs are multiplied ("emulated", "avx512bf16";
#: "", "auto" or "native": the instruction where the native avx512 variant has it)
BF16_ENV_VAR = "EMBER_CPU_BF16"
BF16_DOTS = ("amx", "avx512bf16", "emulated")
_BF16_OPTION, _BF16_CPU_FLAG = "-mavx512bf16", "avx512_bf16"
_AMX_OPTIONS, _AMX_CPU_FLAGS = ("-mamx-tile", "-mamx-bf16"), {"amx_tile", "amx_bf16"}
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux gives a process the AMX tile state
# only on request (the kernels ask again as their library loads)
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def native_bf16() -> bool:
    """Whether ``-march=native`` enables AVX512-BF16 here (the compiler's view; /proc/cpuinfo when
    there is no compiler to ask)."""
    enabled = native_target_enables(_BF16_OPTION)
    return _BF16_CPU_FLAG in _cpu_flags() if enabled is None else enabled


@functools.lru_cache(maxsize=4)
def native_amx(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether the CPU has the AMX bfloat16 tiles and Linux grants this process their state (asked
    once a process)."""
    if not _AMX_CPU_FLAGS <= _cpu_flags(cpuinfo):
        return False
    return _request_tile_state()


def _request_tile_state() -> bool:
    import ctypes  # only on a CPU that lists AMX
    try:
        args = map(ctypes.c_long, (_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA))  # syscall reads longs
        return ctypes.CDLL(None, use_errno=True).syscall(*args) == 0
    except (OSError, AttributeError):
        return False


def bf16_dot(isa: VectorISA, choice: str | None = None) -> str:
    """How the bfloat16 kernels generated for ``isa`` multiply pairs: ``choice`` if given, else
    ``$EMBER_CPU_BF16``, else "amx" where ``isa`` is the native avx512 and the CPU has AVX512-BF16
    and AMX, "avx512bf16" where it has AVX512-BF16, "emulated" otherwise."""
    word = (os.environ.get(BF16_ENV_VAR, "") if choice is None else choice).strip().lower()
    if word in _NATIVE_WORDS:
        if not (isa == AVX512 and isa == native_isa() and native_bf16()):
            return "emulated"
        return "amx" if native_amx() else "avx512bf16"
    if word not in BF16_DOTS:
        raise ValueError(f"{BF16_ENV_VAR}={word!r}: choose one of {', '.join(BF16_DOTS)} (or 'native')")
    if word in ("avx512bf16", "amx") and isa != AVX512:
        raise ValueError(f"{BF16_ENV_VAR}={word} needs the avx512 vector variant, not {isa.name} "
                         f"(set {ENV_VAR}=avx512 too, or {BF16_ENV_VAR}=emulated)")
    return word


def bf16_flags(isa: VectorISA, dots: set[str]) -> tuple[str, ...]:
    """What a step whose bfloat16 kernels use ``dots`` adds to ``cxx_flags(isa)``: -mavx512bf16
    where the instruction is used (by "avx512bf16" and "amx") and -mamx-tile -mamx-bf16 where the
    tiles are, when the flags (a forced, non-native variant) do not enable them."""
    native = isa == native_isa()
    flags: tuple[str, ...] = ()
    if dots & {"avx512bf16", "amx"} and not (native and native_bf16()):
        flags += (_BF16_OPTION,)
    if "amx" in dots and not (native and all(native_target_enables(o) for o in _AMX_OPTIONS)):
        flags += _AMX_OPTIONS
    return flags


def cxx_flags(isa: VectorISA, base: tuple[str, ...] = DEFAULT_CXX_FLAGS) -> tuple[str, ...]:
    """``base`` (which says ``-march=native``) for the native variant, so forcing the native
    variant builds exactly what the default builds; for another variant, ``-march=native`` is
    replaced by the variant's x86-64 level (the code must not use what this CPU has beyond it)."""
    if isa == native_isa():
        return tuple(base)
    out: list[str] = []
    for flag in base:
        out.extend(isa.march if flag == "-march=native" else (flag,))
    return tuple(out)


def auto_vector_flags(isa: VectorISA) -> tuple[str, ...]:
    """What the kernels left to g++'s auto-vectoriser (pointwise, reductions, pooling: the
    `cpp_units.CHEAP_KINDS`) add to ``cxx_flags(isa)``. g++ vectorises with 256-bit registers
    on CPUs whose tuning prefers them (-march=native on a Sapphire Rapids), even where the
    step's contractions are written for 16 lanes; 512-bit loops ran GELU's BatchNorm forward
    1.9 vs 2.9 ms and its backward 2.0 vs 3.2 ms (64x64x28x28, 2 Xeon threads). The
    contractions keep the step's flags: their loops are written in vectors, and their tuning
    records were measured with those flags."""
    return ("-mprefer-vector-width=512",) if isa.lanes == 16 else ()


def host_supports(isa: VectorISA, cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether this CPU can run code built for ``isa``: always for the native variant (built with
    -march=native, for this CPU, whatever it has); else its flag in /proc/cpuinfo (False where
    that file cannot be read)."""
    return isa == native_isa() or isa.cpu_flag in _cpu_flags(cpuinfo)
