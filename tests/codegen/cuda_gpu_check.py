"""Checks every kernel of ``cuda_cases.all_kernels()`` on a GPU against float64 references.

Robust to crashing kernels: the cases run in a worker process (one CuPy RawModule per kernel);
if a kernel kills the CUDA context (illegal address, launch failure), the worker dies, the parent
records that case as ``crash`` and starts a new worker at the next case. So one run reveals
every failure. Used by test_cuda_kernels_gpu.py; also runnable directly:

    python tests/codegen/cuda_gpu_check.py [--json FILE]

Prints one line per case: status, kernel, worst error against tolerance, geometry, plan.
Tolerance: |got - ref| <= 1e-5 * |ref| + 1e-5 * sqrt(R) (R = reduction length; 2e-3 * sqrt(R)
for the TF32 cases, see _check_one); outputs and
scratch are poisoned with NaN; each kernel runs twice and must be bit-identical.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# The worker runs this file as a script (check_all), so Python puts this folder first on its
# sys.path and `import cuda_cases` / `cuda_refs` resolve as under pytest, without editing sys.path
# (PYTHONSAFEPATH would turn that off: check_all leaves it out of the worker's environment).


def _geometry(kind, spec, extra):
    d = dict(spec) | dict(extra)
    return f"{kind} " + " ".join(f"{k}={v}" for k, v in d.items())


def _check_one(cp, cuda_refs, kernel, kind, spec, extra, seed):
    mod = cuda_refs.compile_module(cp, [kernel.code])
    rng = np.random.default_rng(seed)
    ins, refs, red = cuda_refs.make_case(kind, spec, extra, rng)

    def run():
        bufs = {r: cp.asarray(a) for r, a in ins.items()}
        outs = {}
        for role, ref in refs.items():
            if role not in bufs:
                bufs[role] = cp.full(ref.shape, np.nan, dtype=cp.float32)
            outs[role] = bufs[role]
        scratch = cp.full(max(kernel.scratch_bytes // 4, 1), np.nan, dtype=cp.float32)
        cuda_refs.run_launches(cp, mod, kernel, bufs, scratch)
        cp.cuda.Device().synchronize()
        return {r: cp.asnumpy(b) for r, b in outs.items()}

    got1, got2 = run(), run()
    roles = {}
    ok = True
    for role, ref in refs.items():
        g = got1[role].reshape(ref.shape).astype(np.float64)
        R = red.get(role, 1)
        if extra.get("tf32"):
            # TF32 rounds each operand to a 10-bit mantissa (relative error <= 2**-11), so each
            # product is off by up to 2**-10 of itself; with inputs uniform in [-1, 1] (products of
            # rms 1/3) the sum's error is ~ sqrt(R) * 3.3e-4, and 2e-3 * sqrt(R) is six of those.
            tol = 1e-5 * np.abs(ref) + 2e-3 * np.sqrt(R)
        else:
            tol = 1e-5 * np.abs(ref) + 1e-5 * np.sqrt(R)
        err = np.abs(g - ref)
        bad = ~(err <= tol)
        ratio = np.where(np.isnan(err), np.inf, err / tol)
        worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        det = bool(np.array_equal(got1[role].view(np.uint32), got2[role].view(np.uint32)))
        rel = float(np.linalg.norm(np.nan_to_num(g - ref, nan=1e30)) / max(np.linalg.norm(ref), 1e-30))
        roles[role] = dict(bad=int(bad.sum()), size=int(bad.size), nans=int(np.isnan(g).sum()),
                           max_abs_err=float(np.nanmax(err)) if np.isfinite(err).any() else None,
                           max_err_over_tol=float(np.max(ratio)), worst_at=[int(t) for t in worst],
                           rel_l2=rel, deterministic=det)
        ok = ok and not bad.any() and det
    return dict(status="ok" if ok else "FAIL", roles=roles)


def worker(start: int) -> None:
    import cupy as cp
    import cuda_cases
    import cuda_refs
    cases = cuda_cases.all_kernels()
    for idx in range(start, len(cases)):
        kernel, (kind, spec, extra) = cases[idx]
        print(json.dumps(dict(begin=idx)), flush=True)
        signal.alarm(60)  # a hung kernel: the default action ends the worker; the parent goes on
        try:
            res = _check_one(cp, cuda_refs, kernel, kind, spec, extra, 1234 + idx)
        except Exception as e:  # noqa: BLE001 - report and keep going (context may be dead)
            res = dict(status="error", error=f"{type(e).__name__}: {e}"[:500])
            if "cudaError" in res["error"] or "CUDA_ERROR" in res["error"]:
                print(json.dumps(dict(result=idx) | res), flush=True)
                os._exit(3)  # the context is unusable: let the parent restart us
        print(json.dumps(dict(result=idx) | res), flush=True)


def check_all(log=print) -> list[dict]:
    import cuda_cases
    cases = cuda_cases.all_kernels()
    results: dict[int, dict] = {}
    start = 0
    while start < len(cases):
        errf = tempfile.TemporaryFile("w+")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(start)],
                                stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        current = None
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "begin" in msg:
                current = msg["begin"]
            elif "result" in msg:
                results[msg["result"]] = msg
                current = None
        proc.wait()
        errf.seek(0)
        err = errf.read()
        errf.close()
        if current is None:  # died before a case or after reporting one
            if not results or max(results) < start:
                raise RuntimeError(f"GPU check worker failed (rc {proc.returncode}):\n{err[-4000:]}")
            start = max(results) + 1
            continue
        results[current] = dict(result=current, status="crash",
                                error=f"worker rc {proc.returncode}: {err[-1500:]}")
        start = current + 1
    out = []
    for idx, (kernel, (kind, spec, extra)) in enumerate(cases):
        r = results.get(idx, dict(status="missing"))
        plan = kernel.code.split("\n")[1].lstrip("/ ") if kernel.code.startswith("// ====") else ""
        r = dict(r, idx=idx, kernel=kernel.name, geometry=_geometry(kind, spec, extra), plan=plan,
                 launches=[(ln.function, ln.grid, ln.block) for ln in kernel.launches])
        out.append(r)
        worst = ""
        if "roles" in r:
            worst = "; ".join(f"{role}: max|err| {v['max_abs_err']:.3g} ({v['max_err_over_tol']:.3g} x tol), "
                              f"bad {v['bad']}/{v['size']}, NaN {v['nans']}, rel {v['rel_l2']:.2e}"
                              f"{'' if v['deterministic'] else ', NOT DETERMINISTIC'}"
                              for role, v in r["roles"].items())
        else:
            worst = r.get("error", "")[:300].replace("\n", " | ")
        log(f"{r['status']:6s} {kernel.name:22s} {worst}  [{r['geometry']}]  [{plan}]")
    bad = [r for r in out if r["status"] != "ok"]
    log(f"GPU check: {len(out) - len(bad)} passed, {len(bad)} failed of {len(out)}")
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        res = check_all()
        if "--json" in sys.argv:
            Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(res, indent=1))
        sys.exit(0 if all(r["status"] == "ok" for r in res) else 1)
