"""Compactor (arXiv 2507.08143): key leverage blended with non-causal chunked attention."""

from __future__ import annotations

import math

import torch

from common.checks import check_flag, check_integer, check_number
from runtime.math.arrays import to_device
from runtime.math.chunk_attention import ChunkSpec
from runtime.scorers.base import Scorer
from runtime.scorers.helpers import leverage_scores, masked, masked_zscore
from runtime.scorers.inputs import ChunkAttentionMass, KeyRope, LayerInputs


class LeverageScorer(Scorer):
    """Compactor ("Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
    Leverage Scores", arXiv 2507.08143): key leverage blended with non-causal chunked attention.

    ``score = z(attention) + blend * z(leverage)`` over the head's middle rows (all but the first
    ``exclude_first`` and last ``exclude_last``, which score the middle's maximum, i.e. are
    kept), where ``z`` standardises over those rows and

    * leverage (:func:`~runtime.scorers.helpers.leverage_scores`): of the head's **pre-RoPE** keys
      (``pre_rope``; RoPE is undone from each key's position), centred over the middle rows, exact
      or through a Gaussian sketch of ``sketch`` columns (``seed`` fixes it per (layer, KV head));
    * attention (:mod:`runtime.math.chunk_attention`, accumulated during the prefill): every prompt
      query (post-RoPE) attends non-causally to the keys of its own ``chunk``-token chunk (chunks
      start at the first middle row; only the queries from the first to the last middle row take part),
      logits ``attention_scale * q.k`` (None: the model's ``1/sqrt(d)``); the mass each key
      receives, averaged over the GQA group, times ``||v||`` (``value_norm``), then a mean over
      ``pool`` neighbours (zero-padded at the ends of the middle).

    Defaults follow kvpress 0.5.5's ``CompactorPress`` (``leverage_press.py``,
    ``non_causal_attention_press.py``): chunk 256, unscaled logits, ``||v||`` weighting,
    3-token pooling, 8 + 4 protected rows, sketch of 48 columns.  kvpress sets ``blend`` to
    the compression ratio (fraction evicted), which a per-head scorer does not know: pass it
    (``scorer_options={"blend": 0.75}``); the paper's own engine (compactor-vllm) uses 0.5.
    ``blend=None`` scores leverage alone, ``blend=0`` attention alone.  Differences from
    kvpress: statistics are per KV head (kvpress standardises over all heads of a layer), the
    sketch is seeded (kvpress draws a new one per call), and a short last chunk attends over
    its real keys only (kvpress pads it with zero keys that stay in the softmax).

    Undoing RoPE matters, the sketch does not, and the blend beats either part alone
    (docs/results.md R-leverage-ablations-2026-11-22).
    """

    name = "leverage"

    def __init__(
        self,
        blend: float | None = 0.5,
        sketch: int | None = 48,
        pre_rope: bool = True,
        chunk: int = 256,
        attention_scale: float | None = 1.0,
        value_norm: bool = True,
        pool: int = 3,
        exclude_first: int = 8,
        exclude_last: int = 4,
        seed: int = 0,
        ridge: float = 1e-6,
    ):
        # None: leverage alone; the sketch's columns, None: exact; the scale, None: the model's 1/sqrt(d)
        self.blend = None if blend is None else check_number("leverage blend", blend, minimum=0.0)
        self.sketch = None if sketch is None else check_integer("leverage sketch", sketch, minimum=1)
        self.pre_rope = check_flag("leverage pre_rope", pre_rope)
        self.chunk = check_integer("leverage attention chunk", chunk, minimum=1)
        self.attention_scale = (
            None if attention_scale is None else check_number("leverage attention_scale", attention_scale, above=0.0)
        )
        self.value_norm = check_flag("leverage value_norm", value_norm)
        self.pool = check_integer("leverage pool", pool, minimum=1, odd=True)
        self.exclude_first = check_integer("leverage exclude_first", exclude_first, minimum=0)
        self.exclude_last = check_integer("leverage exclude_last", exclude_last, minimum=0)
        self.seed = check_integer("leverage seed", seed)
        self.ridge = check_number("leverage ridge", ridge, above=0.0)
        self._layer_sketches: dict[tuple, torch.Tensor] = {}  # layer_sketch's, per (layer, heads, dim, device)

    @property
    def needs(self):
        needs = ()
        if self.blend != 0 and self.pre_rope:  # leverage of pre-RoPE keys (blend 0: attention alone)
            needs += (KeyRope(),)
        if self.blend is not None:  # the prompt's non-causal chunked attention (None: leverage alone)
            needs += (ChunkAttentionMass(self.chunk_spec),)
        return needs

    @property
    def chunk_spec(self) -> ChunkSpec:
        """The chunked attention this scorer reads, accumulated during the prefill
        (:mod:`runtime.math.chunk_attention`)."""
        return ChunkSpec(self.chunk, self.exclude_first, self.exclude_last, self.attention_scale)

    def sketch_matrix(self, layer: int, kv_head: int, dim: int) -> torch.Tensor:
        """The Gaussian sketch ``Phi [d, k]`` (entries ``N(0, 1/k)``) of one (layer, KV head), float64."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + layer * 1009 + kv_head)
        return torch.randn(dim, self.sketch, generator=generator, dtype=torch.float64) / math.sqrt(self.sketch)

    def layer_sketch(self, layer: int, heads: int, dim: int, device) -> torch.Tensor:
        """``[1, Hkv, d, k]`` float64 on ``device``: :meth:`sketch_matrix` of every KV head of ``layer``,
        drawn and moved once per (layer, heads, dim, device) and reused by every later call.  Drawn
        per call, a layer's sketches were ``2 Hkv + 2`` ops and a copy from pageable host memory,
        which on CUDA waits for the stream (a host synchronisation per scoring tile, issue 40)."""
        key = (layer, heads, dim, str(torch.device(device)))
        if key not in self._layer_sketches:
            drawn = torch.stack([self.sketch_matrix(layer, h, dim) for h in range(heads)]).unsqueeze(0)
            self._layer_sketches[key] = to_device(drawn, device)
        return self._layer_sketches[key]

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return self.combine(self.score_parts(inputs), inputs.valid)

    def score_parts(self, inputs: LayerInputs):
        """``(z(leverage), z(attention), middle)``: the standardised parts ``[R, Hkv, n]`` float64 (None
        where the blend leaves one out) and the middle rows; the blend only enters :meth:`combine`."""
        keys = inputs.keys
        n = keys.shape[2]
        device = keys.device
        lengths = to_device(inputs.lengths, device)
        first = lengths.clamp(max=self.exclude_first)  # [R, Hkv]
        last = (lengths - first).clamp(max=self.exclude_last)
        index = torch.arange(n, device=device)
        middle = (index >= first.unsqueeze(-1)) & (index < (lengths - last).unsqueeze(-1))  # [R, Hkv, n]
        leverage = masked_zscore(self.leverage(inputs, middle), middle) if self.blend != 0 else None
        attention = None
        if self.blend is not None:
            attention = masked_zscore(self.attention_mass(inputs, middle), middle)
        return leverage, attention, middle

    @classmethod
    def parts_options(cls, options: dict) -> dict:
        parts = dict(options)
        blend = parts.pop("blend", 0.5)  # which parts there are: leverage alone (None), attention alone (0), both
        parts["blend"] = blend if blend is None or blend == 0 else "positive"
        return parts

    def combine(self, parts, valid: torch.Tensor) -> torch.Tensor:
        leverage, attention, middle = parts
        rows, heads, n = middle.shape
        count = middle.sum(-1)  # [R, Hkv]
        score = torch.zeros(rows, heads, n, dtype=torch.float64, device=middle.device)
        if self.blend != 0:
            score = leverage * (1.0 if self.blend is None else self.blend)
        if self.blend is not None:
            score = score + attention
        score = score.float().masked_fill(~middle, float("-inf"))
        top = score.amax(-1, keepdim=True).expand_as(score)  # the middle's maximum: ends are kept
        score = torch.where(middle, score, top)
        score = torch.where((count <= 1).unsqueeze(-1), torch.zeros_like(score), score)  # nothing to rank
        return masked(score, valid)

    def leverage(self, inputs: LayerInputs, middle: torch.Tensor) -> torch.Tensor:
        """Leverage ``[R, Hkv, n]`` float64 of every head's ``middle`` rows (0 elsewhere); the keys'
        RoPE is undone in float32 (as the tests' oracle does), the leverage computed in float64
        (docs/results.md R-leverage-cost-2026-11-27)."""
        keys = inputs.keys.float()  # RoPE undone in float32: 6x faster than in float64
        if self.pre_rope:  # cos, sin [R, Hkv, n, d] in the layer's form (runtime.math.rope)
            keys = inputs[KeyRope()].undo(keys)
        sketch = None
        if self.sketch is not None:  # [1, Hkv, d, k], drawn per (layer, KV head)
            sketch = self.layer_sketch(inputs.layer, keys.shape[1], keys.shape[-1], keys.device)
        return leverage_scores(keys, middle, sketch, self.ridge)

    def attention_mass(self, inputs: LayerInputs, middle: torch.Tensor) -> torch.Tensor:
        """Chunked attention ``[R, Hkv, n]`` received by every head's ``middle`` rows (0 elsewhere),
        ``||v||``-weighted and pooled (kvpress scores the middle rows as a sequence of their own)."""
        rows, heads, n, _ = inputs.keys.shape
        mass = inputs[ChunkAttentionMass(self.chunk_spec)]  # [R, Hkv, n] float32
        if self.value_norm:
            mass = mass * inputs.values.float().norm(dim=-1)
        mass = mass * middle
        if self.pool > 1:  # a mean over neighbours, zero beyond the middle rows
            mass = torch.nn.functional.avg_pool1d(
                mass.reshape(rows * heads, 1, n), self.pool, stride=1, padding=self.pool // 2, count_include_pad=True
            ).reshape(rows, heads, n)
        return mass

    def __repr__(self) -> str:
        return (
            f"LeverageScorer(blend={self.blend}, sketch={self.sketch}, pre_rope={self.pre_rope}, chunk={self.chunk}, "
            f"attention_scale={self.attention_scale}, value_norm={self.value_norm}, pool={self.pool}, "
            f"exclude_first={self.exclude_first}, exclude_last={self.exclude_last}, seed={self.seed})"
        )
