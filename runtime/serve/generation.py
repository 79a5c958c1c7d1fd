"""Compression entry points around ``model.generate``.

Two places to compress:

* **question-agnostic** (the serving case: the context is cached before any question):
  ``context_columns=n`` prefills and compresses ``input_ids[:, :n]``; generate() then feeds
  the question columns through the compressed cache.
* **question-aware**: ``context_columns=None`` prefills and compresses the whole prompt but
  its last column (generate() re-feeds the prompt when the cache already holds all of it, so
  the last token is what it feeds).

Token level::

    cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=n,
                                    calibration=calibration)
    out = model.generate(ids, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=32)

or ``generate(model, ids, policy, ...)`` which does both, taking generate()'s own arguments (beams
and ``num_return_sequences``: the cache is expanded to generate()'s rows, :func:`rows_per_prompt`;
``return_dict_in_generate``).  Text level: ``answer(model, tokenizer, context, question, policy)``
(one pair, one context with a list of questions compressed once, or lists of pairs batched with
padding).

Batches: rows are laid out ``[pad, context, pad, question]`` (:func:`build_inputs`), so every
row's context ends at the same column and every question ends at the last column; padding
is never stored in the cache, and each row is compressed on its own real length.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from artifacts.fingerprint import decoder_stack
from common.checks import check_integer
from prompt_format import encode_prompt
from runtime.compression.prefill import CompressionReport, compress, prefill, prefill_and_compress
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.cache import CacheConsumedError, RaggedCache
from runtime.kv_store.shared_scope import shared_switch
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.geometry import input_device, original_context, position_limit, text_config
from runtime.plan.policy import CompressionPolicy
from runtime.plan.rope_check import check_passes_rotate_alike
from runtime.plan.serving_plan import ServingPlan, as_plan
from runtime.serve import decode_graph
from runtime.serve.generate_options import check_generation_options, generation_config, served_cache_defaults


def build_inputs(contexts: list[list[int]], questions: list[list[int]], pad_token_id: int, device=None):
    """``input_ids [B, Lc + Lq]``, ``attention_mask``, ``Lc`` for rows ``[pad, ctx, pad, question]``,
    on ``device`` (the model's input device, :func:`runtime.math.geometry.input_device`; None: the CPU)."""
    if len(contexts) != len(questions) or not contexts:
        raise ValueError(f"need as many contexts as questions (at least one), got {len(contexts)} and {len(questions)}")
    if any(len(context) == 0 for context in contexts):
        raise ValueError("every context needs at least one token")
    if any(len(question) == 0 for question in questions):
        raise ValueError("every question needs at least one token (generation starts after it)")
    context_columns = max(len(c) for c in contexts)
    question_columns = max(len(q) for q in questions)
    ids, mask = [], []
    for context, question in zip(contexts, questions, strict=True):
        pad_c, pad_q = context_columns - len(context), question_columns - len(question)
        ids.append([pad_token_id] * pad_c + list(context) + [pad_token_id] * pad_q + list(question))
        mask.append([0] * pad_c + [1] * len(context) + [0] * pad_q + [1] * len(question))
    device = torch.device("cpu") if device is None else device
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
        context_columns,
    )


