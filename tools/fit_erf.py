"""Fits the coefficients of the CPU prelude's vectorisable `em_erf` and reports its error.

    python tools/fit_erf.py [--points 400000]

`em_erf(x)` (codegen/templates/cpp/prelude.j2) is two branch-free pieces:
- |x| <= 1: x + x * P(x^2), P of degree 6, fitted by least squares on Chebyshev nodes in x^2 with
  the relative error of erf(x) / x weighted (x * (P + 1) is the odd series' shape);
- 1 < |x|: 1 - exp(-Q(t)), t = min(|x|, 4), Q of degree 9 fitted to -log(erfc(t)) on [1, 4],
  weighted by erfc(t) (an error dQ moves erf by erfc * dQ; erf(x) rounds to 1 in float32 from
  3.92 on).

The fits use float64 `math.erf`/`math.erfc`. The error is measured in float32 arithmetic as the
prelude computes it (each fused multiply-add rounded once; exp through float32 `np.exp`, within
an ulp of the prelude's `em_exp` for these arguments) against float64 erf, in ulps of the
float32 result. It prints the coefficients as the prelude spells them.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

NEAR_DEGREE, FAR_DEGREE, SPLIT, FAR_END = 6, 9, 1.0, 4.0


def _nodes(lo: float, hi: float, n: int = 4000) -> np.ndarray:
    return np.cos(np.pi * (np.arange(n) + 0.5) / n) * 0.5 * (hi - lo) + 0.5 * (hi + lo)


def fit_near() -> np.ndarray:
    """Coefficients of P (increasing powers of x^2), its constant term less 1."""
    s = _nodes(0.0, SPLIT * SPLIT)
    x = np.sqrt(s)
    ratio = np.array([math.erf(v) / v for v in x])
    design = np.vander(s, NEAR_DEGREE + 1, increasing=True)
    c, *_ = np.linalg.lstsq(design / ratio[:, None], np.ones_like(ratio), rcond=None)
    c[0] -= 1.0
    return c


def fit_far() -> np.ndarray:
    """Coefficients of Q (increasing powers of t)."""
    t = _nodes(SPLIT, FAR_END)
    q = np.array([-math.log(math.erfc(v)) for v in t])
    w = np.array([math.erfc(v) for v in t])
    design = np.vander(t, FAR_DEGREE + 1, increasing=True)
    c, *_ = np.linalg.lstsq(design * w[:, None], q * w, rcond=None)
    return c


def _horner(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    c32 = coefficients.astype(np.float32).astype(np.float64)
    r = np.full(x.shape, c32[-1], np.float32)
    for a in c32[-2::-1]:  # a float32 product is exact in float64: one rounding, as an fma
        r = (r.astype(np.float64) * x + a).astype(np.float32)
    return r


def em_erf(x: np.ndarray, near: np.ndarray, far: np.ndarray) -> np.ndarray:
    """The prelude's em_erf in NumPy float32 arithmetic."""
    t = np.abs(x).astype(np.float32)
    s = (t.astype(np.float64) * t).astype(np.float32)
    p = _horner(near, s.astype(np.float64))
    near_value = (p.astype(np.float64) * t + t).astype(np.float32)
    u = np.minimum(t, np.float32(FAR_END)).astype(np.float64)
    q = _horner(far, u)
    far_value = (1.0 - np.exp(-q).astype(np.float32).astype(np.float64)).astype(np.float32)
    return np.copysign(np.where(t <= SPLIT, near_value, far_value), x)


def max_ulp(near: np.ndarray, far: np.ndarray, points: int) -> tuple[float, float]:
    xs = np.concatenate([np.linspace(0.0, 4.5, points, dtype=np.float32),
                         np.logspace(-30, 0, points // 20).astype(np.float32)])
    want = np.array([math.erf(float(v)) for v in xs])
    ulp = np.spacing(np.abs(want.astype(np.float32))).astype(np.float64)
    err = np.abs(em_erf(xs, near, far).astype(np.float64) - want) / ulp
    return float(err.max()), float(xs[int(err.argmax())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=400_000, help="evaluation points on [0, 4.5]")
    args = ap.parse_args()
    near, far = fit_near(), fit_far()
    for name, c, var in (("p", near, "s"), ("q", far, "u")):
        spelled = [f"{np.float32(v):.9e}f" for v in c[::-1]]
        print(f"  float {name} = {spelled[0]};")
        for v in spelled[1:]:
            print(f"  {name} = __builtin_fmaf({name}, {var}, {v});")
    worst, where = max_ulp(near, far, args.points)
    print(f"max error {worst:.2f} ulp (at x = {where:.7g}) over [0, 4.5] and 1e-30..1")


if __name__ == "__main__":
    main()
