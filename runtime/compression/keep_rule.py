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

import numpy as np
import torch


def _counts(valid: torch.Tensor, n_sink: int, window: int):
    """Per head int64 ``[...]``: ``lengths`` (valid rows), ``sinks`` (``min(n_sink, n)``) and
    ``recent`` (``min(window, n - sinks)``); and ``row = arange(T)``."""
    lengths = valid.sum(-1)  # [...]
    sinks = lengths.clamp(max=max(int(n_sink), 0))  # [...]
    recent = torch.minimum(lengths - sinks, torch.full_like(lengths, max(int(window), 0)))  # [...]
    return lengths, sinks, recent, torch.arange(valid.shape[-1], device=valid.device)


def _fixed_ranks(valid: torch.Tensor, lengths, sinks, recent, row):
    """The ranks of the sinks and window rows, which no score changes: ``fixed`` int64 ``[..., T]``
    (a sink: its row; a window row: ``sinks + (n - 1 - row)``), valid where ``is_fixed`` bool."""
    is_sink = row < sinks.unsqueeze(-1)  # [..., T]
    is_recent = valid & (row >= (lengths - recent).unsqueeze(-1))  # [..., T]
    fixed = torch.where(is_sink, row, (sinks + lengths - 1).unsqueeze(-1) - row)  # [..., T]
    return fixed, is_sink | is_recent


def _middle_order(scores: torch.Tensor, middle: torch.Tensor):
    """The ``middle`` rows (bool ``[..., T]``: those ranked by score), best first, ties to the later
    row: ``order`` int64 ``[..., T]`` (row indices) and ``tail`` bool ``[..., T]`` (the positions
    scored ``-inf``).  The other rows sort as ``-inf``; a stable descending sort of the reversed
    rows puts the ``-inf`` tail later rows first: padding, the window, the middle rows scored
    ``-inf``, the sinks.  So the middle row at position ``p`` of the order is the ``p``-th middle
    row, or, in the tail, the ``(p - ahead)``-th, ``ahead = T - n + window rows``."""
    size = scores.shape[-1]
    # + 0.0 turns -0.0 into 0.0 (a radix sort would tell them apart)
    key = (scores.float() + 0.0).masked_fill_(~middle, float("-inf"))  # [..., T]
    ordered, flipped = torch.sort(key.flip(-1), dim=-1, descending=True, stable=True)  # [..., T]
    return flipped.neg_().add_(size - 1), ordered == float("-inf")  # (in place: this runs at every compression)


def priority_ranks(scores: torch.Tensor, valid: torch.Tensor | None, n_sink: int, window: int) -> torch.Tensor:
    """Each row's place in its head's keep order, int64 ``[..., T]`` (a permutation of ``0..T-1``
    per head; see the module docstring).  ``valid=None``: every row is valid."""
    if valid is None:
        valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    lengths, sinks, recent, row = _counts(valid, n_sink, window)
    fixed, is_fixed = _fixed_ranks(valid, lengths, sinks, recent, row)
    order, tail = _middle_order(scores, valid & ~is_fixed)
    ahead = (scores.shape[-1] - lengths + recent).unsqueeze(-1)  # [..., 1]
    place = row - ahead * tail + (sinks + recent).unsqueeze(-1)  # [..., T] by position in the order
    ranked = torch.empty_like(order).scatter_(-1, order, place)  # [..., T] by row
    ranks = torch.where(is_fixed, fixed, ranked)
    return torch.where(valid, ranks, row)  # padding: its row index, >= the length


def _split(valid: torch.Tensor, budgets, n_sink: int, window: int):
    """What ``budgets`` keeps of each head: ``protected`` bool ``[..., T]`` (its first
    ``min(n_sink, budget)`` rows and last ``min(window, budget - sinks)`` rows: the fixed rows of
    rank ``< budget``), ``chosen`` int64 ``[..., 1]`` (how many rows it keeps by score) and
    ``ahead`` int64 ``[..., 1]`` (see :func:`_middle_order`; 0 where none is chosen)."""
    lengths, sinks, recent, row = _counts(valid, n_sink, window)
    budgets = torch.as_tensor(budgets, device=valid.device)
    budgets = torch.minimum(budgets.clamp_min(0), lengths)  # [...]
    kept_sinks = torch.minimum(budgets, sinks)
    kept_recent = torch.minimum(budgets - kept_sinks, recent)
    protected = (row < kept_sinks.unsqueeze(-1)) | (valid & (row >= (lengths - kept_recent).unsqueeze(-1)))
    chosen = (budgets - kept_sinks - kept_recent).unsqueeze(-1)
    # none chosen: no middle row either, whatever stands in the -inf tail
    ahead = torch.where(chosen > 0, (valid.shape[-1] - lengths + recent).unsqueeze(-1), 0)
    return protected, chosen, ahead, row


