"""One command for a machine with AVX-512 (the GPU machine's 16-core Xeon host): checks ember's
AVX-512 CPU kernels and times them, next to the AVX2 variant, and prints a summary.

    python tools/cpu_vector_check.py [--threads 16] [--variants avx512,avx2] [--out DIR]

From the repository root, with ember installed (``pip install --no-deps --no-build-isolation -e .``;
this script installs nothing and needs no network). Not a test (pytest does not collect it).

1. Machine: CPU model, whether /proc/cpuinfo has avx512f, g++ version, the variant ember picks.
2. Tests: ``pytest tests/codegen/test_cpu_vector.py tests/codegen/test_cpp_kernels.py
   tests/e2e/test_cpu_vs_reference.py tests/e2e/test_cpu_golden_losses.py`` (the e2e ones need
   MNIST at ../shared/data/mnist or $EMBER_TEST_MNIST, else they skip): every variant against the
   references, the 16-lane kernels run natively where the CPU has AVX-512 (skipped, with the
   reason, where it does not).
3. Bench, per variant (``EMBER_CPU_VECTOR``): ``ember bench --device cpu --threads N
   --no-torch-compile`` for cnn and mlp, then ``--profile --model cnn`` for each kernel's share
   of the measured FMA peak (``OMP_PROC_BIND=close OMP_PLACES=cores`` unless set).

Exit status: 1 when a test failed or a bench did not finish, else 0. With ``--out DIR`` the
pytest log and every bench report (JSON) are written there too.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = ["tests/codegen/test_cpu_vector.py", "tests/codegen/test_cpp_kernels.py",
         "tests/e2e/test_cpu_vs_reference.py", "tests/e2e/test_cpu_golden_losses.py"]


def _cpu() -> tuple[str, bool]:
    model, avx512 = platform.processor() or "?", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                avx512 = "avx512f" in line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    return model, avx512


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> tuple[int, str, str, float]:
    t0 = time.time()
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, e.stdout or "", (e.stderr or "") + f"\n(timed out after {timeout:.0f} s)", time.time() - t0
    return p.returncode, p.stdout, p.stderr, time.time() - t0


def _bench(variant: str, threads: int, extra: list[str]) -> tuple[dict | None, str]:
    env = dict(os.environ, EMBER_CPU_VECTOR=variant)
    env.setdefault("OMP_PROC_BIND", "close")   # one thread per physical core, as README's bench method says
    env.setdefault("OMP_PLACES", "cores")
    cmd = [sys.executable, "-c", "import sys; from ember.frontends.cli import main; sys.exit(main())",
           "bench", "--device", "cpu", "--threads", str(threads), "--no-torch-compile", "--json", *extra]
    rc, out, err, secs = _run(cmd, env)
    if rc != 0:
        return None, f"exit {rc} after {secs:.0f} s:\n{err[-3000:]}"
    try:
        return json.loads(out), f"{secs:.0f} s"
    except ValueError:
        return None, f"unreadable report:\n{out[-2000:]}\n{err[-2000:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=16, help="threads for ember and PyTorch (default 16)")
    ap.add_argument("--variants", default="avx512,avx2", help="EMBER_CPU_VECTOR values to bench (default avx512,avx2)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="folder for the pytest log and the bench reports")
    args = ap.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    ok = True
    summary: list[str] = []

    from ember.codegen import cpu_vector
    model, avx512 = _cpu()
    gxx = subprocess.run([*(os.environ.get("CXX") or "g++").split(), "--version"],  # the compiler ember uses
                         capture_output=True, text=True).stdout.splitlines()[:1]
    native = cpu_vector.native_isa().name
    summary += [f"machine: {model}; {os.cpu_count()} logical CPUs; avx512f in /proc/cpuinfo: {avx512}",
                f"compiler: {gxx[0] if gxx else '?'}; -march=native gives the {native} variant"]
    if not avx512:
        summary.append("WARNING: no avx512f here: the AVX-512 kernels are compiled and run emulated only, and "
                       "EMBER_CPU_VECTOR=avx512 cannot run")

    if not args.skip_tests:
        rc, out, err, secs = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS])
        if args.out:
            (args.out / "pytest.log").write_text(out + "\n" + err)
        tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
        summary.append(f"tests ({secs:.0f} s): {tail[-1] if tail else 'no summary line'}")
        summary += [f"  {ln}" for ln in skips[:12]]
        if rc != 0:
            ok = False
            summary.append("  FAILED: " + "; ".join(ln for ln in out.splitlines() if ln.startswith("FAILED"))[:3000])
            print(out[-6000:], err[-3000:], sep="\n")

    if not args.skip_bench:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        rows = []
        for variant in variants:
            if variant == "avx512" and not avx512:
                summary.append("bench avx512: skipped (no avx512f)")
                continue
            for extra, what in ((["--model", "all"], "step"), (["--model", "cnn", "--profile", "--steps", "100"], "profile")):
                report, note = _bench(variant, args.threads, extra)
                if report is None:
                    ok = False
                    summary.append(f"bench {variant} {what}: FAILED {note}")
                    continue
                if args.out:
                    (args.out / f"bench-{variant}-{what}.json").write_text(json.dumps(report, indent=1))
                peak = report.get("fma_peak_gflops")
                if what == "step":
                    for name, systems in report["models"].items():
                        by = {r["system"]: r for r in systems}
                        e, t = by.get("ember-cpu"), by.get("torch-eager")
                        rows.append((variant, report.get("cpu_vector", "?"), name, e["median_ms"] if e else float("nan"),
                                     t["median_ms"] if t else float("nan"), peak))
                else:
                    for name, kernels in report.get("kernels", {}).items():
                        total = sum(k["ms_per_step"] for k in kernels) or 1.0
                        summary.append(f"{variant} {name} kernels (profiled build, {args.threads} threads, "
                                       f"FMA peak {peak:.0f} GFLOP/s):")
                        for k in sorted(kernels, key=lambda k: -k["ms_per_step"])[:8]:
                            pct = f"{k['pct_of_peak']:5.1f}% of peak" if "pct_of_peak" in k else ""
                            summary.append(f"  {k['kernel']:26} {k['ms_per_step']:8.3f} ms {100 * k['ms_per_step'] / total:5.1f}% "
                                           f"{pct}  {k['implements'][:60]}")
        if rows:
            summary.append(f"bench, {args.threads} threads (median step ms; ratio = ember / PyTorch eager):")
            summary.append(f"  {'variant':8} {'model':5} {'ember':>9} {'torch':>9} {'ratio':>7} {'fma peak':>10}")
            for variant, got, name, e, t, peak in rows:
                flag = "" if got == variant else f" (ran {got})"
                summary.append(f"  {variant:8} {name:5} {e:9.3f} {t:9.3f} {e / t:7.3f} {peak or 0:8.0f} GF{flag}")

    print("\n===== ember CPU vector check =====")
    print("\n".join(summary))
    print("RESULT:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
