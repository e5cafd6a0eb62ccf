"""The translation units of a CPU step: kernels named by their content, grouped into units that
compile in parallel and are cached one by one (`compiler.compile_units`).

One `g++ -O3` over a whole step's source was the cost of a cold compile (ResNet-8: 6.9 s of CPU
on one core, for 229 kernel calls). So a step is built as:

* one shared header, the prelude (`templates/cpp/prelude.j2`), named by its content;
* one unit per contraction kernel (convolutions, matmul: 0.1-0.3 s each), and the cheap kernels
  (pointwise, reductions, pooling: ~0.01 s each, less than a compiler process's start) in a few
  groups; a unit is compiled with the optimisation level its kind needs (`OPT_LEVELS`);
* the entry unit (`ember_step` or `ember_segment`: buffer locals and the calls in order).

A kernel's function is named `ek_<12 hex digits>` after a hash of its code with the name taken
out, so identical kernels (the same convolution twice) are one function called with different
buffers, and identical kernels of different steps (another batch size, a model that differs in
one layer) are one cached object. Unit contents depend on the kernels' code only, never on node
ids or source lines: those go in comments of the entry unit and of the dumped copies.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from .compiler import Unit
from .templates_env import environment

_ENV = environment("cpp")

#: -O level per kernel kind, measured with the kernel timers on -O2 and -O3 builds of one step
#: (g++ 12.2, 2-core Xeon; numbers in ARCHITECTURE.md "Building a CPU step"): -O2 runs ResNet-8's
#: convolutions 1.2-1.5x and reductions 1.15x slower; it compiles matmuls no faster; pointwise
#: kernels run as fast and compile ~10% faster, but a group of their own costs its start. The
#: entry only calls the kernels in order: -O1 compiles ResNet-8's in 0.06 s instead of 0.08.
OPT_LEVELS: dict[str, str] = {
    "conv2d": "-O3", "conv2d_grad_input": "-O3", "conv2d_grad_weight": "-O3", "matmul": "-O3",
    "max_pool2d": "-O3", "max_pool2d_grad": "-O3", "pointwise": "-O3", "reduction": "-O3",
    "entry": "-O1",
}
#: Kinds compiled several to a unit: their code is small, so a unit of its own would cost more
#: in starting the compiler (~0.02-0.035 s a unit) than in compiling (~0.01 s a kernel).
CHEAP_KINDS = frozenset({"pointwise", "reduction", "max_pool2d", "max_pool2d_grad"})
#: Cheap kernels go to one of this many groups by their name (a hash), so that a kernel that
#: changes rebuilds its group alone, and the groups keep both cores busy beside the contractions.
CHEAP_GROUPS = 4
#: g++ flags of the link (the objects carry everything else).
LINK_FLAGS: tuple[str, ...] = ("-shared", "-fopenmp")

_PLACEHOLDER = "@EMBER_KERNEL@"


@dataclass
class KernelFunction:
    """One generated function; `calls` are the step's calls of it (`cpp.KernelCode`)."""
    name: str              # ek_<hash of the code with the name taken out>
    kind: str              # KernelSpec.kind: sets the unit's -O level and grouping
    code: str              # its definition (EMBER_KERNEL: external linkage, hidden)
    declaration: str       # its prototype, for the entry unit
    calls: list = field(default_factory=list)

    @property
    def needs_std(self) -> bool:
        """Whether it calls std:: (math functions, numeric_limits): its unit includes <cmath>
        and <limits>, which the prelude leaves out for their parsing time."""
        return "std::" in self.code


def name_by_content(code: str, name: str) -> tuple[str, str, str]:
    """(function name, code, declaration) of a kernel rendered as `static void <name>(...)`:
    the name becomes `ek_<hash>` of the code without it, and the function external."""
    normal = _mark_name(code, name)
    fname = "ek_" + hashlib.sha256(normal.encode()).hexdigest()[:12]
    head = f"static void {_PLACEHOLDER}("
    if normal.count(head) != 1:
        raise AssertionError(f"{name}: expected one `static void {name}(` in its code, found {normal.count(head)}")
    start = normal.index(head) + len(head)
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(normal[end], 0)
        end += 1
    params = normal[start:end - 1]
    code = normal.replace(head, f"EMBER_KERNEL void {_PLACEHOLDER}(").replace(_PLACEHOLDER, fname)
    return fname, code, f"EMBER_KERNEL void {fname}({params.replace(_PLACEHOLDER, fname)});"


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PREFIX = "ember_k_"


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"  # what `\w` matches


def _mark_name(code: str, name: str) -> str:
    """`code` with every whole word `name` or `ember_k_<name>` turned into the placeholder (the
    prefix kept): `re.sub(r"\b(ember_k_)?<name>\b", ...)`, found with `str.find`, because
    the regex, which cannot skip ahead to a literal, cost more than the rest of naming."""
    if not _IDENT.fullmatch(name):
        return re.sub(rf"\b({_PREFIX})?{re.escape(name)}\b", lambda m: (m.group(1) or "") + _PLACEHOLDER, code)
    parts: list[str] = []
    done = 0  # code[:done] is in parts
    at = code.find(name)
    while at >= 0:
        end = at + len(name)
        if end == len(code) or not _is_word(code[end]):
            begin = at - len(_PREFIX)
            if begin >= done and code.startswith(_PREFIX, begin) and (begin == 0 or not _is_word(code[begin - 1])):
                parts += [code[done:begin], _PREFIX + _PLACEHOLDER]
                done = end
            elif at >= done and (at == 0 or not _is_word(code[at - 1])):
                parts += [code[done:at], _PLACEHOLDER]
                done = end
        at = code.find(name, max(at + 1, done))
    parts.append(code[done:])
    return "".join(parts)


