"""The keep rule (runtime.selection) against a per-head Python loop, on scores WITH ties, and the
calibration stages (moments, budget curves) selecting exactly what serving selects on tied scores."""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from runtime.selection import keep_mask, priority_ranks, protected_mask, select_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

INF = float("inf")
SINK_WINDOWS = [(0, 0), (0, 3), (2, 0), (3, 4), (25, 2), (2, 25)]


# -- the reference: one head at a time, in plain Python -----------------------------------------


def reference_order(scores: list[float], n_sink: int, window: int) -> list[int]:
    """A head's rows, first kept first: sinks (oldest first), window (newest first), then the rest
    by (score descending, later row first)."""
    n = len(scores)
    sinks = min(n_sink, n)
    recent = min(window, n - sinks)
    middle = sorted(range(sinks, n - recent), key=lambda i: (-scores[i], -i))
    return list(range(sinks)) + list(range(n - 1, n - recent - 1, -1)) + middle


def reference_fixed(n: int, n_sink: int, window: int) -> int:
    """How many of a head's rows are sinks or window rows."""
    sinks = min(n_sink, n)
    return sinks + min(window, n - sinks)


def tied_scores(generator: torch.Generator, shape, kind: str) -> torch.Tensor:
    if kind == "small-integers":
        return torch.randint(0, 3, shape, generator=generator).float()
    if kind == "all-equal":
        return torch.full(shape, 0.5)
    if kind == "underflow":  # exp of very negative logits: exact zeros (both signs) and -inf
        choice = torch.randint(0, 5, shape, generator=generator)
        values = torch.tensor([0.0, -0.0, -INF, 1e-30, 2.0])
        return values[choice]
    if kind == "distinct":
        return torch.rand(shape, generator=generator)
    raise ValueError(kind)


KINDS = ["small-integers", "all-equal", "underflow", "distinct"]


def seed(*parameters) -> int:
    """A generator seed from a test's parameters (hash() of a str changes between runs)."""
    return zlib.crc32(repr(parameters).encode())


def ragged(generator: torch.Generator, rows: int, heads: int, size: int):
    lengths = torch.randint(0, size + 1, (rows, heads), generator=generator)
    lengths[0, 0], lengths[-1, -1] = 0, size  # an empty head and a full one
    valid = torch.arange(size) < lengths.unsqueeze(-1)  # [R, Hkv, T]
    return lengths, valid


# -- the rule itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_sink, window", SINK_WINDOWS)
def test_priority_ranks_equal_the_per_head_loop_on_tied_scores(kind, n_sink, window):
    generator = torch.Generator().manual_seed(seed(kind, n_sink, window))
    rows, heads, size = 3, 4, 20
    lengths, valid = ragged(generator, rows, heads, size)
    scores = tied_scores(generator, (rows, heads, size), kind)
    ranks = priority_ranks(scores, valid, n_sink, window)
    assert ranks.dtype == torch.int64 and ranks.shape == (rows, heads, size)
    for r, h in itertools.product(range(rows), range(heads)):
        n = int(lengths[r, h])
        order = reference_order(scores[r, h, :n].tolist(), n_sink, window)
        want = list(range(size))  # padding: its own row index (>= n, never kept)
        for place, row in enumerate(order):
            want[row] = place
        assert ranks[r, h].tolist() == want, (r, h, n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_sink, window", SINK_WINDOWS)
def test_keep_mask_select_rows_and_protected_mask_equal_the_loop_at_every_kind_of_budget(kind, n_sink, window):
    generator = torch.Generator().manual_seed(seed(kind, n_sink, window, 1))
    rows, heads, size = 2, 5, 24
    lengths, valid = ragged(generator, rows, heads, size)
    scores = tied_scores(generator, (rows, heads, size), kind)
    fixed = [[reference_fixed(int(lengths[r, h]), n_sink, window) for h in range(heads)] for r in range(rows)]
    cases = {  # budget per head: 0, below the sinks, among the fixed rows, in the middle, == n, > n, < 0
        "zero": lambda n, f: 0,
        "below-sinks": lambda n, f: min(n_sink, n) // 2,
        "inside-fixed": lambda n, f: (min(n_sink, n) + f + 1) // 2,
        "middle": lambda n, f: (f + n + 1) // 2,
        "length": lambda n, f: n,
        "above": lambda n, f: n + 3,
        "negative": lambda n, f: -2,
    }
    for name, rule in cases.items():
        budgets = torch.tensor(
            [[rule(int(lengths[r, h]), fixed[r][h]) for h in range(heads)] for r in range(rows)], dtype=torch.int64
        )
        keep = keep_mask(scores, valid, budgets, n_sink, window)
        protected = protected_mask(valid, budgets, n_sink, window)
        for r, h in itertools.product(range(rows), range(heads)):
            n, budget = int(lengths[r, h]), int(budgets[r, h])
            order = reference_order(scores[r, h, :n].tolist(), n_sink, window)
            kept = sorted(order[: max(budget, 0)])
            assert keep[r, h].nonzero().reshape(-1).tolist() == kept, (name, r, h)
            assert select_rows(scores[r, h, :n], budget, n_sink, window).tolist() == kept, (name, r, h)
            protected_rows = sorted(order[: max(min(budget, fixed[r][h]), 0)])
            assert protected[r, h].nonzero().reshape(-1).tolist() == protected_rows, (name, r, h)


def test_one_head_shapes_and_empty_inputs():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert priority_ranks(scores, None, 1, 2).tolist() == [0, 5, 4, 3, 2, 1]  # the later row first
    assert select_rows(scores, 4, 1, 2).tolist() == [0, 3, 4, 5]
    assert select_rows(torch.zeros(0), 3, 4, 32).tolist() == []
    assert protected_mask(torch.ones(6, dtype=torch.bool), 2, 1, 2).tolist() == [True] + [False] * 4 + [True]
    assert keep_mask(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.bool), torch.ones(2, 3), 4, 32).shape == (
        2,
        3,
        0,
    )


def test_priority_ranks_are_nested_keep_sets():
    """``rank < b`` for every b: each budget keeps what the previous kept plus one row."""
    generator = torch.Generator().manual_seed(5)
    scores = tied_scores(generator, (40,), "small-integers")
    ranks = priority_ranks(scores, None, 3, 5)
    assert sorted(ranks.tolist()) == list(range(40))
    for budget in range(41):
        assert select_rows(scores, budget, 3, 5).tolist() == torch.nonzero(ranks < budget).reshape(-1).tolist()
