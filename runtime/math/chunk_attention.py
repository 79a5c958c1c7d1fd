"""Compactor's non-causal chunked attention, computed inside the prefill while each chunk's queries are at hand.

Compactor ("Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage
Scores", arXiv 2507.08143; :class:`runtime.scorers.leverage.LeverageScorer`) blends key leverage with
the attention every prompt key receives from the queries of its own chunk of ``C`` tokens, softmax
over that chunk's keys only, no causal mask.  Chunks start at position ``first`` (the protected
first rows stay out) and the prompt's last ``last`` tokens take no part, so with ``n`` tokens seen
the chunks are ``[first + kC, first + (k+1)C)`` cut at ``n - last``.

Recording every prompt query until the compression (what the scorer did before) holds ``L x Hq x n x
d`` numbers: 8.6 GB for a 32K-token prompt on Llama-3.1-8B in bf16.  A :class:`ChunkAttention` per
(layer, batch row) instead keeps the mass of every chunk that can no longer change (its end at or
before ``seen - last``: later tokens can only lengthen the prompt) and holds back only the queries and
keys of the chunk still open (at most ``C + last`` plus one forward pass's tokens).  The mass a key
receives is then the same as from the recorded queries (``tests/test_chunk_attention.py`` checks it
against :func:`runtime.scorers.helpers.chunked_attention_mass`).  A key's mass is final once its
chunk closes: a key evicted between prefill blocks still took part in its chunk's softmax, and on a
sliding-window layer the chunks are counted from position ``first``, not from the oldest row held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits per query head scored in one batched matmul, as many whole chunks as fit (at least one).
# On a CPU ``Hq x 131072`` floats (16 MiB for 32 query heads): at C = 256 that is 2 chunks, 0.84x the
# time per layer of 8 (R-chunk-mass-underflow-2026-11-27); smaller chunks batch more of them (their
# cost per layer: R-chunk-size-2026-11-27).  On an accelerator every op is a kernel launch the host
# pays for whatever its size: 2 chunks a product made a 32K-token row 64 products of about 30
# ops per layer, ~15,000 ops per layer at 32K x 8 (R-prefill-host-ops-2026-11-28).  There it is
# ``Hq x 2^21`` floats (256 MiB for 32 query heads, 32 chunks of 256), taken while the layer's
# attention runs, below the MLP's activations that make the prefill's peak.
_LOGITS_AT_ONCE = 2 * 256 * 256
_ACCELERATOR_LOGITS_AT_ONCE = 1 << 21

# The lowest argument the chunk mass exponentiates: torch's CPU ``exp`` is 10-80x slower where its
# result underflows float32 (arguments below about -87, and -inf; ``softmax`` has its own kernel and
# is not), and a weight of e^-80 = 1.8e-35 beside the row maximum's 1 moves no mass by more than
# ``c x 1.8e-35`` (docs/results.md R-chunk-mass-underflow-2026-11-27).
_EXP_FLOOR = -80.0


@dataclass(frozen=True)
class ChunkSpec:
    """Which chunked attention to accumulate: ``chunk`` tokens per chunk, the first chunk at position
    ``first``, the last ``last`` tokens left out, logits ``scale * q.k`` (None: the layer's own
    attention scale)."""

    chunk: int
    first: int
    last: int
    scale: float | None


def chunk_mass(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The mass every key of equal chunks receives from its chunk's queries: ``queries [Hkv, G, K,
    c, d]``, ``keys [Hkv, K, c, d]`` (``K`` chunks of ``c`` tokens) -> float32 ``[Hkv, K, c]``, the sum
    over the chunk's queries of their softmax weights, averaged over the ``G`` query heads."""
    heads, group, chunks, size, dim = queries.shape
    budget = _LOGITS_AT_ONCE if queries.device.type == "cpu" else _ACCELERATOR_LOGITS_AT_ONCE
    at_once = max(1, budget // (size * size))
    masses = []
    for lo in range(0, chunks, at_once):
        hi = min(lo + at_once, chunks)
        block = queries[:, :, lo:hi].float().transpose(1, 2).reshape(heads, hi - lo, group * size, dim)
        logits = block @ keys[:, lo:hi].float().transpose(-1, -2)  # [Hkv, k, G*c, c]
        if scale != 1.0:
            logits.mul_(scale)
        # each query's softmax, summed over the queries as one product: exp in place, then the
        # queries' 1 / sum weights the rows (1.9x faster than softmax and a sum, R-chunk-mass-2026-11-27)
        # clamped at _EXP_FLOOR first: 11% of the embedded model's unscaled chunk logits are below max - 87
        weights = logits.sub_(logits.amax(-1, keepdim=True)).clamp_(min=_EXP_FLOOR).exp_()  # [Hkv, k, G*c, c]
        inverse = weights.sum(-1).reciprocal_().unsqueeze(-2)  # [Hkv, k, 1, G*c]
        masses.append((inverse @ weights).squeeze(-2) / group)  # [Hkv, k, c]: mean over the G heads
    return torch.cat(masses, dim=1)


class ChunkAttention:
    """One (layer, batch row)'s chunked attention (see the module docstring): ``mass [Hkv, m]`` of the
    positions ``0 .. m - 1`` whose chunks closed (0 outside any chunk), and the open chunk's
    post-RoPE ``queries [Hq, p, d]`` and ``keys [Hkv, p, d]`` from position ``m``."""

    def __init__(self, spec: ChunkSpec):
        self.spec = spec
        self.mass: torch.Tensor | None = None  # [Hkv, m] float32
        self.queries: torch.Tensor | None = None  # [Hq, p, d]
        self.keys: torch.Tensor | None = None  # [Hkv, p, d]
        self.seen = 0  # tokens added: the next one's position

    def copy(self) -> ChunkAttention:
        """An independent copy (the tensors are never changed in place, so they are shared)."""
        other = ChunkAttention(self.spec)
        other.mass, other.queries, other.keys, other.seen = self.mass, self.queries, self.keys, self.seen
        return other

    @property
    def closed(self) -> int:
        """Positions whose mass is final: ``m``."""
        return 0 if self.mass is None else self.mass.shape[1]

    def add(self, queries: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
        """Add the next real tokens of the row, consecutive positions from :attr:`seen`: post-RoPE
        ``queries [Hq, t, d]`` and ``keys [Hkv, t, d]``; ``scale``: the layer's attention scale
        (used when the spec has none).  Closes every chunk that ends at or before ``seen - last``."""
        count = queries.shape[1]
        spec = self.spec
        start = self.seen
        self.seen += count
        if self.mass is None:
            self.mass = torch.zeros(keys.shape[0], 0, dtype=torch.float32, device=keys.device)
        skip = max(0, spec.first - start)  # the protected first positions take no part
        if skip >= count:
            return
        queries, keys = queries[:, skip:], keys[:, skip:]
        if self.queries is None:  # the first chunk starts here; the positions before it get no mass
            self.queries, self.keys = queries.clone(), keys.clone()  # not views of the whole batch's
            self.mass = torch.nn.functional.pad(self.mass, (0, start + skip - self.closed))
        else:
            self.queries = torch.cat([self.queries, queries], dim=1)
            self.keys = torch.cat([self.keys, keys], dim=1)
        closing = (self.seen - spec.last - self.closed) // spec.chunk  # whole chunks that can no longer change
        if closing > 0:
            size = closing * spec.chunk
            mass = self._masses(self.queries[:, :size], self.keys[:, :size], closing, scale)
            self.mass = torch.cat([self.mass, mass], dim=1)
            self.queries, self.keys = self.queries[:, size:].clone(), self.keys[:, size:].clone()

    def masses(self, scale: float) -> torch.Tensor:
        """float32 ``[Hkv, seen]``: every position's mass with the prompt ending here (the open chunk
        cut at ``seen - last``; positions in the last ``last`` get 0).  Changes nothing."""
        if self.mass is None:
            raise ValueError("no token was added: nothing to score")
        mass = self.mass
        tail = self.seen - self.spec.last - self.closed  # the open chunk's tokens that take part
        if tail > 0 and self.queries is not None:
            mass = torch.cat([mass, self._masses(self.queries[:, :tail], self.keys[:, :tail], 1, scale)], dim=1)
        return torch.nn.functional.pad(mass, (0, self.seen - mass.shape[1]))

    def _masses(self, queries: torch.Tensor, keys: torch.Tensor, chunks: int, scale: float) -> torch.Tensor:
        """``[Hkv, chunks * c]`` of ``queries [Hq, chunks * c, d]`` over ``keys [Hkv, chunks * c, d]``."""
        heads, length, dim = keys.shape
        size = length // chunks
        grouped = queries.reshape(heads, -1, chunks, size, dim)  # [Hkv, G, K, c, d]
        blocks = keys.reshape(heads, chunks, size, dim)
        spec_scale = scale if self.spec.scale is None else self.spec.scale
        return chunk_mass(grouped, blocks, spec_scale).reshape(heads, length)


def masses_at_positions(
    accumulated: list[dict | None], spec: ChunkSpec, positions: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """float32 ``[R, Hkv, n]``: the mass of every key at ``positions`` int64 ``[R, Hkv, n]`` (``valid``
    bool, padding 0), from each row's accumulated ``{ChunkSpec: ChunkAttention}`` (``accumulated[r]``);
    ``scale``: the layer's attention scale."""
    masses = []
    for attentions in accumulated:
        attention = None if attentions is None else attentions.get(spec)
        if attention is None:
            raise ValueError(
                f"the prompt's chunked attention ({spec.chunk}-token chunks) was not accumulated: prefill with "
                "policy=... for this scorer"
            )
        masses.append(attention.masses(scale))  # [Hkv, seen]
    width = max(mass.shape[1] for mass in masses)
    mass = torch.stack([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masses]).to(positions.device)
    return mass.gather(-1, positions.clamp(0, max(width - 1, 0))) * valid
