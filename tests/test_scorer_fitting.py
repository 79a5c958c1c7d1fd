"""The learned scorer's teacher and regression against direct reference computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from profiler.learned_scorer import RidgeSums, reconstruction_importance, spearman


def test_reconstruction_importance_equals_a_naive_loop():
    generator = torch.Generator().manual_seed(0)
    num_q, num_kv, total, context, dim, scale = 6, 2, 23, 9, 8, 0.35
    query = torch.randn(num_q, total, dim, generator=generator, dtype=torch.float64)
    key = torch.randn(num_kv, total, dim, generator=generator, dtype=torch.float64)
    got = reconstruction_importance(query, key, context, scale, chunk=4)  # [Hkv, C]
    want = torch.full((num_kv, context), -float("inf"), dtype=torch.float64)
    for h in range(num_q):
        kv = h // (num_q // num_kv)
        for i in range(context, total):
            weights = torch.softmax(scale * key[kv, : i + 1] @ query[h, i], dim=0)  # causal: keys 0..i
            for j in range(context):
                want[kv, j] = max(want[kv, j], float(torch.log(weights[j])))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_ridge_solution_equals_direct_least_squares_and_shards_add_up():
    rng = np.random.default_rng(1)
    n, features = 200, 5
    x = rng.standard_normal((2, n, features)) * np.array([1.0, 10.0, 0.1, 3.0, 1.0])
    y = x @ rng.standard_normal((2, features, 1)) + 0.5 + 0.1 * rng.standard_normal((2, n, 1))
    whole = RidgeSums(2, features, 1)
    whole.add(torch.from_numpy(x), torch.from_numpy(y))
    halves = RidgeSums(2, features, 1)
    halves.add(torch.from_numpy(x[:, :77]), torch.from_numpy(y[:, :77]))
    halves.add(torch.from_numpy(x[:, 77:]), torch.from_numpy(y[:, 77:]))
    np.testing.assert_allclose(halves.zz, whole.zz, rtol=1e-12)
    for ridge in (0.0, 0.1):
        got = whole.solve(ridge)  # [G, F+1, 1]
        for g in range(2):
            z = np.concatenate([x[g], np.ones((n, 1))], axis=1)
            penalty = np.diag(np.append(ridge * n * x[g].var(axis=0), 0.0))
            want = np.linalg.solve(z.T @ z + penalty, z.T @ y[g])
            np.testing.assert_allclose(got[g], want, rtol=1e-8, atol=1e-10)


def test_spearman_is_one_for_monotone_maps_and_minus_one_reversed():
    a = np.random.default_rng(2).standard_normal(50)
    assert spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert spearman(a, -(a**3)) == pytest.approx(-1.0)
