"""Which rows of a KV head a budget keeps: one priority order, shared by serving and calibration.

Every head's rows get a *priority rank*; a budget ``b`` keeps exactly the rows of rank ``< b``
(so the kept sets of growing budgets are nested).  Per head, over its ``n`` valid rows:

1. the attention sinks: the first ``min(n_sink, n)`` rows, oldest first;
2. the recent window: the last ``min(window, n - sinks)`` rows, newest first;
3. the rest by falling score; among equal scores the later row (the newer token) goes first,
   because with nothing else to tell them apart recency is the better bet (the same reason the
   recent window is kept at all) — this matters where scores tie: underflow to 0, ``-inf``,
   constant or integer scores;
4. invalid rows (padding past the head's length) last: rank = row index ``>= n``, never kept.

So a budget below the sinks keeps the first ``budget`` rows, a budget between keeps the sinks and
the newest ``budget - sinks`` rows, a budget ``>= n`` keeps every valid row, a budget ``<= 0``
none, and an empty head nothing.  Scores are compared as float32 (``-0.0`` equals ``0.0``); NaN
ranks above ``+inf`` (torch's descending order) — the engine refuses NaN scores before selecting.

Shapes: ``scores [..., T]`` float (typically ``[R, Hkv, T]``: batch rows x KV heads x rows, one
head per leading index), ``valid`` bool ``[..., T]`` (each head's first ``lengths`` rows: a prefix
mask), ``budgets`` int ``[...]``.  :func:`priority_ranks` gives the ranks, :func:`keep_mask` the
kept rows of a whole layer (the engine's path: one sort, no loop over heads), :func:`select_rows`
the sorted kept row indices of one head, :func:`protected_mask` the sinks and window a budget
keeps (score-free: moment-informed eviction protects them), :func:`global_counts` the budgets of a
``global`` allocation (one order over every head's rows).  ``runtime.scorers`` scorers only score;
these functions decide.
"""

from __future__ import annotations

import torch


def _layout(valid: torch.Tensor, n_sink: int, window: int):
    """``lengths, sinks, recent`` int64 ``[...]`` and the fixed ranks of the sinks and window:
    ``fixed`` int64 ``[..., T]`` (sinks: their row; window rows: ``sinks + (n - 1 - row)``) with
    ``is_fixed`` bool ``[..., T]`` saying where it applies."""
    device = valid.device
    lengths = valid.sum(-1)  # [...]
    sinks = lengths.clamp(max=max(int(n_sink), 0))  # [...]
    recent = torch.minimum(lengths - sinks, torch.full_like(lengths, max(int(window), 0)))  # [...]
    row = torch.arange(valid.shape[-1], device=device)  # [T]
    is_sink = row < sinks.unsqueeze(-1)  # [..., T]
    is_recent = valid & (row >= (lengths - recent).unsqueeze(-1))  # [..., T]
    fixed = torch.where(is_sink, row, (sinks + lengths - 1).unsqueeze(-1) - row)  # [..., T]
    return lengths, sinks, recent, fixed, is_sink | is_recent


def priority_ranks(scores: torch.Tensor, valid: torch.Tensor | None, n_sink: int, window: int) -> torch.Tensor:
    """Each row's place in its head's keep order, int64 ``[..., T]`` (a permutation of ``0..T-1``
    per head; see the module docstring).  ``valid=None``: every row is valid."""
    if valid is None:
        valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    lengths, sinks, recent, fixed, is_fixed = _layout(valid, n_sink, window)
    size = scores.shape[-1]
    row = torch.arange(size, device=scores.device)  # [T]
    middle = valid & ~is_fixed  # [..., T] rows ranked by score
    # + 0.0 turns -0.0 into 0.0 (a radix sort would tell them apart); rows that are not ranked by
    # score sort with -inf, so a middle row scored -inf can tie with them: the cumulative count
    # below numbers only the middle rows, whatever sits between them in the order
    key = (scores.float() + 0.0).masked_fill(~middle, float("-inf"))  # [..., T]
    # ties to the later row: a stable descending sort of the reversed rows
    order = (size - 1) - torch.sort(key.flip(-1), dim=-1, descending=True, stable=True).indices  # [..., T]
    place = torch.cumsum(middle.gather(-1, order), dim=-1) - 1  # [..., T] middle rows' place among them
    ranked = torch.empty_like(order).scatter_(-1, order, place + (sinks + recent).unsqueeze(-1))  # [..., T]
    ranks = torch.where(is_fixed, fixed, ranked)
    return torch.where(valid, ranks, row.expand_as(ranks))  # padding: its row index, >= the length