def prelude(bf16: bool = False) -> tuple[str, str]:
    """(file name, text) of the header every unit includes; the name hashes the text. `bf16`: with
    the bfloat16 helpers (`templates/cpp/bf16.j2`; only steps that have bfloat16 values)."""
    text = _ENV.get_template("prelude.j2").render(bf16=bf16).rstrip("\n") + "\n"
    return f"ember_prelude_{hashlib.sha256(text.encode()).hexdigest()[:12]}.h", text


def _opt(flags: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """The step's flags for a unit of `kind`: its -O level, and no -shared (that is the link's)."""
    return tuple(OPT_LEVELS.get(kind, "-O3") if f.startswith("-O") else f for f in flags if f != "-shared")


def _call_notes(fn: KernelFunction) -> str:
    k0 = fn.calls[0]
    lines = [f"// ---- kernel {fn.name}: {k0.kind} -> {k0.out_type}; "
             f"{len(fn.calls)} call{'s' if len(fn.calls) > 1 else ''}"]
    for k in fn.calls:
        lines.append(f"// call {k.index} {k.name}")
        lines += [f"//   implements {line}" for line in k.implements]
    return "\n".join(lines) + "\n"


_STD = "#include <cmath>\n#include <limits>\n"


def _unit_source(header: str, fns: list[KernelFunction]) -> str:
    std = _STD if any(f.needs_std for f in fns) else ""
    return std + f'#include "{header}"\n\n' + "\n\n".join(f.code.strip("\n") for f in fns) + "\n"


def alone(fn: KernelFunction) -> bool:
    """Whether `fn` is compiled in a unit of its own (a contraction), not in a group."""
    return fn.kind not in CHEAP_KINDS


def alone_unit(header: str, fn: KernelFunction, flags: tuple[str, ...]) -> Unit:
    """The unit of a kernel compiled alone (`alone`): it depends on the kernel's code and the
    step's flags only, so it can be compiled as soon as the kernel is generated."""
    return Unit(fn.name, _unit_source(header, [fn]), _opt(flags, fn.kind), _call_notes(fn), ", ".join(k.name for k in fn.calls))


def kernel_units(functions: list[KernelFunction], header: str, flags: tuple[str, ...],
                 cheap_flags: tuple[str, ...] = ()) -> list[Unit]:
    """The kernels' units: a contraction alone, cheap kernels grouped (by -O level, by whether
    they call std::, and by name into CHEAP_GROUPS) and built with `cheap_flags` added
    (`cpu_vector.auto_vector_flags`); each unit's kernels in name order."""
    groups: dict[tuple, list[KernelFunction]] = {}
    for fn in sorted(functions, key=lambda f: f.name):
        if not alone(fn):
            bucket = -1 if fn.needs_std else int(fn.name[3:], 16) % CHEAP_GROUPS
            key = ("cheap", OPT_LEVELS.get(fn.kind, "-O3"), bucket)
        else:
            key = ("alone", fn.name)
        groups.setdefault(key, []).append(fn)
    units = []
    for key, fns in groups.items():
        if key[0] == "alone":
            units.append(alone_unit(header, fns[0], flags))
            continue
        source = _unit_source(header, fns)
        name = "eg_" + hashlib.sha256(source.encode()).hexdigest()[:12]
        what = ", ".join(f"{k.name}" for f in fns for k in f.calls)
        units.append(Unit(name, source, _opt(flags, fns[0].kind) + tuple(cheap_flags),
                          "".join(_call_notes(f) for f in fns), what))
    return units


def entry_preamble(header: str, functions: list[KernelFunction]) -> str:
    """What the entry unit puts before `extern "C"`: the prelude and the kernels' prototypes."""
    return f'#include "{header}"\n\n' + "\n".join(f.declaration for f in functions)


def single_source(header_text: str, functions: list[KernelFunction]) -> str:
    """The preamble of the one-file form of a step (`ember kernels`, `StepSource.code`): the
    prelude and every kernel's definition (with the calls it serves) in place of the include."""
    std = _STD if any(f.needs_std for f in functions) else ""
    return std + header_text + "\n" + "\n".join(_call_notes(f) + f.code.strip("\n") + "\n" for f in functions)


def step_units(entry_code: str, functions: list[KernelFunction], header: str,
               flags: tuple[str, ...], entry_note: str = "", cheap_flags: tuple[str, ...] = ()) -> list[Unit]:
    """All the units of a step, the entry first (compile_units dumps it as `<step>.cpp`, headed by
    `entry_note`); the cheap kernels' groups with `cheap_flags` added."""
    return [Unit("entry", entry_code, _opt(flags, "entry"), entry_note, "the step's entry: ember_step"),
            *kernel_units(functions, header, flags, cheap_flags)]
