"""KVzip: KV importance from a context-reconstruction pass ("KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416).

    cache = RaggedCache.for_model(model)
    prefill(model, cache, context_ids)                                  # the context, as usual
    scores = kvzip_scores(model, tokenizer, cache, context_ids)         # the reconstruction pass
    compress(model, cache, with_kvzip_scores(policy, scores), calibration)

After the context is prefilled, the model is asked to repeat it: the input is a repeat
instruction, the chat template's assistant turn, then the context itself (teacher-forced),
in chunks of ``chunk_size`` tokens (later chunks: "Repeat the part of the previous context
exactly, starting with" + the previous chunk's last ``overlap`` tokens).  Every reconstruction
token attends, in every layer, to the whole prefilled cache plus the chunk itself (causal),
exactly as a normal forward would; nothing of the chunk is kept: the pass runs over a
read-only view of the cache (:class:`ReconstructionView`), so the cache is neither copied nor
changed and memory stays bounded by one chunk.

A cached KV pair's score is the largest attention weight any reconstruction query of its
GQA group gives it, where (as in the paper's code and kvpress's ``KVzipPress``) the softmax
of chunk ``c`` runs over the template prefix (``sink`` rows: the system prompt), the cached
rows of the context span chunk ``c`` reconstructs, and the chunk's own tokens (in a sliding-window layer,
those inside each query's window, as its forward pass sees them); the scores are
the running maximum over chunks.  Rows of the prefix are scored too (they sit in every
chunk's softmax).  :class:`KVzipScorer` (``runtime.scorers``' name ``"kvzip"``) reads these
scores back; with ``allocation="global"`` the engine ranks every head's tokens together, the
paper's own allocation (one global top-k over every layer and KV head; :func:`kvzip_budgets`
computes those budgets directly).

Cost: one more forward pass over about the context's length (the chunks plus their
instructions), each layer attending to the whole context: roughly one to two prefills.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from runtime.compression.keep_rule import global_budgets
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.cache import (
    LAYER_TAG,
    RaggedCache,
    RaggedLayer,
    SharedChunk,
    row_layer,
    stacked_recurrent_layer,
)
from runtime.kv_store.eager_attention import eager_attention_forward, soft_cap
from runtime.kv_store.layer_attention import at_the_chunks_columns, masked_sdpa
from runtime.kv_store.transformers_compat import cache_argument, query_length
from runtime.math.geometry import ModelGeometry
from runtime.plan.policy import CompressionPolicy
from runtime.scorers import KVzipScorer, KVzipScores

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"


def with_kvzip_scores(policy: CompressionPolicy, scores: KVzipScores) -> CompressionPolicy:
    """``policy`` with its scorer replaced by :class:`KVzipScorer` over ``scores``."""
    if not uses_kvzip(policy):
        raise ValueError(f"policy {policy.describe()} does not use the kvzip scorer")
    return dataclasses.replace(policy, scorer=KVzipScorer(scores), scorer_options={})


def repeat_template(tokenizer) -> tuple[int, list[int]]:
    """``(prefix_length, suffix_ids)`` of the tokenizer's chat template around one user turn.

    ``prefix_length``: tokens before the user's text (system prompt and user header), the
    part of a chat-formatted context that is not reconstructed; ``suffix_ids``: what follows
    the user's text up to the assistant's answer (end of turn, assistant header).  Without a
    chat template: ``(1 if the tokenizer adds a BOS else 0, ids of "\\n")``.
    """
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if not getattr(tokenizer, "chat_template", None):
        bos = tokenizer("x", add_special_tokens=True)["input_ids"]
        return (1 if len(bos) > len(encode("x")) else 0), encode("\n")
    marker, separator = "kvzip context", "\n##############"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker + separator}], tokenize=False, add_generation_prompt=True
    )
    head, suffix = text.split(separator)
    return len(encode(head.split(marker)[0])), encode(suffix)


def reconstruction_chunks(
    tokenizer,
    context_ids: list[int],
    prefix_length: int,
    suffix_ids: list[int],
    chunk_size: int = 2048,
    overlap: int = 8,
) -> list[tuple[int, int, list[int]]]:
    """``(start, end, input_ids)`` per chunk: positions ``[start, end)`` of the context it
    reconstructs and its input (instruction + suffix + those context tokens)."""
    if chunk_size <= 0:
        raise ValueError(f"kvzip chunk_size must be positive, got {chunk_size}")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    body = list(context_ids[prefix_length:])
    chunks = []
    for index, start in enumerate(range(0, len(body), chunk_size)):
        part = body[start : start + chunk_size]
        instruction = (
            encode(REPEAT_FIRST) if index == 0 else encode(REPEAT_NEXT) + body[max(start - overlap, 0) : start]
        )
        chunks.append((prefix_length + start, prefix_length + start + len(part), instruction + list(suffix_ids) + part))
    return chunks


class ReconstructionLayer(DynamicLayer):
    """A read-only view of one row of a :class:`RaggedLayer` for the reconstruction pass.

    ``update`` parks the chunk (tagged so that the registered ragged attention function hands
    over to :meth:`attend`); :meth:`attend` attends to the row's retained tokens plus the
    chunk (causal) without storing anything, and records the KVzip scores of the chunk.
    """

    is_croppable = False

    def __init__(self, base: RaggedLayer, row: int, scores: torch.Tensor, query_block: int):
        super().__init__()
        self.base, self.row, self.scores, self.query_block = base, row, scores, int(query_block)
        self.span = (0, 0)  # positions [start, end) of the context the current chunk reconstructs
        self.sink = 0  # the first `sink` positions sit in every chunk's softmax
        self._pending = None
        self._shared = None  # what the layers reading the base layer's cache attend (attend_shared)
        self.is_initialized = True
        self.dtype, self.device = base.dtype, base.device

    @property
    def real_seen(self) -> list[int]:
        return [self.base.real_seen[self.row]]

    @property
    def mask_window(self) -> int | None:
        """The base layer's window where the attention module passes none (runtime.compression.ragged_attention)."""
        return self.base.mask_window

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError("the reconstruction pass runs one prompt at a time")
        self._pending = (key_states, value_states)
        setattr(key_states, LAYER_TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.base.tokens_seen

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        return query_length(query), self.base.tokens_seen  # the chunk's own causal mask (see runtime.kv_store.cache)

    def attend(
        self, query: torch.Tensor, real, positions, scaling: float, *, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        """The model's own attention of the chunk (its sliding ``window``, ``softcap`` and learned
        ``sinks`` as :meth:`RaggedLayer.attend` takes them), and the chunk's KVzip scores (soft-capped
        logits; KVzip's softmax has no sink)."""
        if self._pending is None:
            raise RuntimeError("ReconstructionLayer.attend called without a parked chunk")
        if real is not None and not bool(real.all()):
            raise ValueError("the reconstruction chunk has no padding")
        new_keys, new_values = self._pending
        self._pending = None
        q_len = query.shape[2]
        output = self._attention(query, new_keys, new_values, positions, scaling, window, softcap, sinks)
        if self.base.shared_by:  # the layers reading the base layer's cache attend the same keys next, scoring nothing
            self._shared = SharedChunk(
                lambda query: at_the_chunks_columns(
                    lambda query: self._attention(
                        query, new_keys, new_values, positions, scaling, window, softcap, None
                    ),
                    query,
                    q_len,
                ),
                q_len,
                window,
                softcap,
                None,
                self.base.shared_by,
            )
        group = query.shape[1] // self.base.num_heads
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        start, end = self.span
        for h in range(self.base.num_heads):
            keys, _, kept_positions = self.base.head(self.row, h)
            q = query[0, h * group : (h + 1) * group]  # [G, q, d]
            # the score: softmax over the prefix, this chunk's context span and the chunk itself
            kept_positions = kept_positions.long()
            rows = ((kept_positions < self.sink) | ((kept_positions >= start) & (kept_positions < end))).nonzero()
            rows = rows.squeeze(1)
            scored = keys.index_select(0, rows).float()  # [m, d]
            own = new_keys[0, h].float()
            best = torch.zeros(rows.shape[0], dtype=torch.float32, device=query.device)
            if window is not None:  # a sliding layer's query at p sees keys at k > p - W, as in its forward pass
                key_positions = torch.cat([kept_positions.index_select(0, rows), positions[0].long().to(rows.device)])
                visible = positions[0].long().to(rows.device).unsqueeze(1) - key_positions.unsqueeze(0) < window
                visible[:, rows.shape[0] :] &= causal
            for lo in range(0, q_len, self.query_block):
                hi = min(lo + self.query_block, q_len)
                block = q[:, lo:hi].float()  # [G, b, d]
                logits = soft_cap(torch.cat([block @ scored.T, block @ own.T], dim=-1) * scaling, softcap)
                if window is None:
                    logits[..., rows.shape[0] :].masked_fill_(~causal[lo:hi], float("-inf"))
                else:
                    logits.masked_fill_(~visible[lo:hi], float("-inf"))
                weights = torch.softmax(logits, dim=-1)[..., : rows.shape[0]]
                best = torch.maximum(best, weights.amax(dim=(0, 1)))
            target = self.scores[h]
            where = kept_positions.index_select(0, rows).to(target.device)
            target[where] = torch.maximum(target[where], best.to(target.device))
        return output

    def attend_shared(self, query: torch.Tensor, *, window=None, softcap=None) -> tuple[torch.Tensor, bool]:
        """A layer reading the base layer's cache (``RaggedLayer.attend_shared``) attends its ``query`` over what
        :meth:`attend` attended (the chunk's last columns where it has fewer), scoring nothing: its outputs reach
        only later readers, never a layer kvcal scores (the readers are the model's last layers).  Returns
        ``(output, False)``: nothing follows a reconstruction layer's attention."""
        if self._shared is None:
            raise RuntimeError("a layer reading the reconstruction layer's cache attended before it did")
        output = self._shared.read(query, window, softcap, None)
        if not self._shared.left:
            self._shared = None
        return output, False

    def _attention(self, query, new_keys, new_values, positions, scaling, window, softcap, sinks) -> torch.Tensor:
        """``[1, q, Hq, dv]``: each query head over its KV head's retained tokens of the row and the chunk (causal);
        ``dv`` the values' head dim."""
        _, num_q_heads, q_len, _ = query.shape
        group = num_q_heads // self.base.num_heads
        output = query.new_zeros(1, q_len, num_q_heads, new_values.shape[-1])
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        for h in range(self.base.num_heads):
            keys, values, kept_positions = self.base.head(self.row, h)
            old = keys.shape[0]
            q = query[0, h * group : (h + 1) * group]  # [G, q, d]
            all_keys = torch.cat([keys, new_keys[0, h]])
            all_values = torch.cat([values, new_values[0, h]])
            mask = torch.ones(q_len, old + q_len, dtype=torch.bool, device=query.device)
            mask[:, old:] = causal
            if window is not None:  # a query at p sees keys at k > p - W
                key_positions = torch.cat([kept_positions.long(), positions[0].long().to(kept_positions.device)])
                mask &= positions[0].long().unsqueeze(1) - key_positions.unsqueeze(0) < window
            if softcap is None and sinks is None:
                out = masked_sdpa(q.unsqueeze(0), all_keys[None, None], all_values[None, None], mask, scaling)[0]
                # [G, q, d]: the model's own attention, nothing dropped
            else:  # sdpa cannot soft-cap nor take a sink
                out = eager_attention_forward(
                    None,
                    q.unsqueeze(0),
                    all_keys[None, None],
                    all_values[None, None],
                    mask[None, None],
                    scaling=scaling,
                    softcap=softcap,
                    s_aux=None if sinks is None else sinks[h * group : (h + 1) * group],
                )[0][0].transpose(0, 1)  # [G, q, d]
            output[0, :, h * group : (h + 1) * group] = out.transpose(0, 1)
        return output


class ReconstructionView(Cache):
    """``Cache`` of :class:`ReconstructionLayer` views over row ``row`` of a :class:`RaggedCache`; beside them the
    states of that row in its other layers (a hybrid model's recurrent layers, Gemma 4's sliding ones) as the
    context left them, restored before each chunk (each chunk follows the context, as in one forward pass of
    context and chunk)."""

    def __init__(self, cache: RaggedCache, row: int, scores: torch.Tensor, query_block: int = 512):
        views = iter(
            ReconstructionLayer(layer, row, scores[index], query_block)
            for index, layer in enumerate(cache.attention_layers)
        )
        others = {**cache.recurrent_layers, **cache.window_layers}
        self._recurrent = {index: (layer, row) for index, layer in others.items()}
        super().__init__(
            layers=[
                _row_state(*self._recurrent[i]) if i in self._recurrent else next(views)
                for i in range(len(cache.layers))
            ]
        )

    def set_chunk(self, sink: int, start: int, end: int) -> None:
        for index, (source, row) in self._recurrent.items():
            self.layers[index] = _row_state(source, row)
        for layer in self.layers:
            if isinstance(layer, ReconstructionLayer):
                layer.sink, layer.span = sink, (start, end)


def _row_state(layer, row: int):
    """A new cache layer holding batch row ``row`` of ``layer``'s states (a recurrent layer's, a sliding layer's
    window: the reconstruction never writes the cache's own)."""
    if isinstance(layer, RaggedLayer):
        return row_layer(layer, row)
    state = stacked_recurrent_layer([layer])
    state.reorder_cache(torch.tensor([row], dtype=torch.long))
    return state


@torch.no_grad()
def kvzip_scores(
    model,
    tokenizer,
    cache: RaggedCache,
    context_ids,
    *,
    row: int = 0,
    prefix_length: int | None = None,
    chunk_size: int = 2048,
    overlap: int = 8,
    query_block: int = 512,
) -> KVzipScores:
    """KVzip scores of every cached row of ``cache``'s row ``row`` (see the module docstring).

    ``context_ids``: the real token ids the row was prefilled with (list or 1-D / ``[1, T]``
    tensor); ``prefix_length``: how many of them are chat-template head (default: measured
    from the tokenizer's chat template, :func:`repeat_template`), left out of the
    reconstruction but kept in every chunk's softmax.  The cache is not changed.
    """
    started = time.perf_counter()
    ids = torch.as_tensor(context_ids).reshape(-1).tolist()
    layer0 = cache.attention_layers[0]
    if not layer0.is_initialized:
        raise ValueError("the cache is empty: prefill the context first")
    if cache.stateful:
        raise ValueError(
            "KVzip's reconstruction is not built for layers that run a recurrent mixer beside their attention "
            "(Falcon-H1's hybrid layers): score with another scorer"
        )
    if not 0 <= row < layer0.batch_size:
        raise ValueError(f"row {row} outside the cache's batch of {layer0.batch_size}")
    if layer0.real_seen[row] != len(ids):
        raise ValueError(f"the cache row holds {layer0.real_seen[row]} tokens, context_ids has {len(ids)}")
    detected, suffix = repeat_template(tokenizer)
    prefix = detected if prefix_length is None else int(prefix_length)
    if not 0 <= prefix < len(ids):
        raise ValueError(f"prefix_length {prefix} leaves nothing of the {len(ids)}-token context to reconstruct")
    heads = ModelGeometry.of(model).num_kv_heads
    device = layer0.device
    scores = torch.zeros(len(cache.attention_layers), heads, len(ids), dtype=torch.float32, device=device)
    view = ReconstructionView(cache, row, scores, query_block)
    chunks = reconstruction_chunks(tokenizer, ids, prefix, suffix, chunk_size, overlap)
    seen = layer0.real_seen[row]
    attention_chunk = min(
        (layer.attention_chunk for layer in cache.attention_layers if layer.attention_chunk), default=0
    )
    if attention_chunk and seen + max(len(chunk_ids) for _, _, chunk_ids in chunks) > attention_chunk:
        raise ValueError(
            f"KVzip's reconstruction runs after the context (positions {seen} on), past the model's first attention "
            f"chunk of {attention_chunk} positions, where its chunked layers' queries see only their own chunk, not "
            "the context: score with another scorer (or a context that leaves the reconstruction inside that chunk)"
        )
    tokens = 0
    with ragged_attention(model):
        for start, end, chunk_ids in chunks:
            view.set_chunk(prefix, start, end)
            input_ids = torch.tensor([chunk_ids], dtype=torch.long, device=device)
            positions = seen + torch.arange(len(chunk_ids), device=device).unsqueeze(0)
            model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_argument(model, view),
            )
            tokens += len(chunk_ids)
    last_keys = torch.stack(
        [torch.stack([_key_at(layer, row, h, len(ids) - 1) for h in range(heads)]) for layer in cache.attention_layers]
    )
    return KVzipScores(
        scores=scores.cpu(),
        last_keys=last_keys,
        prefix_length=prefix,
        chunks=len(chunks),
        reconstruction_tokens=tokens,
        seconds=time.perf_counter() - started,
    )


def _key_at(layer: RaggedLayer, row: int, h: int, position: int) -> torch.Tensor:
    keys, _, positions = layer.head(row, h)
    hit = (positions.long() == position).nonzero()
    if hit.numel() == 0:
        return torch.full((keys.shape[1],), float("nan"))
    return keys[int(hit[0, 0])].float().cpu()


def kvzip_budgets(scores: KVzipScores, keep_ratio: float, n_sink: int = 4, window: int = 32) -> np.ndarray:
    """KVzip's own allocation: int64 ``[L, Hkv]`` tokens per head from one global top-k.

    ``keep_ratio * T * L * Hkv`` rows are kept over all heads together: the first ``n_sink`` and
    last ``window`` rows of every head (kept by the engine anyway) first, then the highest
    scores, wherever they are (the paper's and kvpress's default, ``layerwise=False``).
    """
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    table = scores.scores  # [L, Hkv, T]
    heads = [[table[layer, h] for h in range(table.shape[1])] for layer in range(table.shape[0])]
    return global_budgets(heads, int(round(keep_ratio * table.numel())), n_sink, window)


def uses_kvzip(policy: CompressionPolicy) -> bool:
    """True when ``policy`` scores with KVzip (it needs :func:`kvzip_scores` per prompt)."""
    return policy.build_scorer().name == KVzipScorer.name


def with_reconstruction_scores(model, tokenizer, cache: RaggedCache, context_ids, policies, **options):
    """``(policies, scores)``: every kvzip policy of ``policies`` given the scores of one
    reconstruction pass over ``cache`` (row 0, prefilled with ``context_ids``), the others as
    they are; ``scores`` is None (and no pass is run) when no policy uses kvzip.  For compressing
    copies of one prefilled cache under several policies (evaluation)."""
    if not any(uses_kvzip(policy) for policy in policies):
        return list(policies), None
    scores = kvzip_scores(model, tokenizer, cache, context_ids, **options)
    return [with_kvzip_scores(policy, scores) if uses_kvzip(policy) else policy for policy in policies], scores


@torch.no_grad()
def kvzip_compress(
    model, tokenizer, cache: RaggedCache, context_ids, policy: CompressionPolicy, calibration=None, **options
):
    """Score a prefilled single-prompt ``cache`` by reconstruction and compress it under ``policy``
    (its scorer must be ``"kvzip"``); returns ``(report, scores)``."""
    from runtime.compression.prefill import compress

    if cache.attention_layers[0].batch_size != 1:
        raise ValueError("kvzip_compress handles one prompt; call kvzip_scores per row and compress rows apart")
    scores = kvzip_scores(model, tokenizer, cache, context_ids, **options)
    return compress(model, cache, with_kvzip_scores(policy, scores), calibration), scores
