"""Memory planning: buffer liveness and offsets in one arena, which holds the whole step's memory.

Runs on a fused, scheduled graph (it schedules first if `meta["schedule"]` is missing). Per node
it records `notes["storage"]`:
- "input" (with `notes["name"]` and `notes["offset"]`): a fixed arena buffer the runtime copies
  the call's argument into, so compiled code always reads the same addresses (what CUDA graph
  replay needs, and why a strided or temporary argument can never be read after it is freed);
- "parameter" / "state" (with `notes["name"]`): memory owned by the target's storage, either a
  source node or an update the schedule chose to write in place;
- "arena" (with `notes["offset"]`): a kernel result (a `fused_output` node is one: a further
  output of a multi-output kernel, live from that kernel on);
- "alias" (with `notes["alias_of"]`): a reshape, sharing its operand's buffer;
- "constant": a non-scalar constant, held by the runtime.
A fused node whose `KernelSpec` asks for scratch gets `notes["scratch_offset"]`: a block live only
while that kernel runs, or until the last kernel whose `notes["reads_scratch_of"]` ({launch role:
kernel}) names it (a relaid operand it holds: `share_relayouts`). `meta["arena_bytes"]` is the arena's size: the peak of simultaneously
live buffers, inputs and scratch included. `meta["liveness"]` maps each arena buffer to its
(first, last) schedule positions; scratch blocks are listed under `meta["scratch_liveness"]`.
Only a pointwise kernel is ever written in place (the schedule decides): a `collective` kernel's
result always gets an arena buffer of its own.
"""
from __future__ import annotations

from ember.ir import Graph

from .schedule import schedule as make_schedule

ALIGN = 64


def _align(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_memory(graph: Graph, alignment: int = ALIGN, reuse: bool = True) -> Graph:
    """The arena plan (see the module docstring). `reuse=False` gives every buffer memory of its
    own: a bigger arena, but no two kernels then share memory, so a target that runs independent
    kernels concurrently (CUDA streams) orders them only by their data."""
    out = (graph if "schedule" in graph.meta else make_schedule(graph)).copy()
    steps = out.meta["schedule"]
    position = {n: i for i, n in enumerate(steps)}

    # 1. Storage classes and aliases (in-place updates were decided by the schedule).
    base: dict[int, int] = {}
    for n in steps:
        op = out.op(n)
        notes = out.notes(n)
        if op == "input":
            notes.update(storage="input", name=out.attrs(n)["name"])
        elif op in ("parameter", "state"):
            notes.update(storage=op, name=out.attrs(n)["name"])
        elif op == "constant":
            notes.update(storage="constant")
        elif op == "reshape":
            (src,) = out.operands(n)
            notes.update(storage="alias", alias_of=src)
            base[n] = base[src]
            continue
        elif notes.get("storage") not in ("parameter", "state"):
            notes.update(storage="arena")
        base[n] = n

    # 2. Liveness: from the kernel that writes a buffer (inputs: the start of the call) to the last
    # kernel that reads it, through aliases; outputs and copied-back updates live to the end.
    end = len(steps)
    live: dict[int, list[int]] = {}
    for n in steps:
        storage = out.notes(n)["storage"]
        if storage in ("arena", "input"):
            # a kernel's further output (fused_output) is written while its kernel runs: it must
            # not share memory with anything that kernel reads
            writer = out.operands(n)[0] if out.op(n) == "fused_output" else n
            start = -1 if storage == "input" else position[writer]
            live[n] = [start, position[n]]
    for n in steps:
        for o in out.operands(n):
            b = base[o]
            if b in live:
                live[b][1] = max(live[b][1], position[n])
    for n in list(out.outputs.values()) + list(out.updates.values()):
        if base[n] in live:
            live[base[n]][1] = end
    scratch: dict[int, tuple[int, int]] = {}
    for n in steps:
        if out.op(n) == "fused" and out.attrs(n)["kernel"].scratch_bytes > 0:
            scratch[n] = (position[n], position[n])
    for n in steps:  # a kernel reading another's scratch (a relaid operand: share_relayouts) keeps it live
        for owner in out.notes(n).get("reads_scratch_of", {}).values():
            if owner not in scratch or position[owner] >= position[n]:
                raise AssertionError(f"%{n} reads the scratch of %{owner}, which is not a kernel with scratch "
                                     f"scheduled before it")
            scratch[owner] = (scratch[owner][0], max(scratch[owner][1], position[n]))

    # 3. Offsets: largest first, each at the lowest aligned offset free over its lifetime.
    buffers = [(("buffer", n), tuple(live[n]), out.type(n).nbytes) for n in live]
    buffers += [(("scratch", n), scratch[n], out.attrs(n)["kernel"].scratch_bytes) for n in scratch]
    placed: list[tuple[int, int, int, int]] = []  # (start, stop, offset, size)
    for (what, n), (start, stop), nbytes in sorted(buffers, key=lambda b: (-b[2], b[1][0], b[0])):
        size = _align(max(nbytes, 1), alignment)
        busy = sorted((off, off + sz) for s, e, off, sz in placed if not reuse or not (e < start or stop < s))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, _align(hi, alignment))
        placed.append((start, stop, offset, size))
        out.notes(n)["offset" if what == "buffer" else "scratch_offset"] = offset
    arena = max((off + sz for _, _, off, sz in placed), default=0)
    out.meta.update(arena_bytes=arena, liveness={n: tuple(v) for n, v in live.items()}, scratch_liveness=scratch,
                    buffer_bytes_total=sum(sz for *_, sz in placed), alignment=alignment)
    return out


def check_plan(graph: Graph) -> None:
    """Raises AssertionError if two arena blocks (buffers or scratch) live at the same time overlap."""
    align = graph.meta.get("alignment", ALIGN)
    items = [(n, *graph.meta["liveness"][n], graph.notes(n)["offset"], graph.type(n).nbytes)
             for n in graph.meta["liveness"]]
    items += [(f"scratch of %{n}", *graph.meta["scratch_liveness"][n], graph.notes(n)["scratch_offset"],
               graph.attrs(n)["kernel"].scratch_bytes) for n in graph.meta.get("scratch_liveness", {})]
    for i, (a, s1, e1, o1, z1) in enumerate(items):
        assert o1 % align == 0, f"%{a} offset {o1} not {align}-byte aligned"
        assert o1 + z1 <= graph.meta["arena_bytes"]
        for b, s2, e2, o2, z2 in items[i + 1:]:
            if not (e1 < s2 or e2 < s1):
                assert o1 + z1 <= o2 or o2 + z2 <= o1, f"%{a} and %{b} are live together and overlap"
