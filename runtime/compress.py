"""Prefill a :class:`RaggedCache` and evict per head under a :class:`CompressionPolicy`.

    cache = RaggedCache.for_model(model)
    stats = prefill(model, cache, ids[:, :n], mask[:, :n], policy=policy)   # forward only
    report = compress(model, cache, policy, calibration, prompt_stats=stats)

``prefill`` runs the model over a chunk with the ragged attention function, recording what
the policy's scorer needs (pre-RoPE query statistics of the prompt through temporary forward
hooks on ``q_proj`` / ``q_norm``, or the last queries for SnapKV).  ``compress`` then gives
every (batch element, layer, KV head) its budget (``policy.head_budgets`` for that element's
real token count) and keeps sinks + recent window + the best-scored tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention import enable
from .cache import RaggedCache
from .policy import CompressionPolicy
from .rope import averaged_rope
from .scorers import HeadContext, select_rows


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _attention_modules(model) -> list:
    """The decoder layers' attention modules, in layer order."""
    modules = [module for module in model.modules() if hasattr(module, "q_proj") and hasattr(module, "layer_idx")]
    modules.sort(key=lambda module: module.layer_idx)
    if len(modules) != _text_config(model).num_hidden_layers:
        raise ValueError(f"found {len(modules)} attention modules with q_proj, expected "
                         f"{_text_config(model).num_hidden_layers}")
    return modules


