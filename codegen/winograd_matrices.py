"""The matrices of Winograd's minimal filtering F(m, 3) and the straight-line code that applies them
(the CUDA `winograd` families' transforms, `cuda_winograd`).

F(m, r) computes m outputs of a correlation with an r-tap filter g from n = m + r - 1 inputs d as
y = A^T [(G g) . (B^T d)], by evaluating the polynomials at n - 1 points and at infinity
(Toom-Cook). For points p_j and the product P(x) = prod_j (x - p_j):

* A^T[i][j] = p_j^i (the last column, infinity's, is the unit vector of i = m - 1);
* G[j][k] = p_j^k / prod_{l != j} (p_j - p_l) (infinity's row is the unit vector of k = r - 1);
* B^T[j] = the coefficients of P(x) / (x - p_j) (infinity's row: those of P(x)),

up to the sign of a row of B^T with its row of G (or infinity's, with its column of A^T).

The 2-D form nests it: Y = A^T [(G g G^T) . (B^T d B)] A, and the weight gradient of a tile is
G^T [(A y A^T) . (B^T d B)] G for the m x m block y of dy above it (the same identity read for g).
The points decide the rounding: F(2, 3) takes 0, 1, -1 (entries 0, +-1, 1/2, exact); F(4, 3) takes
0, 1, -1, 1/2, -2, whose float32 error on a 64-channel layer (a NumPy model of the transforms, RMS
against float64) was 1.26e-6 forward and 1.09e-6 for the weight gradient where Lavin's 0, +-1, +-2
gave 1.89e-6 and 1.61e-6 (F(2, 3): 2.8e-7 and 3.8e-7; the direct sums 1.6e-7 and 2.3e-7). F(3, 3)
at 0, 1, -1 and 1/2 (or 2, or -1/2) rounds nearly as much as F(4, 3) (1.0e-6 both ways): any point
past 0 and +-1 costs it, which is why only F(2, 3) keeps to float32's contract (`cuda_winograd`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

__all__ = ["Transform", "TRANSFORMS", "toom_cook", "combination"]

Matrix = tuple[tuple[Fraction, ...], ...]


def _times(a: list[Fraction], b: list[Fraction]) -> list[Fraction]:
    out = [Fraction(0)] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] += x * y
    return out


def toom_cook(points: tuple[Fraction, ...], m: int, r: int) -> tuple[Matrix, Matrix, Matrix]:
    """(A^T, G, B^T) of F(m, r) at these m + r - 2 finite points and infinity."""
    n = m + r - 1
    if len(points) != n - 1 or len(set(points)) != len(points):
        raise ValueError(f"F({m}, {r}) needs {n - 1} distinct finite points, got {points}")
    at = tuple(tuple(p ** i for p in points) + (Fraction(int(i == m - 1)),) for i in range(m))
    g = []
    for j, p in enumerate(points):
        scale = Fraction(1)
        for q in points[:j] + points[j + 1:]:
            scale *= p - q
        g.append(tuple(p ** k / scale for k in range(r)))
    g.append(tuple(Fraction(int(k == r - 1)) for k in range(r)))
    bt = []
    for j in range(len(points)):
        poly = [Fraction(1)]
        for q in points[:j] + points[j + 1:]:
            poly = _times(poly, [-q, Fraction(1)])
        bt.append(tuple(poly) + (Fraction(0),) * (n - len(poly)))
    poly = [Fraction(1)]
    for q in points:
        poly = _times(poly, [-q, Fraction(1)])
    bt.append(tuple(poly))
    # Signs, a convention: every row of B^T starts positive (one that starts negative is negated
    # with its row of G, a finite point's, or its column of A^T, infinity's: the products are
    # unchanged). F(2, 3)'s input transform then has the textbook's rows up to one sign.
    at = [list(row) for row in at]
    for j, row in enumerate(bt):
        if next(c for c in row if c) < 0:
            bt[j] = tuple(-c for c in row)
            if j < len(points):
                g[j] = tuple(-c for c in g[j])
            else:
                for i in range(m):
                    at[i][j] = -at[i][j]
    return tuple(tuple(row) for row in at), tuple(g), tuple(bt)


@dataclass(frozen=True)
class Transform:
    """F(m x m, 3 x 3): m x m outputs from an alpha x alpha input tile, alpha^2 products a tile."""
    m: int
    points: tuple[Fraction, ...]

    @property
    def alpha(self) -> int:
        return self.m + 2

    @property
    def positions(self) -> int:
        return self.alpha ** 2

    @functools.cached_property
    def matrices(self) -> tuple[Matrix, Matrix, Matrix]:
        return toom_cook(self.points, self.m, 3)

    @property
    def AT(self) -> Matrix:      # m x alpha: the output transform
        return self.matrices[0]

    @property
    def G(self) -> Matrix:       # alpha x 3: the weights' transform
        return self.matrices[1]

    @property
    def BT(self) -> Matrix:      # alpha x alpha: the input tile's transform
        return self.matrices[2]

    @property
    def A(self) -> Matrix:       # alpha x m: dy's block in the weight gradient
        return tuple(zip(*self.AT))

    @property
    def GT(self) -> Matrix:      # 3 x alpha: the weight gradient's output transform
        return tuple(zip(*self.G))


#: the tile sizes the CUDA families take, by m
TRANSFORMS = {2: Transform(2, (Fraction(0), Fraction(1), Fraction(-1))),
              4: Transform(4, (Fraction(0), Fraction(1), Fraction(-1), Fraction(1, 2), Fraction(-2)))}


def _literal(c: Fraction) -> str:
    """A float32 literal of c (rounded once, where c is not a binary fraction)."""
    text = f"{float(np.float32(float(c))):.9g}"
    return text + ("f" if "." in text or "e" in text else ".f")


def combination(row: tuple[Fraction, ...], term: str) -> str:
    """C for sum_j row[j] * term(j): terms of equal magnitude summed before their one multiply (the
    groups in the order of their first term, each term in order), zeros left out; `term` a format
    string with one `{}` for j."""
    groups: dict[Fraction, list[str]] = {}
    for j, c in enumerate(row):
        if c:
            groups.setdefault(abs(c), []).append(("-" if c < 0 else "+") + term.format(j))
    if not groups:
        return "0.f"
    parts = []
    for magnitude, signed in groups.items():
        text = " ".join(f"{s[0]} {s[1:]}" for s in signed).lstrip("+ ")
        if magnitude == 1:
            parts.append(text if len(signed) == 1 or not parts else f"({text})")
        elif len(signed) == 1:
            parts.append(f"{signed[0][0]}{_literal(magnitude)} * {signed[0][1:]}".lstrip("+"))
        else:
            parts.append(f"{_literal(magnitude)} * ({text})")
    out = parts[0]
    for p in parts[1:]:
        out += f" - {p[1:]}" if p.startswith("-") else f" + {p}"
    return out