def keep_mask(
    scores: torch.Tensor, valid: torch.Tensor, budgets: torch.Tensor | int, n_sink: int, window: int
) -> torch.Tensor:
    """The rows kept under ``budgets`` int ``[...]``: bool ``[..., T]``, True = keep; the rows of
    :func:`priority_ranks` ``< budget``, without building the ranks (the engine's hot path)."""
    protected, chosen, ahead, row = _split(valid, budgets, n_sink, window)
    # the rows not protected under the budget: the middle rows whenever any is chosen (a budget
    # below sinks + window chooses none), so the order of the middle rows is priority_ranks'
    middle = valid & ~protected
    order, tail = _middle_order(scores, middle)
    # the first `chosen` middle rows by position in the order (tail: `ahead` other rows before them)
    taken = (row < chosen).logical_or_(tail.logical_and_(row < chosen + ahead))  # [..., T]
    return torch.zeros_like(valid).scatter_(-1, order, taken).logical_and_(middle).logical_or_(protected)


def select_rows(scores: torch.Tensor, budget: int, n_sink: int, window: int) -> torch.Tensor:
    """Sorted row indices int64 ``[min(max(budget, 0), n)]`` kept of one head's ``scores [n]``."""
    n = scores.shape[-1]
    if budget >= n:
        return torch.arange(n, device=scores.device)
    valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
    return torch.nonzero(keep_mask(scores, valid, budget, n_sink, window)).reshape(-1)


def protected_mask(valid: torch.Tensor, budgets: torch.Tensor | int, n_sink: int, window: int) -> torch.Tensor:
    """The sinks and window rows a budget keeps whatever the scores, bool ``[..., T]``: the first
    ``min(n_sink, budget)`` rows, then the last ``min(window, budget - sinks)`` (moment-informed
    eviction never evicts these and chooses the rest itself)."""
    return _split(valid, budgets, n_sink, window)[0]


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
    device = heads.device
    lengths, sinks, recent, row = _counts(valid, n_sink, window)
    fixed, is_fixed = _fixed_ranks(valid, lengths, sinks, recent, row)  # [H, T]
    keep = min(max(int(total), 0), int(lengths.sum()))
    counts = sinks + recent  # [H] every fixed row, when the total reaches past them all
    spare = keep - int(counts.sum())
    if spare <= 0:  # only fixed rows: by (rank in head, later row, lower head)
        head, at = is_fixed.nonzero(as_tuple=True)
        order = (fixed[head, at] * size + (size - 1 - at)) * heads.shape[0] + head
        chosen = head[torch.argsort(order)[:keep]]
        return torch.bincount(chosen, minlength=heads.shape[0]).reshape(shape)
    # the middle rows by falling score: an int32 key that keeps float32's order (-0.0 made 0.0,
    # NaN made the positive NaN, above +inf), the other rows below every score; then the
    # spare-th largest key splits the rows kept outright from the ties at the threshold
    values = heads.float() + 0.0
    bits = torch.where(torch.isnan(values), float("nan"), values).view(torch.int32)  # [H, T]
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # [H, T] signed, increasing with the score
    key = key.masked_fill_(~(valid & ~is_fixed), torch.iinfo(torch.int32).min)
    threshold = torch.kthvalue(key.reshape(-1), key.numel() - spare + 1).values
    above = key > threshold  # [H, T] kept outright
    counts = counts + above.sum(-1)
    head, at = (key == threshold).nonzero(as_tuple=True)  # the ties: the later row, then the lower head
    chosen = head[torch.argsort((size - 1 - at) * heads.shape[0] + head)[: spare - int(above.sum())]]
    return (counts + torch.bincount(chosen, minlength=heads.shape[0]).to(device)).reshape(shape)


def global_budgets(scores: list[list[torch.Tensor]], total: int, n_sink: int, window: int) -> np.ndarray:
    """Tokens per KV head, int64 ``[L, Hkv]``, from one ranking of every head's tokens together.

    ``scores[layer][head]`` holds a head's scores ``[n]`` (comparable across heads); each head's
    first ``n_sink`` and last ``window`` rows (kept by the engine anyway) count first, then the
    ``total`` budget goes to the highest scores wherever they are (KVzip's allocation,
    "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416).
    The order, ties included, is :func:`global_counts`': restricted to one head it
    is the head's keep order, so the engine keeps exactly the rows this ranking chose.
    """
    shape = (len(scores), len(scores[0]) if scores else 0)
    heads = [head.detach().float().cpu().reshape(-1) for row in scores for head in row]
    if not heads:
        return np.zeros(shape, dtype=np.int64)
    lengths = torch.tensor([head.numel() for head in heads])  # [L * Hkv]
    padded = torch.nn.utils.rnn.pad_sequence(heads, batch_first=True, padding_value=float("-inf"))  # [L * Hkv, T]
    valid = torch.arange(padded.shape[-1]) < lengths.unsqueeze(-1)
    return global_counts(padded, valid, total, n_sink, window).reshape(shape).numpy()
