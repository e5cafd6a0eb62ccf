"""Kernel choice as data: the machinery every target's choice table shares.

A target's table (`cuda_choices`, `cpp_choices`) is a `ChoiceTable`: its kernel families, each a
`Family` entry (the kinds it serves, when it applies, its plans, its scratch from a plan, its
renderer, its version), and how a kernel's geometry is read off its fused subgraph. For one
kernel the table answers:

- `candidates`: every (family, plan) that can serve it, in the cost model's order (the families
  by what measured kernels of similar shapes say, `family_prior`, then by the table's structural
  preference and priority; each family's plans best first): what the tuner measures;
- `decide`: the one that serves it and why: a forced family (`force`, for experiments), else the
  tuning database's measurement for this kernel on this device (`tuning_db`), else the cost
  model's first candidate;
- `stamp`: that decision as the `select` pass records it on the kernel's spec (family, plan,
  scratch bytes, why), so dumps show it and codegen renders exactly it.

A plan is a tuple of (field, value) pairs, so it prints in a dump and stores in the database
as it is.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ember.ir import Graph, KernelSpec

from . import family_prior, tuning_db

Plan = tuple[tuple[str, Any], ...]  # a stamped plan: (field, value) pairs
Choice = tuple[str, Plan]            # (family, plan)
Geometry = dict[str, Any]


def _all_plans_valid(g: Geometry, plan: Plan) -> bool | None:
    return None  # "ask candidates"


def runtime(*keys: str) -> Callable[[Geometry], Geometry]:
    """`Family.code_geometry` of a family whose kernels take the sizes `keys` at run time."""
    def code(g: Geometry) -> Geometry:
        return {k: v for k, v in g.items() if k not in keys}
    return code


@dataclass(frozen=True)
class Family:
    name: str
    kinds: tuple[str, ...]
    #: rank among the preferred families (lower first); a family not preferred ranks after them all
    #: (the order where no measurement says otherwise: `family_prior`)
    priority: int
    #: geometry -> the cost model's plans, best first ([] where no plan fits the geometry)
    plans: Callable[[Geometry], list[Plan]]
    #: geometry -> None where the family applies, else why not (before any plan is sought)
    rejects: Callable[[Geometry], str | None]
    #: geometry -> whether it is structurally preferred to the families after it (a property of
    #: the geometry, never a measured size threshold: measurements rank families, `family_prior`)
    preferred: Callable[[Geometry], bool]
    #: (geometry, plan) -> scratch bytes
    scratch: Callable[[Geometry, Plan], int]
    #: (name, sub, spec, geometry, plan, epilogue) -> the kernel
    render: Callable[..., Any]
    #: geometry -> every plan the tuner measures (default: `plans`)
    tuning_plans: Callable[[Geometry], list[Plan]] | None = None
    #: (geometry, plan) -> whether a plan (from the database) fits this geometry; None: it must
    #: be one of `tuning_plans`
    accepts: Callable[[Geometry, Plan], bool | None] = _all_plans_valid
    #: bumped whenever the family's code or plan fields change: database records of another
    #: version are stale
    version: int = 1
    #: whether it serves grouped convolutions (a geometry with groups > 1); the others do not
    grouped: bool = False
    #: geometry -> the part of it its kernels' code depends on, where they take the rest at run
    #: time (the images N of a convolution, the rows M of a matmul: `runtime`): a plan of it
    #: serves any geometry with the same part, so a step of another batch size may take it
    #: (`reusable`, `decide(reuse=)`) and share the kernel. None (or None at a geometry): the code
    #: holds every size (there)
    code_geometry: Callable[[Geometry], Geometry | None] | None = None
    #: (geometry, plan) -> whether a plan of a step of another batch size fits this geometry, as
    #: the kernel renders a reused plan (its run-time sizes may let it take plans `accepts`
    #: refuses, e.g. a split count made for another length); None: `fits`
    accepts_reused: Callable[[Geometry, Plan], bool] | None = None
    #: the plan a step of another batch size stamps where it takes this kernel's own (the same
    #: kernel at another batch size; never another kernel's of the same code geometry): the
    #: generated kinds' kernels are rendered on run-time sizes there, where the first step of a
    #: model holds its sizes. None: the plan taken as it is, also from another kernel
    reused_plan: Plan | None = None
    #: plan -> the family's own plan, without the fields a later pass stamps on a chosen one (the
    #: grad-weights' image reads of `share_relayouts`): what the tuner measures and records. None:
    #: the plan as it is
    own_plan: Callable[[Plan], Plan] | None = None
    #: geometry -> the version of the code it renders there, where a change reached only some
    #: geometries (records of the others stay valid); None: `version` everywhere
    version_of: Callable[[Geometry], int] | None = None
    #: its plans name a `mode` whose speed differs in kind (a CPU convolution's flat or generic
    #: loops): the prior scores the family by its timings in the mode of the plan it would run
    #: (`family_prior`). Only such families' plans are asked for while ranking (some families'
    #: plan lists cost seconds a step to enumerate)
    modal: bool = False

    def version_at(self, g: Geometry) -> int:
        return self.version_of(g) if self.version_of is not None else self.version

    def all_plans(self, g: Geometry) -> list[Plan]:
        return (self.tuning_plans or self.plans)(g)

    def fits(self, g: Geometry, plan: Plan) -> bool:
        ok = self.accepts(g, plan)
        return plan in self.all_plans(g) if ok is None else ok

    def fits_reused(self, g: Geometry, plan: Plan) -> bool:
        if self.reused_plan is not None and plan == self.reused_plan:
            return True
        return self.accepts_reused(g, plan) if self.accepts_reused is not None else self.fits(g, plan)

    def runtime_code(self, g: Geometry) -> Geometry | None:
        """`code_geometry` at g: None where the family's code there holds every size."""
        return None if self.code_geometry is None else self.code_geometry(g)

    def as_reused(self, plan: Plan) -> Plan:
        """The plan a step of another batch size runs where it takes `plan` from a step of this one."""
        return self.reused_plan if self.reused_plan is not None else plan