class PromptQueryStats:
    """Per batch element, pre-RoPE query sums ``n, sum q, sum q q^T`` per (layer, query head).

    Hooks ``q_norm`` where the attention has one (after the norm), else ``q_proj``; only real
    (non-padding) tokens count, and :func:`prefill` leaves out the policy's ``n_sink`` first
    tokens (outlier queries of attention sinks).  Sums are float64 (the outer products are formed in float32
    per chunk, then added).
    """

    def __init__(self, model, batch_size: int):
        config = _text_config(model)
        self.modules = _attention_modules(model)
        self.num_q_heads = int(config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_q_heads)
        layers = len(self.modules)
        self.count = np.zeros(batch_size, dtype=np.int64)
        self.total = torch.zeros(batch_size, layers, self.num_q_heads, self.head_dim, dtype=torch.float64)
        self.outer = torch.zeros(batch_size, layers, self.num_q_heads, self.head_dim, self.head_dim,
                                 dtype=torch.float64)
        self.real: torch.Tensor | None = None  # bool [B, T] of the chunk being run
        self._handles = []

    def __enter__(self):
        for layer, module in enumerate(self.modules):
            target = module.q_norm if hasattr(module, "q_norm") else module.q_proj
            self._handles.append(target.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            queries = output.detach().reshape(output.shape[0], output.shape[1], self.num_q_heads, self.head_dim)
            for b in range(queries.shape[0]):
                rows = queries[b] if self.real is None else queries[b][self.real[b]]  # [T, Hq, d]
                rows = rows.float().cpu()
                self.total[b, layer] += rows.sum(0).double()
                self.outer[b, layer] += torch.einsum("thd,the->hde", rows, rows).double()
                if layer == 0:
                    self.count[b] += rows.shape[0]
        return hook

    def mean_cov(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Population mean ``[L, Hq, d]`` and covariance ``[L, Hq, d, d]`` of element ``b`` (float64)."""
        n = int(self.count[b])
        if n == 0:
            raise ValueError(f"no prompt queries were recorded for batch element {b}")
        mean = self.total[b] / n
        cov = self.outer[b] / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
        return mean, cov


def _needs(policy: CompressionPolicy | None):
    scorer = policy.build_scorer() if policy is not None else None
    prompt_stats = scorer is not None and scorer.query_statistics == "prompt"
    window = scorer.observation_window if scorer is not None else 0
    return prompt_stats, window


@torch.no_grad()
def prefill(model, cache: RaggedCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
            policy: CompressionPolicy | None = None, prompt_stats: PromptQueryStats | None = None,
            record_prompt_stats: bool = False, observe_queries: int = 0, n_sink: int | None = None):
    """Run ``input_ids [B, T]`` into ``cache`` and return the prompt query statistics (or None).

    ``attention_mask [B, past + T]`` (1 real, 0 padding) covers the columns already in the
    cache plus this chunk; None means no padding.  Positions follow the real tokens.
    What is recorded follows ``policy``'s scorer; ``record_prompt_stats`` / ``observe_queries``
    record more (to compress copies of one prefilled cache under several policies), with the
    first ``n_sink`` tokens (default: the policy's, else 0) left out of the statistics.
    Pass the returned statistics back in (``prompt_stats=``) when prefilling in several chunks.
    """
    enable(model)
    batch, length = input_ids.shape
    past = cache.get_seq_length()
    if attention_mask is None:
        attention_mask = torch.ones(batch, past + length, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape != (batch, past + length):
        raise ValueError(f"attention_mask must cover the {past} cached columns plus the {length} new ones: "
                         f"expected shape {(batch, past + length)}, got {tuple(attention_mask.shape)}")
    chunk_mask = attention_mask[:, past:].bool()
    seen = torch.tensor(cache.layers[0].real_seen if cache.layers[0].is_initialized else [0] * batch,
                        device=input_ids.device)
    position_ids = (seen.unsqueeze(1) + chunk_mask.long().cumsum(-1) - 1).clamp(min=0)
    wants_stats, window = _needs(policy)
    wants_stats = wants_stats or record_prompt_stats
    window = max(window, int(observe_queries))
    if window:
        cache.observe_queries(window)
    if wants_stats and prompt_stats is None:
        prompt_stats = PromptQueryStats(model, batch)
    if prompt_stats is not None:
        # the first n_sink tokens (attention sinks, outlier queries) stay out of the statistics
        skip = n_sink if n_sink is not None else (policy.n_sink if policy is not None else 0)
        prompt_stats.real = chunk_mask & (position_ids >= skip)
        with prompt_stats:
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  past_key_values=cache, use_cache=True, logits_to_keep=1)
    else:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
              past_key_values=cache, use_cache=True, logits_to_keep=1)
    return prompt_stats


@dataclass
class CompressionReport:
    budgets: np.ndarray  # int64 [B, L, Hkv] budget given to each head
    lengths_before: np.ndarray  # int64 [L, B, Hkv]
    lengths_after: np.ndarray  # int64 [L, B, Hkv]
    kv_bytes_before: int
    kv_bytes_after: int
    seconds: float


@torch.no_grad()
def compress(model, cache: RaggedCache, policy: CompressionPolicy, calibration=None,
             prompt_stats: PromptQueryStats | None = None, *, context_lengths: list[int] | None = None,
             final: bool = True) -> CompressionReport:
    """Evict every KV head of ``cache`` down to its budget (see the module docstring).

    Budgets are computed for each batch element's real token count, or for
    ``context_lengths[b]`` when given (block-wise prefill: the whole context's budget applied
    after every block).  ``final=False`` keeps recording the last queries for later blocks.
    """
    started = time.perf_counter()
    policy.check_calibration(calibration)
    scorer = policy.build_scorer()
    config = _text_config(model)
    num_layers = int(config.num_hidden_layers)
    num_q_heads = int(config.num_attention_heads)
    first = cache.layers[0]
    if not first.is_initialized:
        raise ValueError("the cache is empty: prefill it before compressing")
    if len(cache.layers) != num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, the model {num_layers}")
    num_kv_heads = first.num_heads
    group = num_q_heads // num_kv_heads
    modules = _attention_modules(model)
    if scorer.query_statistics == "prompt" and prompt_stats is None:
        raise ValueError(f"{scorer!r} needs the prompt's query statistics: prefill with policy=... first")
    if scorer.observation_window and any(q is None for layer in cache.layers for q in layer.recent_queries):
        raise ValueError(f"{scorer!r} needs the last prompt queries: prefill with policy=... first")
    if scorer.query_statistics == "calibrated":
        identity = calibration.identity
        if (identity.num_layers, identity.num_q_heads) != (num_layers, num_q_heads):
            raise ValueError("calibration statistics do not match the model's layers / query heads")
        calibrated_mean = torch.from_numpy(np.asarray(calibration.query_mean))
        calibrated_cov = torch.from_numpy(np.asarray(calibration.query_cov))
    inf_weights = calibration.inf_weights if (policy.allocation == "inf" and calibration is not None) else None

    lengths_before = cache.head_lengths().numpy()
    bytes_before = cache.kv_bytes()
    all_budgets = []
    if context_lengths is not None and len(context_lengths) != first.batch_size:
        raise ValueError(f"context_lengths has {len(context_lengths)} entries for a batch of {first.batch_size}")
    for b in range(first.batch_size):
        seq_len = first.real_seen[b]  # the next token's absolute position
        if seq_len == 0:
            all_budgets.append(np.zeros((num_layers, num_kv_heads), dtype=np.int64))
            continue
        budget_length = seq_len if context_lengths is None else max(int(context_lengths[b]), 1)
        budgets = policy.head_budgets(budget_length, num_layers, num_kv_heads, inf_weights)
        all_budgets.append(budgets)
        cos = sin = None
        if scorer.rope_horizon:
            cos, sin = averaged_rope(model, seq_len, scorer.rope_horizon)
        if scorer.query_statistics == "prompt":
            mean_all, cov_all = prompt_stats.mean_cov(b)
        elif scorer.query_statistics == "calibrated":
            mean_all, cov_all = calibrated_mean, calibrated_cov
        for layer_idx, layer in enumerate(cache.layers):
            scaling = float(getattr(modules[layer_idx], "scaling", layer.head_dim ** -0.5))
            for h in range(num_kv_heads):
                keys, values, positions = layer.head(b, h)
                budget = int(budgets[layer_idx, h])
                if budget >= keys.shape[0]:
                    continue
                heads = slice(h * group, (h + 1) * group)
                context = HeadContext(layer=layer_idx, kv_head=h, keys=keys, values=values, positions=positions,
                                      scaling=scaling, next_position=seq_len, rope_cos=cos, rope_sin=sin)
                if scorer.query_statistics is not None:
                    context.query_mean = mean_all[layer_idx, heads]
                    context.query_cov = cov_all[layer_idx, heads]
                if scorer.observation_window:
                    recorded = layer.recent_queries[b]  # [Hq, w_recorded, d]
                    if recorded.shape[1] < min(scorer.observation_window, seq_len):
                        raise ValueError(f"{scorer!r} needs the last {scorer.observation_window} queries, only "
                                         f"{recorded.shape[1]} were recorded at prefill")
                    context.recent_queries = recorded[heads, -scorer.observation_window:]
                scores = scorer.score(context)
                if scores.shape != (keys.shape[0],):
                    raise ValueError(f"{scorer!r} returned scores of shape {tuple(scores.shape)} for "
                                     f"{keys.shape[0]} tokens")
                layer.keep(b, h, select_rows(scores, budget, policy.n_sink, policy.window))
    if final:
        for layer in cache.layers:
            layer.recent_queries = [None] * layer.batch_size
            layer.observe_queries = 0
    return CompressionReport(budgets=np.stack(all_budgets), lengths_before=lengths_before,
                             lengths_after=cache.head_lengths().numpy(), kv_bytes_before=bytes_before,
                             kv_bytes_after=cache.kv_bytes(), seconds=time.perf_counter() - started)
