"""The matrices of Winograd's F(m, 3) (codegen/winograd_matrices.py) and the C sums that apply
them: the identities the CUDA transforms rely on hold exactly (in fractions) for every tile the
families use, and every generated sum is the row it was made from."""
from __future__ import annotations

import random
import re
from fractions import Fraction

import pytest

from ember.codegen.winograd_matrices import TRANSFORMS, Transform, combination, toom_cook


def _dot(row, values):
    return sum(c * v for c, v in zip(row, values))


def _mat(matrix, values):
    return [_dot(row, values) for row in matrix]


def _ints(rng, n):
    return [Fraction(rng.randint(-9, 9)) for _ in range(n)]


@pytest.mark.parametrize("m", sorted(TRANSFORMS))
def test_the_one_and_two_dimensional_identities_hold_exactly(m):
    """y = A^T[(G g) . (B^T d)] is the correlation of d with g; in 2-D, the forward
    A^T[(G g G^T) . (B^T d B)]A, and the weight gradient G^T[(A y A^T) . (B^T d B)]G is the
    correlation of the input patch with dy's m x m block."""
    t, rng = TRANSFORMS[m], random.Random(m)
    n = t.alpha
    for _ in range(5):
        g, d = _ints(rng, 3), _ints(rng, n)
        want = [sum(g[k] * d[i + k] for k in range(3)) for i in range(m)]
        assert _mat(t.AT, [a * b for a, b in zip(_mat(t.G, g), _mat(t.BT, d))]) == want

    def two_d(left, grid, right):  # left @ grid @ right^T
        rows = [_mat(left, col) for col in zip(*grid)]      # left @ grid, by columns
        return [_mat(right, row) for row in zip(*rows)]

    g2 = [_ints(rng, 3) for _ in range(3)]
    d2 = [_ints(rng, n) for _ in range(n)]
    products = [[a * b for a, b in zip(ra, rb)] for ra, rb in zip(two_d(t.G, g2, t.G), two_d(t.BT, d2, t.BT))]
    want = [[sum(g2[r][s] * d2[i + r][j + s] for r in range(3) for s in range(3)) for j in range(m)] for i in range(m)]
    assert two_d(t.AT, products, t.AT) == want
    y = [_ints(rng, m) for _ in range(m)]
    products = [[a * b for a, b in zip(ra, rb)] for ra, rb in zip(two_d(t.A, y, t.A), two_d(t.BT, d2, t.BT))]
    want = [[sum(y[i][j] * d2[i + r][j + s] for i in range(m) for j in range(m)) for s in range(3)] for r in range(3)]
    assert two_d(t.GT, products, t.GT) == want


def test_every_row_of_the_input_transform_starts_positive():
    for t in TRANSFORMS.values():
        assert all(next(c for c in row if c) > 0 for row in t.BT)


def test_points_that_cannot_make_the_transform_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        toom_cook((Fraction(0), Fraction(1), Fraction(1)), 2, 3)
    with pytest.raises(ValueError, match="needs 3"):
        toom_cook((Fraction(0), Fraction(1)), 2, 3)
    assert Transform(3, (Fraction(0), Fraction(1), Fraction(-1), Fraction(1, 2))).matrices  # F(3, 3) too


def _python(c_expression: str) -> str:
    return re.sub(r"(\d+\.?\d*(?:e[-+]?\d+)?)f\b", r"\1", c_expression)


@pytest.mark.parametrize("m", sorted(TRANSFORMS))
def test_each_generated_sum_is_its_row(m):
    """Every row of every matrix, as the C the template prints, evaluates to the row's sum (its
    constants rounded to float32 once); a row of zeros is 0 and a leading negative term stays so."""
    t, rng = TRANSFORMS[m], random.Random(10 + m)
    for matrix in (t.G, t.BT, t.AT, t.A, t.GT):
        for row in matrix:
            x = [rng.uniform(-2, 2) for _ in row]
            got = eval(_python(combination(row, "x[{}]")), {"x": x})  # noqa: S307 (our own generated text)
            assert got == pytest.approx(float(_dot(row, x)), rel=1e-6, abs=1e-6), (row, combination(row, "x[{}]"))
    assert combination((Fraction(0), Fraction(0)), "x[{}]") == "0.f"
    assert combination((Fraction(-1), Fraction(0), Fraction(1)), "x[{}]") == "- x[0] + x[2]"
    assert combination((Fraction(1), Fraction(-1, 2), Fraction(-1, 2)), "x[{}]") == "x[0] + 0.5f * (- x[1] - x[2])"