@dataclass(frozen=True)
class Decision:
    choice: Choice
    #: one line: "cost model", "forced", or the database record's summary
    why: str
    record: tuning_db.Record | None = None


@dataclass
class ChoiceTable:
    #: the target's name as the tuning database keys it ("cuda", "cpu")
    target: str
    families: dict[str, Family]
    #: (sub, spec) -> the kernel's geometry: `kind`, `epilogues`, sizes, precision
    geometry: Callable[[Graph, KernelSpec], Geometry]
    #: () -> the device model the choices are for (the tuning database's second key)
    device: Callable[[], str]
    #: contraction kind -> epilogues its templates take (others: "pointwise" only)
    epilogues: dict[str, frozenset[str]] = field(default_factory=dict)
    #: kinds that are no kernel (collectives): `stamp` answers None
    no_kernel: frozenset[str] = frozenset({"collective"})
    #: geometry -> where the kernel sits among measured ones (`family_prior`); None: no prior
    features: family_prior.Features | None = None

    def __post_init__(self) -> None:
        self._forced: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar(
            f"ember_{self.target}_forced", default={})

    # -- forcing (experiments)

    @contextlib.contextmanager
    def force(self, family: str | None = None, **kinds: str) -> Iterator[None]:
        """Within the block, kernels are served by a given family (experiments, comparisons):
        `force("gemm")` for every kind the family serves, `force(matmul="thin")` per kind. A
        kernel the forced family cannot serve is refused with one line when it is compiled."""
        wanted = dict(kinds)
        if family is not None:
            if family not in self.families:
                raise ValueError(f"no {self._label} kernel family {family!r} (known: {', '.join(self.families)})")
            wanted.update({k: family for k in self.families[family].kinds if k not in kinds})
        for kind, name in wanted.items():
            if name not in self.families or kind not in self.families[name].kinds:
                raise ValueError(f"{self._label} kernel family {name!r} does not serve {kind} kernels")
        token = self._forced.set({**self._forced.get(), **wanted})
        try:
            yield
        finally:
            self._forced.reset(token)

    def forced(self) -> dict[str, str]:
        """The families `force` holds kernels to here (kind -> family; empty outside a block)."""
        return dict(self._forced.get())

    @property
    def _label(self) -> str:
        return {"cuda": "CUDA", "cpu": "CPU"}.get(self.target, self.target)

    # -- the table

    def applies(self, f: Family, g: Geometry) -> str | None:
        if g["kind"] not in f.kinds:
            return f"it serves {', '.join(f.kinds)}"
        if g.get("groups", 1) != 1 and not f.grouped:
            return "it serves ungrouped convolutions only"
        if unknown := [e for e in g["epilogues"] if e not in self.epilogues.get(g["kind"], {"pointwise"})]:
            return f"no {', '.join(unknown)} epilogue"
        return f.rejects(g)

    def ranked(self, g: Geometry, db: Any = ...) -> list[Family]:
        """The families that serve the kernel, in the cost model's order."""
        return self._ranked(g, db)[0]

    def _ranked(self, g: Geometry, db: Any = ...) -> tuple[list[Family], family_prior.Prior | None]:
        """The families in the cost model's order, and the prior that ordered them (None: the
        table's structural order, no measurement of a similar kernel compared them)."""
        def prior(versions: dict[str, int], modes: dict[str, str | None]) -> family_prior.Prior | None:
            return family_prior.predict_for(tuning_db.active() if db is ... else db, self.target, self.device(), g,
                                            versions, self.features, modes)
        return self._ordered(g, prior)

    def ranked_from(self, g: Geometry, records: family_prior.Sample) -> tuple[list[Family], family_prior.Prior | None]:
        """`_ranked` with the prior learned from `records` alone (`tools/cost_model_check.py`:
        the cost model's pick with a kernel's own record left out)."""
        return self._ordered(g, lambda versions, modes: family_prior.predict(records, g, versions, self.features,
                                                                             modes))

    def _ordered(self, g: Geometry, predict: Callable[..., family_prior.Prior | None]
                 ) -> tuple[list[Family], family_prior.Prior | None]:
        fams = [f for f in self.families.values() if g["kind"] in f.kinds and self.applies(f, g) is None]
        fams.sort(key=lambda f: (not f.preferred(g), f.priority))
        if len(fams) < 2 or self.features is None:
            return fams, None
        modes = {f.name: family_prior.plan_mode(plans[0]) for f in fams if f.modal and (plans := f.plans(g))}
        prior = predict({f.name: f.version_at(g) for f in fams}, modes)
        if prior is None:
            return fams, None
        known = sorted((f for f in fams if f.name in prior.scores), key=lambda f: prior.order_key(f.name))
        return known + [f for f in fams if f.name not in prior.scores], prior

    def _geometry(self, sub: Graph, spec: KernelSpec) -> Geometry:
        if not any(spec.kind in f.kinds for f in self.families.values()):
            raise NotImplementedError(f"no {self._label} template for kernel kind {spec.kind!r}")
        return self.geometry(sub, spec)

    def candidates(self, sub: Graph, spec: KernelSpec) -> list[Choice]:
        """Every (family, plan) that can serve this kernel, the cost model's first."""
        g = self._geometry(sub, spec)
        return [(f.name, p) for f in self.ranked(g) for p in f.all_plans(g)]

    def fits(self, sub: Graph, spec: KernelSpec, choice: Choice) -> bool:
        """Whether a stored choice (a tuning record's) still serves this kernel as `decide` takes
        it: its family exists and takes the plan as it is (a family whose GEMM view of the kernel
        changed refuses the plans measured for the old one)."""
        f = self.families.get(choice[0])
        return f is not None and f.fits(self._geometry(sub, spec), choice[1])

    def own_choice(self, choice: Choice) -> Choice:
        """A stamped choice as its family measures it (`Family.own_plan`)."""
        f = self.families.get(choice[0])
        return choice if f is None or f.own_plan is None else (choice[0], f.own_plan(choice[1]))

    def key(self, sub: Graph, spec: KernelSpec) -> str:
        """The kernel's key in the tuning database."""
        return tuning_db.kernel_key(self._geometry(sub, spec))

    def versions(self, sub: Graph, spec: KernelSpec) -> dict[str, int]:
        """The version of every family that applies to this kernel (its candidates' families):
        what a record must match, and what the tuner writes in one. Not every family of the kind:
        a float32 kernel's record must not go stale when the bfloat16 family (which serves the
        same kinds but never a float32 kernel) changes."""
        g = self._geometry(sub, spec)
        return {f.name: f.version_at(g) for f in self.families.values() if self.applies(f, g) is None}

    def reuse_key(self, f: Family, g: Geometry) -> str:
        """A kernel's key among the plans a step shares with steps of other batch sizes: its
        geometry without the sizes its family takes at run time."""
        return f"{f.name}:" + tuning_db.kernel_key(f.runtime_code(g))

    def reusable(self, graph: Graph) -> tuple[tuple[str, Plan], ...]:
        """(reuse key, plan) of every kernel of a selected graph whose family takes its
        batch-dependent sizes at run time: what `decide(reuse=)` of a step of another batch size
        takes, so that its kernels are the same code. Each kernel is there under its name and key
        (the same graph at another batch size names its kernels alike) and, the first of a key,
        under the key alone (another graph: inference beside training). A kernel of a kind whose
        general family renders on run-time sizes (`reused_plan`) is there as that family's
        whichever served it here (a column sum row by row): a later step runs it on run-time
        sizes."""
        out: dict[str, Plan] = {}
        for n in graph.topo_order():
            if graph.op(n) != "fused" or (spec := graph.attrs(n)["kernel"]).choice is None:
                continue
            sub = graph.attrs(n)["graph"]
            if (reused := self.reused_choice(sub, spec)) is None:
                continue
            f, plan = reused
            key = self.reuse_key(f, self._geometry(sub, spec))
            out.setdefault(f"{sub.name}@{key}", plan)
            if f.reused_plan is None and f.name == spec.choice[0]:
                out.setdefault(key, plan)
        return tuple(out.items())

    def reused_choice(self, sub: Graph, spec: KernelSpec) -> tuple[Family, Plan] | None:
        """The (family, plan) a step of this model at another batch size takes for this chosen
        kernel (`reusable`, `decide(reuse=)`): its own, where its family takes the batch-dependent
        sizes at run time; a generated kind's general family on run-time sizes, whichever family
        served it here (a column sum row by row); else the first-ranked family that takes them,
        with its best plan here (a Winograd convolution's later batch sizes run the GEMM on
        run-time sizes, which the first step builds ahead, not a Winograd kernel of their own:
        a step of the last partial batch is worth no compile); None where no family does."""
        f = self.families.get(spec.choice[0]) if spec.choice is not None else None
        if f is None:
            return None
        g = self._geometry(sub, spec)
        if f.runtime_code(g) is not None:
            return f, spec.choice[1]
        for h in self.families.values():
            if h.reused_plan is not None and spec.kind in h.kinds:
                return h, h.reused_plan
        for h in self._ranked(g)[0]:
            if h.runtime_code(g) is not None and (plans := h.plans(g)):
                return h, plans[0]
        return None

    def decide(self, sub: Graph, spec: KernelSpec, db: Any = ..., reuse: Any = ()) -> Decision:
        """The (family, plan) that serves this kernel, and why. `db`: the tuning database to read
        (default: the active one; None: none). `reuse`: `reusable` of a step of this model at
        another batch size, whose plan for this kernel (where it has one that fits) comes before
        the database and the cost model."""
        return self._decide(sub, spec, self._geometry(sub, spec), db, reuse)

    def _decide(self, sub: Graph, spec: KernelSpec, g: Geometry, db: Any, reuse: Any) -> Decision:
        forced = self._forced.get().get(spec.kind)
        if forced is not None:
            f = self.families[forced]
            reason = self.applies(f, g) or (None if (plans := f.plans(g)) else "no plan of it fits the geometry")
            if reason is not None:
                raise ValueError(f"kernel {sub.name} ({spec.describe()}): forced family {forced!r} does not apply: "
                                 f"{reason}")
            return Decision((forced, plans[0]), "forced")
        db = tuning_db.active() if db is ... else db
        ranked, prior = self._ranked(g, db)
        if reuse:
            # this kernel's own plan first, whichever family it is (so it stays the same code),
            # then any kernel's of the same code geometry (inference beside training)
            shared = dict(reuse)
            keys = [(f, self.reuse_key(f, g)) for f in ranked if f.runtime_code(g) is not None]
            for own in (True, False):
                for f, key in keys:
                    if not own and f.reused_plan is not None:
                        continue  # a generated kernel's code is its own subgraph: no other kernel's plan makes it shared
                    plan = shared.get(f"{sub.name}@{key}" if own else key)
                    if plan is not None and f.fits_reused(g, plan):
                        return Decision((f.name, f.as_reused(plan)), "reused: the plan of this kernel at another batch size"
                                        if own else "reused: the plan of a kernel of the same code")
        if db is not None and (len(ranked) > 1 or any(f.tuning_plans is not None for f in ranked)):
            key, versions = tuning_db.kernel_key(g), self.versions(sub, spec)
            rec = db.lookup(self.target, self.device(), key, versions)
            if rec is not None:
                family, plan = rec.choice
                f = self.families.get(family)
                if f is not None and f in ranked and f.fits(g, plan):
                    return Decision(rec.choice, rec.summary(), rec)
            # the same sizes tuned with other epilogues (a store in another dtype, a bias): the
            # measured plan of the same main loop, where its family serves this kernel too
            sibling = db.lookup_other_epilogues(self.target, self.device(), key, versions)
            if sibling is not None:
                (family, plan), eps = sibling[0].choice, sibling[1]
                f = self.families.get(family)
                if f is not None and f in ranked and f.fits(g, plan):
                    return Decision((family, plan), f"{sibling[0].summary()} with epilogues "
                                    f"[{', '.join(sorted(eps)) or 'none'}]")
        for f in ranked:
            if plans := f.plans(g):
                return Decision((f.name, plans[0]), "cost model" + (f" ({prior.describe()})" if prior else ""))
        raise NotImplementedError(f"no {self._label} kernel family serves {spec.describe()} (at {sub.name})")

    def choose(self, sub: Graph, spec: KernelSpec) -> Choice:
        return self.decide(sub, spec).choice

    def scratch_bytes(self, sub: Graph, spec: KernelSpec, choice: Choice) -> int:
        return self.families[choice[0]].scratch(self._geometry(sub, spec), choice[1])

    def stamp(self, sub: Graph, spec: KernelSpec, reuse: Any = ()) -> tuple[str, Plan, int, str] | None:
        """`Target.choose_kernel`: (family, plan, scratch bytes, why); None for a kind that is no kernel."""
        if spec.kind in self.no_kernel:
            return None
        g = self._geometry(sub, spec)  # once: a CUDA reduction's lowers the kernel
        d = self._decide(sub, spec, g, ..., reuse)
        return d.choice[0], d.choice[1], self.families[d.choice[0]].scratch(g, d.choice[1]), d.why

    def render(self, name: str, sub: Graph, spec: KernelSpec, choice: Choice, epilogue: Any = None) -> Any:
        """The kernel of `choice` for this spec: exactly the stamped family and plan."""
        family, plan = choice
        kernel = self.families[family].render(name, sub, spec, self._geometry(sub, spec), plan, epilogue)
        if kernel is None:
            raise AssertionError(f"{name}: family {family!r} refused the plan it was chosen with: {plan}")
        return kernel