def left_padded(prompts: list[list[int]], pad_token_id: int, device=None):
    """``input_ids [B, T]`` and ``attention_mask`` of whole prompts, each padded on its left (the layout a
    question-aware batch takes: nothing between a row's context and its question), on ``device`` (None: the CPU)."""
    width = max(len(prompt) for prompt in prompts)
    device = torch.device("cpu") if device is None else device
    ids = [[pad_token_id] * (width - len(prompt)) + list(prompt) for prompt in prompts]
    mask = [[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


def context_limit(config) -> int | None:
    """The most token positions ``config``'s model was trained for (None: unknown).

    ``max_position_embeddings``, or for a RoPE-scaled model (YaRN, linear, llama3, longrope...)
    ``original_max_position_embeddings x factor`` when that is larger: scaling stretches the
    positions a model can use, and several configs keep the original length in
    ``max_position_embeddings``.  Dynamic NTK RoPE is served inside its original context only
    (:func:`~runtime.math.geometry.position_limit`).
    """
    config = text_config(config)  # a multimodal checkpoint's: its language model's
    own = position_limit(config)
    return min((limit for limit in (own and own[0], _model_context(config)) if limit is not None), default=None)


def _model_context(config) -> int | None:
    """:func:`context_limit` of the model itself (its positions, stretched by a RoPE scaling)."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default"):
        factor = rope.get("factor")
        original = rope.get("original_max_position_embeddings") or limit
        if isinstance(factor, (int, float)) and factor > 1:
            limit = max(limit, int(original * factor))
    return limit


def check_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Refuse a prompt the model cannot run or would answer wrongly; returns the attention mask
    (all ones when None).  Nothing is computed before these checks pass."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    batch, length = input_ids.shape
    if batch == 0 or length == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): at least one row of tokens is needed")
    vocab = getattr(text_config(model.config), "vocab_size", None)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} in input_ids is outside the model's vocabulary of {vocab} ids")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
        raise ValueError(
            f"attention_mask must have input_ids' shape {(batch, length)}, "
            f"got {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    real = attention_mask.sum(-1)
    all_padding, padded_last = torch.stack([real == 0, attention_mask[:, -1] == 0]).tolist()  # one read
    empty = [row for row, flag in enumerate(all_padding) if flag]
    if empty:
        raise ValueError(
            f"batch row {empty[0]} of attention_mask is all padding: it has no token to generate from"
            + (f" (rows {empty} are)" if len(empty) > 1 else "")
        )
    right = [row for row, flag in enumerate(padded_last) if flag]
    if right:
        raise ValueError(
            f"batch row {right[0]} ends with padding (its last column's attention_mask is 0): generation continues "
            "after every row's last column, so a right-padded row would be answered after its padding; pad on the "
            "left (tokenizer.padding_side = 'left')" + (f" (rows {right} end so)" if len(right) > 1 else "")
        )
    limit = context_limit(model.config)
    longest = int(real.max())
    if limit is not None and longest > limit:
        row = int(real.argmax())
        own = position_limit(text_config(model.config))
        why = (
            f"kvcal serves it inside {own[1]}"
            if own is not None and own[0] == limit
            else "past it the answer is not to be trusted"
        )
        positions = getattr(text_config(model.config), "max_position_embeddings", limit)
        raise ValueError(
            f"the prompt has {longest} tokens (batch row {row}), more than the model's context of {limit} positions "
            f"(max_position_embeddings {positions}): {why}; shorten the context"
        )
    return attention_mask


def check_generate_arguments(model, attention_mask: torch.Tensor, generate_kwargs: dict) -> None:
    """Refuse ``model.generate(**generate_kwargs)`` after a prompt with ``attention_mask``, before any forward
    pass, where kvcal could not serve it as asked: another modality's input to a multimodal checkpoint
    (:func:`other_modality_inputs`: the compressed prompt holds what the language model computed from the
    tokens, so an image given to generate() would be dropped, or fail inside transformers), padding between a
    row's tokens on a model with recurrent layers (:func:`refuse_padding_inside_rows`), or new tokens
    past the original context of a model with dynamic NTK RoPE (:func:`~runtime.math.geometry.original_context`;
    a row's positions count its real tokens, as transformers numbers them from the mask)."""
    refuse_padding_inside_rows(model, RaggedCache.for_model(model), attention_mask)
    check_generation_options(model, generate_kwargs)
    given = sorted(name for name in other_modality_inputs(model) if generate_kwargs.get(name) is not None)
    if given:
        raise ValueError(
            f"{', '.join(given)}: kvcal serves the language model of a multimodal checkpoint on text only (the "
            "compressed cache holds what it computed from the prompt's tokens); pass the tokens alone"
        )
    original = original_context(model.config)
    if original is None:
        return
    new_tokens = _new_tokens(model, generate_kwargs, attention_mask.shape[1])
    longest = int(attention_mask.sum(-1).max())
    if longest + new_tokens > original:
        raise ValueError(
            f"a prompt of {longest} tokens and up to {new_tokens} new tokens reach past the {original} positions "
            "of the model's original context (max_position_embeddings), where its dynamic NTK RoPE re-scales every "
            "forward pass by its length and keeps that scale for the next: kvcal serves it inside that context only; "
            f"ask for at most {max(original - longest, 0)} new tokens, or shorten the prompt"
        )


def holds_recurrent_states(model) -> bool:
    """Whether ``model`` has recurrent layers (a hybrid's Gated DeltaNet, Mamba or short convolutions, Falcon-H1's
    mixers), which run over every column of a batch, padding included (:func:`refuse_padding_inside_rows`)."""
    return RaggedCache.for_model(model).holds_recurrent_states


def refuse_padding_inside_rows(model, cache: RaggedCache, attention_mask: torch.Tensor) -> None:
    """Refuse a row with padding after its first token (``[pad, context, pad, question]``: a shorter question
    than another row's) where ``cache`` holds recurrent states (a hybrid model's Gated DeltaNet, Mamba or short
    convolution layers, Falcon-H1's mixers): those layers run over every column, and padding after a row's first
    token enters their state (transformers zeroes its inputs, but the convolution's window and the state's decay
    still move), so the row would be answered otherwise than alone.  Left padding alone is served: before a
    row's first token the state is still empty."""
    if not cache.holds_recurrent_states:
        return
    inside = attention_mask.cummax(-1).values > attention_mask  # a 0 after the row's first 1
    rows = inside.any(-1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"padding between the tokens of batch row {rows[0]} (a shorter question than another row's, after its "
            f"context) on {type(model).__name__}, whose recurrent layers run over every column: the padding would "
            "enter their state and the row be answered otherwise than alone; give every row's question the same "
            "length, or generate the rows one at a time"
        )


# a causal LM head's own forward arguments (not another modality's)
_HEAD_ARGUMENTS = frozenset(("labels", "logits_to_keep"))


def other_modality_inputs(model) -> frozenset[str]:
    """The forward arguments of a multimodal checkpoint loaded whole that its language model does not take
    (but for a causal LM head's own): its images, videos and their sizes (``pixel_values``,
    ``image_sizes``, Gemma 3's ``token_type_ids``...); empty for a text model."""
    stack = decoder_stack(model)
    if stack is None or stack is getattr(model, "model", None):
        return frozenset()
    given = inspect.signature(type(model).forward).parameters
    taken = inspect.signature(type(stack).forward).parameters
    return frozenset(given) - frozenset(taken) - _HEAD_ARGUMENTS


@torch.no_grad()
def compress_prompt(
    model,
    input_ids: torch.Tensor,
    policy: CompressionPolicy | ServingPlan | None,
    *,
    attention_mask: torch.Tensor | None = None,
    context_columns: int | None = None,
    calibration=None,
    block_size: int | None = None,
) -> tuple[RaggedCache, CompressionReport | None]:
    """A :class:`RaggedCache` holding the compressed prefix of ``input_ids [B, T]``.

    ``context_columns``: question-agnostic split (see the module docstring); None =
    question-aware.  ``policy``: a policy (bound here to ``calibration``, once:
    :func:`runtime.plan.serving_plan.bind`) or a :class:`ServingPlan`; None prefills without evicting
    (the full cache).
    ``block_size``: prefill in blocks of that many columns and evict after each (KeyDiff's
    block-wise prefill, KeyDiff arXiv 2504.15364 Eq. 6), so the cache never holds more than the budget plus
    one block; budgets are those of the whole prefix, and scorers see positions and RoPE at
    each block's true absolute position.
    """
    attention_mask = check_inputs(model, input_ids, attention_mask)
    total = input_ids.shape[1]
    if context_columns is None:
        columns = total - 1
    else:
        columns = check_integer("context_columns", context_columns)
    if not 1 <= columns <= total - 1:
        raise ValueError(
            f"the compressed prefix must leave at least one column for generate(): "
            f"context_columns={columns} with a prompt of {total} columns"
        )
    if block_size is not None:
        block_size = check_integer("block_size", block_size, minimum=1)
    plan = as_plan(policy, calibration, model)  # every check of policy x calibration x model, before any forward
    cache = RaggedCache.for_model(model)
    if block_size is None and plan is not None and plan.evicts_in_prefill:  # one layer's full cache at a time
        report = prefill_and_compress(model, cache, input_ids[:, :columns], attention_mask[:, :columns], plan)
        return cache, report
    if block_size is None or plan is None:
        stats = prefill(model, cache, input_ids[:, :columns], attention_mask[:, :columns], policy=plan)
        report = compress(model, cache, plan, prompt_stats=stats) if plan is not None else None
        return cache, report
    prefix, prefix_mask = input_ids[:, :columns], attention_mask[:, :columns]
    ids, mask, bounds = row_blocks(prefix, prefix_mask, block_size)
    if ids is not prefix and cache.holds_recurrent_states:
        raise ValueError(
            f"a block-wise prefill of a padded batch (block_size={block_size}) on {type(model).__name__}, whose "
            "recurrent layers run over every column, padding included: each row's blocks would have padding "
            "between them; prefill in one pass (block_size None), or compress rows of one length together"
        )
    if any(switch is not None for switch in plan.geometry.rope_switches):  # longrope: a pass's RoPE by its length
        longest = mask.cumsum(-1).amax(0).tolist()  # the longest row's length per column
        ends = [longest[end - 1] for end in bounds]
        what = f"a block-wise prefill (block_size={block_size})"
        remedy = f"prefill in one pass (block_size None or >= {columns})"
        check_passes_rotate_alike(type(model).__name__, plan.geometry, plan.scorer, ends, what, remedy)
    lengths = mask.sum(-1).tolist()  # each row's real context length
    stats, start = None, 0
    for end in bounds:
        stats = prefill(model, cache, ids[:, start:end], mask[:, :end], policy=plan, prompt_stats=stats)
        report = compress(model, cache, plan, prompt_stats=stats, context_lengths=lengths, final=end == bounds[-1])
        start = end
    cache.set_columns(columns)  # what generate() reads of the prompt: its own columns, not the blocks' layout
    return cache, report


def row_blocks(input_ids: torch.Tensor, attention_mask: torch.Tensor, block_size: int):
    """The block-wise prefill's layout: ``(ids, mask, ends)``, the passes being ``ids[:, start:end]`` between
    consecutive ``ends``, in which each row's blocks are its own real tokens ``[0, B), [B, 2B), ...`` (``B`` =
    ``block_size``), as when the row is prefilled alone, however it is padded.  A row's last block may be
    shorter, padded on its left; rows with fewer blocks start later (padding before them), so that every row
    ends at the last column.  ``input_ids`` and ``attention_mask`` themselves, cut every ``B`` columns, when no
    row is padded (every row's blocks are then the batch's columns, as a row alone)."""
    rows, columns = input_ids.shape
    counts = [int(n) for n in attention_mask.sum(-1).tolist()]
    if min(counts) == columns or not any(counts):  # the batch's columns are each row's (or no row has a token)
        return input_ids, attention_mask, [min(start + block_size, columns) for start in range(0, columns, block_size)]
    # laid out on the host (one copy each way, not a device read per row), the prompt's ids being small
    host_ids, host_mask = input_ids.cpu(), attention_mask.cpu()
    real = [host_ids[b][host_mask[b].bool()] for b in range(rows)]  # each row's tokens, padding dropped
    passes = max(-(-n // block_size) for n in counts)
    last = max(n - block_size * (-(-n // block_size) - 1) for n in counts if n)  # the widest last block
    width = (passes - 1) * block_size + last
    ids = torch.zeros(rows, width, dtype=input_ids.dtype, device="cpu")
    mask = torch.zeros(rows, width, dtype=attention_mask.dtype, device="cpu")
    for b, tokens in enumerate(real):
        blocks = -(-counts[b] // block_size)
        for k in range(blocks):
            block = tokens[k * block_size : (k + 1) * block_size]
            pass_index = passes - blocks + k
            end = pass_index * block_size + (block_size if pass_index < passes - 1 else last)
            ids[b, end - len(block) : end], mask[b, end - len(block) : end] = block, 1
    ends = [min((k + 1) * block_size, width) if k < passes - 1 else width for k in range(passes)]
    return ids.to(input_ids.device), mask.to(attention_mask.device), ends


@dataclass
class GenerationResult:
    """What :func:`generate` returns.

    ``sequences`` / ``new_tokens`` are ``model.generate``'s rows: ``B x num_return_sequences`` of
    them, each prompt row's together (transformers' order).  ``output`` is transformers' own
    ``GenerateOutput`` when ``return_dict_in_generate=True`` (None otherwise): ``scores`` and
    ``logits`` read it (tuples of ``[rows, vocab]``, one per step, when asked for with
    ``output_scores`` / ``output_logits``), as do ``sequences_scores`` and ``beam_indices``.
    ``report`` is the compression of the ``B`` prompt rows; ``cache`` holds generate()'s working
    rows after the last step (``B x max(num_beams, num_return_sequences)``: under beam search the
    running beams, not aligned with ``sequences``).  ``graphs`` counts, with ``decode_graphs``,
    the forward passes run ``eager``, ``captured`` and ``replayed`` (:mod:`runtime.serve.decode_graph`).
    """

    sequences: torch.Tensor  # [B * num_return_sequences, T + new] as returned by model.generate
    new_tokens: torch.Tensor  # [B * num_return_sequences, new]
    cache: RaggedCache
    report: CompressionReport | None
    output: ModelOutput | None = None  # transformers' GenerateOutput (return_dict_in_generate=True)
    graphs: decode_graph.DecodeGraphs | None = None  # with decode_graphs: how its forward passes ran

    @property
    def scores(self) -> tuple[torch.Tensor, ...] | None:
        """The generate output's processed ``scores`` (``output_scores=True``), else None."""
        return None if self.output is None else self.output.get("scores")

    @property
    def logits(self) -> tuple[torch.Tensor, ...] | None:
        """The generate output's raw ``logits`` (``output_logits=True``), else None."""
        return None if self.output is None else self.output.get("logits")


def rows_per_prompt(model, generate_kwargs: dict) -> int:
    """How many rows ``model.generate(**generate_kwargs)`` makes of each prompt row:
    ``max(num_beams, num_return_sequences)`` of the generation config it resolves (its arguments,
    or ``generation_config``, over ``model.generation_config`` over the library defaults).

    generate() expands its inputs to that many rows before the first forward pass but never the
    cache it is given (transformers 5.2 to 5.24), so a cache prefilled at the prompt's batch must
    be expanded first.  The resolution is transformers' own (``_prepare_generation_config``, the
    same in every supported version), so a default set in the model's ``generation_config``
    counts as it does in generate().
    """
    config = generation_config(model, generate_kwargs)
    # generate() divides by num_beams (0: ZeroDivisionError) and returns nothing for 0 sequences
    beams = 1 if config.num_beams is None else check_integer("num_beams", config.num_beams, minimum=1)
    sequences = config.num_return_sequences
    sequences = 1 if sequences is None else check_integer("num_return_sequences", sequences, minimum=1)
    return max(beams, sequences)


def generate_from_cache(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: RaggedCache,
    report: CompressionReport | None,
    *,
    decode_graphs=False,
    **generate_kwargs,
) -> GenerationResult:
    """``model.generate`` of ``input_ids [B, T]`` through ``cache``, which holds the compressed
    prefix of these ``B`` rows: expanded here to generate()'s rows (beams, several sequences per
    prompt: :func:`rows_per_prompt`), reordered by generate() itself with the beams.

    A cache serves the prompt it was compressed for once: one that already holds as many columns
    as ``input_ids`` or more (an earlier generation consumed it) is refused with
    :class:`~runtime.kv_store.cache.CacheConsumedError` (generate() would feed the whole prompt again
    behind it).  A generation's own ``sequences`` continue through its cache.

    ``decode_graphs=True`` (a model on CUDA): the one-token decode steps are replayed from CUDA
    graphs wherever the cache allows it (:mod:`runtime.serve.decode_graph`); a
    :class:`~runtime.serve.decode_graph.StepGraph` class instead of True captures with it."""
    refuse_padding_inside_rows(model, cache, attention_mask)
    held = cache.get_seq_length()
    if held >= input_ids.shape[1]:
        raise CacheConsumedError(
            f"the cache already holds {held} columns and the prompt has {input_ids.shape[1]}: an earlier "
            "generation consumed it (generate() would feed the prompt again behind it and answer from a doubled "
            "context); compress the prompt again, or keep cache.copy() of the compressed cache for each generation"
        )
    if generate_kwargs.get("generation_config") is None:  # greedy unless asked: not the model's sampling default
        generate_kwargs.setdefault("do_sample", False)
    check_generate_arguments(model, attention_mask, generate_kwargs)
    expand = rows_per_prompt(model, generate_kwargs)
    if expand > 1:
        cache.batch_repeat_interleave(expand)  # rows [b0, b0, ..., b1, b1, ...] as generate() expands its inputs
    _forget_positions(model)
    graphs = _step_graph(model, decode_graphs)
    if graphs:  # the room the generation will take, made once: a repack changes the buffers a graph reads
        cache.reserve(input_ids.shape[1] - held + _new_tokens(model, generate_kwargs, input_ids.shape[1]))
    replayed = decode_graph.decode_graphs(model, cache, graphs) if graphs else contextlib.nullcontext()
    # for this call only: the model keeps its own implementation
    with ragged_attention(model), _positions_from_the_mask(model), served_cache_defaults(model), replayed as counts:
        output = model.generate(
            input_ids, attention_mask=attention_mask, **cache_argument(model, cache), **generate_kwargs
        )
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    return GenerationResult(
        sequences=sequences,
        new_tokens=sequences[:, input_ids.shape[1] :],
        cache=cache,
        report=report,
        output=None if isinstance(output, torch.Tensor) else output,
        graphs=counts,
    )


def _forget_positions(model) -> None:
    """Drop what a multimodal model kept of an earlier call's positions: Qwen2-VL / Qwen2.5-VL / Qwen3-VL keep
    ``rope_deltas`` (the shift of each row's positions after its images), computed when a generation starts
    from an empty cache and reused while the cache is not; a generation from kvcal's compressed cache starts
    from a filled one, so it read the last call's (another batch's size: refused by the cache; the same size:
    that call's shifts).  None makes generate() compute them from this prompt."""
    for module in (model, getattr(model, "model", None)):
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None


# multimodal wrappers whose generate() drops the position ids it computes from the attention mask (their
# prepare_inputs_for_generation sets them None), so that their forward numbers a step's tokens by the cache's
# columns, padding included: EXAONE 4.5
POSITIONS_DROPPED_BY_GENERATE = frozenset(("exaone4_5",))


def _positions_from_the_mask(model):
    """For this block, a model of :data:`POSITIONS_DROPPED_BY_GENERATE` is handed by generate() the positions
    generate() computes from the mask for every other model (a left-padded row's from its first real token),
    those kvcal's prefill numbered its cache by: by the cache's columns, a padded row's first step would be its
    padding's length past its stored keys.  The model's own method is restored after the block (after the
    last call holding it: :func:`~runtime.kv_store.shared_scope.shared_switch`)."""
    if getattr(model.config, "model_type", None) not in POSITIONS_DROPPED_BY_GENERATE:
        return contextlib.nullcontext()
    return shared_switch(model, "positions from the mask", functools.partial(_positions_switch, model))


@contextlib.contextmanager
def _positions_switch(model):
    own = vars(model).get("prepare_inputs_for_generation")  # an instance attribute, else None (the class's)
    prepare = model.prepare_inputs_for_generation

    def with_positions(input_ids, *args, **kwargs):
        inputs = prepare(input_ids, *args, **kwargs)
        mask, ids = kwargs.get("attention_mask"), inputs.get("input_ids")
        if inputs.get("position_ids") is None and isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor):
            positions = mask.long().cumsum(-1) - 1
            inputs["position_ids"] = positions.masked_fill(mask == 0, 1)[:, -ids.shape[1] :]
        return inputs

    with_positions.__signature__ = inspect.signature(prepare)  # generate() checks its arguments against it
    model.prepare_inputs_for_generation = with_positions
    try:
        yield
    finally:
        if own is None:
            del model.prepare_inputs_for_generation
        else:
            model.prepare_inputs_for_generation = own


def _new_tokens(model, generate_kwargs: dict, prompt_columns: int) -> int:
    """How many tokens ``model.generate(**generate_kwargs)`` generates at most after a prompt of
    ``prompt_columns`` columns (:func:`~runtime.serve.generate_options.generation_config`)."""
    config = generation_config(model, generate_kwargs)
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    return max(0, int(config.max_length or 0) - prompt_columns)


def _step_graph(model, decode_graphs):
    """The :class:`~runtime.serve.decode_graph.StepGraph` class ``decode_graphs`` asks for, or None."""
    if decode_graphs is False or decode_graphs is None:
        return None
    if decode_graphs is True:
        device = input_device(model)
        if device.type != "cuda":
            raise ValueError(f"decode_graphs=True captures CUDA graphs: the model is on {device}, not a CUDA device")
        return decode_graph.CudaStepGraph
    if isinstance(decode_graphs, type) and all(hasattr(decode_graphs, name) for name in ("capture", "replay")):
        return decode_graphs
    raise TypeError(f"decode_graphs must be True, False or a StepGraph class, got {decode_graphs!r}")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    policy: CompressionPolicy | ServingPlan | None,
    *,
    attention_mask: torch.Tensor | None = None,
    context_columns: int | None = None,
    calibration=None,
    block_size: int | None = None,
    decode_graphs=False,
    **generate_kwargs,
) -> GenerationResult:
    """:func:`compress_prompt` then ``model.generate`` (greedy unless ``do_sample=True``, or a
    ``generation_config`` that samples); ``decode_graphs``: as :func:`generate_from_cache`.

    ``generate_kwargs`` are generate()'s own: beam search (``num_beams``), several sequences per
    prompt (``num_return_sequences``, sampled or beams) and ``return_dict_in_generate`` (with
    ``output_scores`` / ``output_logits``: :class:`GenerationResult` ``output``) work as with an
    uncompressed model; the prompt is compressed once per row, before generate() expands it.
    """
    attention_mask = check_inputs(model, input_ids, attention_mask)
    check_generate_arguments(model, attention_mask, generate_kwargs)  # before any forward pass
    cache, report = compress_prompt(
        model,
        input_ids,
        policy,
        attention_mask=attention_mask,
        context_columns=context_columns,
        calibration=calibration,
        block_size=block_size,
    )
    return generate_from_cache(
        model, input_ids, attention_mask, cache, report, decode_graphs=decode_graphs, **generate_kwargs
    )


def split_prompt(tokenizer, context: str, question: str, chat: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the prompt's question-free context part, and of the rest (question + template).

    The prompt is the one format the probes that calibrated the heads have
    (:func:`prompt_format.encode_prompt`): with ``chat`` and a chat template, one user message
    ``context + "\\n\\n" + question`` with the generation prompt; else the plain
    ``[bos]context\\n\\nquestion\\nAnswer:``.
    """
    ids, context_end = encode_prompt(tokenizer, context, question, chat=chat)
    return ids[:context_end], ids[context_end:]


def _strings(name: str, value) -> tuple[list[str], bool]:
    """``value`` (a str, or a list or tuple of them) as a list, and whether it was one str."""
    if isinstance(value, str):
        return [value], True
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise TypeError(f"{name} {index} is {type(item).__name__}, not str")
    if not value:
        raise ValueError(f"need at least one {name}, got an empty list")
    return list(value), False


def answer(
    model,
    tokenizer,
    context: str | list[str],
    question: str | list[str],
    policy: CompressionPolicy | ServingPlan | None,
    *,
    calibration=None,
    question_aware: bool = False,
    chat: bool = True,
    max_new_tokens: int = 32,
    **generate_kwargs,
) -> str | list:
    """Answer questions about contexts with a compressed cache; ``policy`` as :func:`compress_prompt`
    takes it, ``generate_kwargs`` as ``model.generate`` does (greedy unless ``do_sample=True``).

    * ``answer(model, tok, context, question, policy)``: one answer (a str);
    * ``answer(model, tok, context, [q1, q2, ...], policy)``: one context, many questions (kvpress's
      ``questions=[...]``): a list of answers.  Question-agnostic compression serves one
      compressed context to every question: the context is prefilled and compressed **once**,
      each question answered from its own copy of the cache, all in one batch (the answers are
      those of asking each question on its own).  With ``question_aware=True`` each prompt is
      compressed with its own question (the context is prefilled once per question);
    * ``answer(model, tok, [c1, c2, ...], [q1, q2, ...], policy)``: one question per context, a
      list of answers (one batch, left-padded).

    With ``num_return_sequences=n > 1`` each answer is a list of its ``n`` texts (beams: the
    best first).  Arguments are checked before any forward pass.  On a model with recurrent layers (a
    hybrid), whose batch can hold no padding between a row's context and its question, the questions of
    each length are answered together (the one context compressed once), not all in one batch.
    """
    check_integer("max_new_tokens", max_new_tokens, minimum=1)
    contexts, one_context = _strings("context", context)
    questions, one_question = _strings("question", question)
    if not one_context and one_question:
        raise ValueError(
            f"got {len(contexts)} contexts and one question: give one question per context (a list of "
            f"{len(contexts)}); to ask several questions about one context, pass the context as a str"
        )
    if not one_context and len(contexts) != len(questions):
        raise ValueError(f"got {len(contexts)} contexts and {len(questions)} questions: give one question per context")
    if one_context:
        contexts = contexts * len(questions)
    pairs = [split_prompt(tokenizer, c, q, chat=chat) for c, q in zip(contexts, questions, strict=True)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generate_kwargs.setdefault("pad_token_id", pad)
    generate_kwargs["max_new_tokens"] = max_new_tokens
    device = input_device(model)
    if question_aware:  # each prompt whole, left-padded: no padding between its context and its question
        ids, mask = left_padded([context + rest for context, rest in pairs], pad, device)
        result = generate(model, ids, policy, attention_mask=mask, calibration=calibration, **generate_kwargs)
        return _texts(tokenizer, result, len(pairs), one_context and one_question)
    # a model with recurrent layers cannot have padding between a row's context and its question: the rows with
    # questions of one length are answered together (every row at once elsewhere)
    groups = _question_groups(model, pairs)
    several = one_context and len(questions) > 1  # one context compressed once, copied to every question's row
    if several:
        _check_one_context(pairs)  # every group is served the context compressed for the first
    texts, shared = [None] * len(pairs), None
    for number, group in enumerate(groups):
        ids, mask, columns = build_inputs([pairs[i][0] for i in group], [pairs[i][1] for i in group], pad, device)
        if several:
            keep = number < len(groups) - 1  # another group reads the compressed context after this one
            result, shared = _answer_from_one_context(
                model, ids, mask, [pairs[i] for i in group], policy, calibration, generate_kwargs, shared, keep
            )
        else:
            result = generate(
                model,
                ids,
                policy,
                attention_mask=mask,
                context_columns=columns,
                calibration=calibration,
                **generate_kwargs,
            )
        for index, text in zip(group, _texts(tokenizer, result, len(group), False), strict=True):
            texts[index] = text
    return texts[0] if one_context and one_question else texts


def _texts(tokenizer, result: GenerationResult, prompts: int, one: bool):
    """The answers of ``prompts`` prompts from ``result``: a str each, or a list of them with
    ``num_return_sequences``; the first alone when ``one``."""
    texts = [tokenizer.decode(row, skip_special_tokens=True).strip() for row in result.new_tokens]
    per_question = len(texts) // prompts  # num_return_sequences
    if per_question > 1:
        texts = [texts[i : i + per_question] for i in range(0, len(texts), per_question)]
    return texts[0] if one else texts


def _question_groups(model, pairs) -> list[list[int]]:
    """The prompts answered together: all of them, but on a model with recurrent layers, whose batch can hold no
    padding between a row's context and its question (:func:`refuse_padding_inside_rows`), those whose questions
    have one length (in the order of their first prompt)."""
    if not holds_recurrent_states(model):
        return [list(range(len(pairs)))]
    groups: dict[int, list[int]] = {}
    for index, (_, question) in enumerate(pairs):
        groups.setdefault(len(question), []).append(index)
    return list(groups.values())


def _check_one_context(pairs) -> None:
    """Refuse questions whose prompts split one context at different tokens (the tokenizer merged the context's end
    with a question's start): one compressed context cannot serve them all."""
    for index, (other, _) in enumerate(pairs):
        if other != pairs[0][0]:
            raise ValueError(
                f"question {index} splits the prompt at another token than question 0, so its context "
                "tokens differ and one compressed context cannot serve both; pass question_aware=True"
            )


@torch.no_grad()
def _answer_from_one_context(
    model, ids, mask, pairs, policy, calibration, generate_kwargs, compressed=None, keep: bool = False
):
    """Prompts ``ids [Q, Lc + Lq]`` (rows ``[context, pad, question]``) of one context: the context
    (the same ``Lc`` tokens in every row) compressed once, in row 0 (or ``compressed``, ``(cache, report)`` of an
    earlier call, when given), then copied to every row; ``keep``: the compressed context left as it is (decoded
    from a copy) for another call.  Returns the :class:`GenerationResult` and ``(cache, report)`` of the
    compressed context."""
    context_ids = pairs[0][0]
    _check_one_context(pairs)
    mask = check_inputs(model, ids, mask)  # every prompt, before the context's forward pass
    check_generate_arguments(model, mask, generate_kwargs)
    if compressed is None:
        compressed = compress_prompt(
            model, ids[:1], policy, attention_mask=mask[:1], context_columns=len(context_ids), calibration=calibration
        )
    cache, report = compressed
    if keep:
        cache = cache.copy()
    cache.batch_repeat_interleave(ids.shape[0])  # one copy of the compressed context per question
    return generate_from_cache(model, ids, mask, cache, report, **generate_kwargs), compressed