def keep_mask(
    scores: torch.Tensor, valid: torch.Tensor, budgets: torch.Tensor | int, n_sink: int, window: int
) -> torch.Tensor:
    """The rows kept under ``budgets`` int ``[...]``: bool ``[..., T]``, True = keep (rank < budget)."""
    ranks = priority_ranks(scores, valid, n_sink, window)
    budgets = torch.as_tensor(budgets, device=ranks.device)
    return valid & (ranks < budgets.unsqueeze(-1))


def select_rows(scores: torch.Tensor, budget: int, n_sink: int, window: int) -> torch.Tensor:
    """Sorted row indices int64 ``[min(max(budget, 0), n)]`` kept of one head's ``scores [n]``."""
    n = scores.shape[-1]
    if budget >= n:
        return torch.arange(n, device=scores.device)
    ranks = priority_ranks(scores, None, n_sink, window)
    return torch.nonzero(ranks < max(int(budget), 0)).reshape(-1)


def protected_mask(valid: torch.Tensor, budgets: torch.Tensor | int, n_sink: int, window: int) -> torch.Tensor:
    """The sinks and window rows a budget keeps whatever the scores, bool ``[..., T]``: the first
    ``min(n_sink, budget)`` rows, then the last ``min(window, budget - sinks)`` (moment-informed
    eviction never evicts these and chooses the rest itself)."""
    _, _, _, fixed, is_fixed = _layout(valid, n_sink, window)
    budgets = torch.as_tensor(budgets, device=fixed.device)
    return is_fixed & (fixed < budgets.unsqueeze(-1))


def global_counts(scores: torch.Tensor, valid: torch.Tensor, total: int, n_sink: int, window: int) -> torch.Tensor:
    """Rows per head, int64 ``[...]``, when ``total`` rows are kept over every head together
    (``scores`` comparable across heads, e.g. ``[L, Hkv, T]``).

    One order over all heads' valid rows: every head's sinks and window first (round-robin by
    their rank in their head, so a total below them all spreads them evenly), then every other row
    by falling score; ties to the later row, then to the lower head index (flattened leading axes).
    Restricted to one head it is :func:`priority_ranks`' order, so head ``h`` keeps exactly its
    ``counts[h]`` rows of lowest rank: what :func:`keep_mask` keeps under these budgets.
    """
    shape = scores.shape[:-1]
    size = scores.shape[-1]
    heads = scores.reshape(-1, size)  # [H, T]
    valid = valid.reshape(-1, size)  # [H, T]
    _, _, _, fixed, is_fixed = _layout(valid, n_sink, window)  # [H, T]
    middle = valid & ~is_fixed
    # key [H, T], ascending: fixed rows by their rank (< T), middle rows after every fixed row by
    # falling score (a float32 -> int map that keeps the order: -0.0 made 0.0, NaN made the
    # positive NaN, above +inf), padding last
    values = heads.float() + 0.0
    values = torch.where(torch.isnan(values), float("nan"), values)
    bits = values.view(torch.int32).to(torch.int64)  # [H, T]
    ordered = torch.where(bits >= 0, bits + (1 << 31), (1 << 31) - 1 - (bits & 0x7FFFFFFF))  # in [0, 2^32)
    key = torch.where(is_fixed, fixed, torch.where(middle, size + ((1 << 32) - 1 - ordered), 1 << 62))
    # in (row descending, head ascending) order first, so the stable sort breaks ties that way
    arranged = key.flip(-1).T.reshape(-1)  # [T * H]: row T-1 of every head, then row T-2, ...
    owner = torch.arange(heads.shape[0], device=heads.device).repeat(size)  # [T * H]
    keep = min(max(int(total), 0), int(valid.sum()))
    chosen = owner[torch.sort(arranged, stable=True).indices[:keep]]
    return torch.bincount(chosen, minlength=heads.shape[0]).reshape(shape)
