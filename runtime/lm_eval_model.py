"""kvcal as a model of EleutherAI's lm-evaluation-harness (the ``lm-eval`` extra): ``--model kvcal``.

    kvcal-lm-eval --model kvcal --model_args compression_ratio=0.75 --tasks niah_single_1 \\
        --metadata '{"max_seq_lengths":[2048]}' --limit 4

(``kvcal-lm-eval`` is lm-eval's command line with ``kvcal`` registered: :mod:`runtime.lm_eval_cli`
says why plain ``lm_eval`` cannot find it yet) or from Python, where importing this module
registers ``kvcal`` with lm-eval (unless it already is)::

    import lm_eval
    import runtime.lm_eval_model  # noqa: F401  (registers the model "kvcal")

    lm_eval.simple_evaluate(model="kvcal", model_args={"compression_ratio": 0.75}, tasks=["niah_single_1"],
                            limit=4, metadata={"tokenizer": tokenizer, "max_seq_lengths": [2048]})

RULER's tasks then need a tokenizer named (``metadata={"tokenizer": ...}``, or ``pretrained=`` in
the model_args): only the command line names the embedded model's by itself.  An instance works
too: ``lm = KvcalLM(compression_ratio=0.75)``, ``simple_evaluate(model=lm, ...,
metadata={"tokenizer": lm.tokenizer_source, ...})``.

This module and :mod:`runtime.lm_eval_cli` are the only ones that import lm_eval; nothing in
kvcal's core imports them (tests/test_runtime_imports.py).

Model arguments (``--model_args key=value,...``; anything else is refused):

* ``pretrained``: a model directory or hub id (default: the embedded SmolLM2-135M-Instruct);
  ``tokenizer``: the tokenizer's, when it is not the model's;
* ``artifact``: a calibration artifact (``load_calibration(model, tokenizer, path=...)``); the
  policy served is then ``calibration.policy(compression_ratio)`` unless ``policy`` names one;
* from Python, as lm-eval's ``hf`` model takes them, ``pretrained`` may be a loaded model,
  ``tokenizer`` a loaded tokenizer and ``artifact`` a loaded ``Calibration`` of that model
  (``evaluate-artifact --lm-eval-tasks`` passes its own; ``dtype`` and ``device`` are then refused);
* ``compression_ratio``: the fraction of the context's KV cache evicted, in [0, 1) (required);
* ``policy``: a policy name (``parse_policy``: ``flagship``, ``uniform/keydiff``, ``baseline``...);
  without an artifact the default is the artifact-free ``uniform/leverage``;
* ``question``: ``auto`` (default), ``agnostic`` or ``aware``: whether compression sees the
  question (below); ``window``: the policy's protected trailing window, in tokens;
* ``batch_size``, ``max_length``, ``device``, ``dtype``.

**Whether compression sees the question.**  *Question-agnostic* (``question=agnostic``): the
prompt is split at the start of its question, the context alone is prefilled and compressed and
the question is fed through the compressed cache (as kvpress evaluates RULER).  lm-eval hands a
model one prompt string, so the split is found by the question lines of RULER's templates
(:data:`QUESTION_MARKERS`, the last match); a prompt without one is refused.  *Question-aware*
(``question=aware``): the whole prompt but its last token is prefilled and compressed, the
policy's protected window (the last ``window`` tokens, 32 by default) always kept.  ``auto``
splits where a marker is found and is question-aware elsewhere.  The results' ``config``
records the mode and how many prompts each way went (``kvcal.question_agnostic_prompts``...).

**Log-likelihood requests** are compressed too: the context but its last token is prefilled and
compressed with the policy, then the last context token and the continuation are fed through
the compressed cache and scored (so the scores are those of a model that kept only the policy's
share of the context).  A context of fewer than two tokens has nothing to compress and is
refused, as is ``loglikelihood_rolling`` (perplexity has no context to compress).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills itself only while empty)
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry, register_model
from tqdm import tqdm
from transformers import PreTrainedModel

from common.models import EMBEDDED, LOG, load_model, load_tokenizer, resolve_model
from prompt_format import encode, encode_with_offsets
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.transformers_compat import cache_argument
from runtime.lm_eval_cli import MODEL as MODEL_NAME
from runtime.math.geometry import input_device
from runtime.plan.calibration import Calibration, load_calibration
from runtime.plan.policy_spec import ARTIFACT_FREE, parse_policy
from runtime.serve.generation import (
    build_inputs,
    check_inputs,
    compress_prompt,
    context_limit,
    generate,
    holds_recurrent_states,
    left_padded,
)

QUESTION_MODES = ("auto", "agnostic", "aware")
# Where the question starts in the prompts of lm-eval's RULER tasks (their templates,
# lm_eval/tasks/ruler/*_utils.py): the last match splits the context from the question.
QUESTION_MARKERS = (
    re.compile(r"\nWhat (?:are all|is) the special magic "),  # niah_*
    re.compile(r"\nQuestion: "),  # cwe, fwe, vt
    re.compile(r"\n\nAnswer the question based on the given documents\."),  # qa_squad, qa_hotpot
)
_NOT_COMPRESSED = "kvcal evaluates compressed KV caches only; for the uncompressed model use lm-eval's --model hf"
_GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def question_split(text: str) -> int | None:
    """The character where the prompt's question starts (the last RULER question marker), or None."""
    starts = [match.start() for marker in QUESTION_MARKERS for match in marker.finditer(text)]
    return max(starts) if starts else None


def _ratio(value) -> float:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"compression_ratio must be a number in [0, 1), got {value!r}") from None
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1) (the fraction of the context evicted), got {ratio:g}")
    return ratio


def _integer(name: str, value, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number != float(value) or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _device_map(device: str | None) -> str | None:
    """``device`` for ``load_model`` (None: the CPU).  lm-eval's command line passes ``cuda:0`` when
    no ``--device`` is given; where CUDA is absent that means the CPU, as for lm-eval's hf model."""
    if device in (None, "", "cpu"):
        return None
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        LOG.info(f"device {device} asked for, but CUDA is not available: running on the CPU")
        return None
    return str(device)


class KvcalLM(LM):
    """lm-eval's ``LM`` served by kvcal's runtime with a compressed KV cache (module docstring)."""

    def __init__(
        self,
        pretrained: str | None = None,
        compression_ratio=None,
        artifact: str | None = None,
        policy: str | None = None,
        question: str = "auto",
        window=None,
        tokenizer: str | None = None,
        batch_size=1,
        max_length=None,
        device: str | None = None,
        dtype: str | None = None,
        max_batch_size=None,
        **unknown,
    ) -> None:
        super().__init__()
        if unknown:
            raise ValueError(
                f"unknown kvcal model_args {sorted(unknown)}; kvcal takes pretrained, artifact, compression_ratio, "
                "policy, question, window, tokenizer, batch_size, max_length, device, dtype"
            )
        if compression_ratio is None:
            raise ValueError(
                "kvcal needs compression_ratio (--model_args compression_ratio=0.75): the fraction evicted"
            )
        self.compression_ratio = _ratio(compression_ratio)
        if question not in QUESTION_MODES:
            raise ValueError(f"question must be one of {', '.join(QUESTION_MODES)}, got {question!r}")
        self.question = question
        if str(batch_size).startswith("auto"):
            raise ValueError("kvcal takes a fixed batch_size (an integer), not auto")
        self.batch_size = _integer("batch_size", batch_size)
        if isinstance(artifact, (str, Path)) and not Path(artifact).expanduser().is_file():
            raise FileNotFoundError(f"no artifact file {artifact} (artifact= names a calibration file, e.g. .h5)")
        spec = parse_policy(policy) if policy is not None else None  # a bad name fails before the model loads
        if spec is not None and spec.needs_reconstruction:
            raise ValueError(
                f"policy {policy!r} needs a reconstruction pass per prompt, which kvcal's lm-eval model lacks"
            )
        if isinstance(pretrained, PreTrainedModel):  # a loaded model (Python; evaluate-artifact --lm-eval-tasks)
            if dtype is not None or device is not None:
                raise ValueError("dtype and device apply to a model kvcal loads; a loaded model is used as it is")
            self.model, self.pretrained = pretrained, pretrained.name_or_path
        else:
            self.pretrained = EMBEDDED if pretrained in (None, "") else str(pretrained)
            self.model = load_model(self.pretrained, dtype=dtype, device_map=_device_map(device))
        if tokenizer is not None and not isinstance(tokenizer, str):  # a loaded tokenizer
            self.tokenizer, self.tokenizer_source = tokenizer, tokenizer.name_or_path
        else:
            self.tokenizer_source = resolve_model(tokenizer if tokenizer else self.pretrained)
            self.tokenizer = load_tokenizer(tokenizer if tokenizer else self.pretrained)
        self._device = input_device(self.model)
        # a hybrid model's batch holds no padding between a row's context and its question: batched by its length
        self._questions_by_length = holds_recurrent_states(self.model)
        limit = context_limit(self.model.config)
        self.max_length = _integer("max_length", max_length) if max_length is not None else limit
        self.calibration = None
        if artifact is not None:
            self.calibration = (
                artifact
                if isinstance(artifact, Calibration)
                else load_calibration(self.model, self.tokenizer, path=artifact)
            )
            served = self.calibration.policy(self.compression_ratio) if spec is None else None
        else:
            served = None
            if spec is None:
                spec = ARTIFACT_FREE
        if served is None:
            served = spec.policy(self.compression_ratio)
        if served is None:
            raise ValueError(f"policy {policy!r} compresses nothing; {_NOT_COMPRESSED}")
        if window is not None:
            served = dataclasses.replace(served, window=_integer("window", window, minimum=0))
        self.policy = served
        self.policy_name = policy if policy is not None else ("artifact" if artifact else ARTIFACT_FREE.name)
        self.artifact = None if self.calibration is None else str(Path(self.calibration.path).resolve())
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.counts = {"question_agnostic_prompts": 0, "question_aware_prompts": 0, "loglikelihood_requests": 0}

    # -- what lm-eval records ------------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer_source.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template is not False else None

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def get_model_info(self) -> dict:
        """Recorded in the results' ``config``: the model, the policy and whether compression saw the question."""
        return {
            "kvcal": {
                "pretrained": self.pretrained,
                "artifact": self.artifact,
                "compression_ratio": self.compression_ratio,
                "policy": self.policy_name,
                "policy_fields": {
                    key: getattr(self.policy, key)
                    for key in ("allocation", "scorer", "correction", "window", "n_sink")
                    if hasattr(self.policy, key)
                },
                "question": self.question,
                **self.counts,
            }
        }

    # -- prompts -------------------------------------------------------------------------------------

    def _encode(self, text: str) -> tuple[list[int], int | None]:
        """Token ids of ``text`` and, when question-agnostic, the first token of its question (else None)."""
        ids = list(self.tokenizer(text)["input_ids"])  # the tokenizer's own special tokens, as lm-eval's hf model
        if self.question == "aware":
            return ids, None
        cut = question_split(text)
        if cut is not None and cut > 0:
            prefix = list(self.tokenizer(text[:cut])["input_ids"])
            _, offsets = encode_with_offsets(self.tokenizer, text)
            clean = ids[: len(prefix)] == prefix and 0 < len(prefix) < len(ids)
            if clean and offsets is not None and len(encode(self.tokenizer, text)) == len(ids):
                start, _ = offsets[len(prefix)]
                clean = start >= cut or not text[start:cut].strip()
            if clean:
                return ids, len(prefix)
        if self.question == "agnostic":
            raise ValueError(
                "question=agnostic: this prompt has no RULER question line to split its context from its question "
                f"(looked for {[marker.pattern for marker in QUESTION_MARKERS]}); use question=aware or question=auto"
            )
        return ids, None

    def _check_length(self, length: int, extra: int) -> None:
        if self.max_length is not None and length + extra > self.max_length:
            raise ValueError(
                f"a request of {length} prompt tokens and {extra} to generate exceeds max_length {self.max_length}; "
                "kvcal truncates nothing: shorten the task's prompts (e.g. RULER's max_seq_lengths)"
            )

    # -- generate_until ------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        items = []
        for index, request in enumerate(requests):
            text, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            unknown = set(gen_kwargs) - set(_GENERATION_KEYS)
            if unknown:
                raise ValueError(f"kvcal does not take the generation arguments {sorted(unknown)}")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = _integer("max_gen_toks", gen_kwargs.get("max_gen_toks", 256))
            ids, split = self._encode(text)
            self._check_length(len(ids), max_gen)
            sample = {}
            if gen_kwargs.get("do_sample"):
                sample = {
                    "do_sample": True,
                    **{k: gen_kwargs[k] for k in ("temperature", "top_p", "top_k") if k in gen_kwargs},
                }
            question = len(ids) - split if split is not None and self._questions_by_length else None
            key = (split is not None, tuple(until), max_gen, tuple(sorted(sample.items())), question)
            items.append((index, text, gen_kwargs, ids, split, until, max_gen, sample, key))
        # longest first within each group of like requests (lm-eval's convention: an early OOM)
        items.sort(key=lambda item: (item[8], -len(item[3])))
        results: list[str | None] = [None] * len(items)
        bar = tqdm(total=len(items), disable=disable_tqdm or self.rank != 0, desc="Running generate_until requests")
        start = 0
        while start < len(items):
            batch = [items[start]]
            while (
                start + len(batch) < len(items)
                and len(batch) < self.batch_size
                and items[start + len(batch)][8] == batch[0][8]
            ):
                batch.append(items[start + len(batch)])
            start += len(batch)
            for item, answer in zip(batch, self._generate_batch(batch), strict=True):
                index, text, gen_kwargs = item[:3]
                results[index] = answer
                self.cache_hook.add_partial("generate_until", (text, gen_kwargs), answer)
                bar.update(1)
        bar.close()
        return results

    def _generate_batch(self, batch) -> list[str]:
        agnostic, until, max_gen, sample, _ = batch[0][8]
        if agnostic:  # rows [pad, context, pad, question]
            contexts = [item[3][: item[4]] for item in batch]
            questions = [item[3][item[4] :] for item in batch]
            input_ids, attention_mask, context_columns = build_inputs(
                contexts, questions, self.pad_token_id, device=self._device
            )
            self.counts["question_agnostic_prompts"] += len(batch)
        else:
            input_ids, attention_mask = left_padded([item[3] for item in batch], self.pad_token_id, self._device)
            context_columns = None
            self.counts["question_aware_prompts"] += len(batch)
        kwargs = {"max_new_tokens": max_gen, "pad_token_id": self.pad_token_id, **dict(sample)}
        if until:
            kwargs.update(stop_strings=list(until), tokenizer=self.tokenizer)
        result = generate(
            self.model,
            input_ids,
            self.policy,
            attention_mask=attention_mask,
            context_columns=context_columns,
            calibration=self.calibration,
            **kwargs,
        )
        answers = []
        for row in result.new_tokens:
            answer = self.tokenizer.decode(row, skip_special_tokens=True)
            for stop in until:  # lm-eval's convention: the answer ends before the first stop string
                if stop:
                    answer = answer.split(stop)[0]
            answers.append(answer)
        return answers

    # -- log-likelihoods -----------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests"):
            context, continuation = request.args
            result = self._score(context, continuation)
            self.cache_hook.add_partial("loglikelihood", (context, continuation), result)
            results.append(result)
        return results

    @torch.no_grad()
    def _score(self, context: str, continuation: str) -> tuple[float, bool]:
        whole = list(self.tokenizer(context + continuation)["input_ids"])
        context_ids = list(self.tokenizer(context)["input_ids"]) if context else []
        if whole[: len(context_ids)] != context_ids:  # the continuation's first token merged with the context's end
            context_ids = whole[: len(context_ids) - 1]
        target = whole[len(context_ids) :]
        if len(context_ids) < 2:
            raise ValueError(
                f"a log-likelihood request whose context has {len(context_ids)} token(s) leaves kvcal nothing to "
                f"compress; {_NOT_COMPRESSED}"
            )
        if not target:
            raise ValueError(f"an empty continuation to score after context {context[-40:]!r}")
        self._check_length(len(whole), 0)
        ids = torch.tensor([whole], dtype=torch.long, device=self._device)
        mask = check_inputs(self.model, ids, None)
        columns = len(context_ids) - 1  # the context but its last token, compressed
        cache, _ = compress_prompt(
            self.model, ids, self.policy, attention_mask=mask, context_columns=columns, calibration=self.calibration
        )
        with ragged_attention(self.model):
            logits = self.model(
                input_ids=ids[:, columns:], attention_mask=mask, **cache_argument(self.model, cache), use_cache=True
            ).logits
        logprobs = F.log_softmax(logits[0, : len(target)].float(), dim=-1)  # fed [context[-1], *target]
        wanted = torch.tensor(target, device=logprobs.device)
        total = float(logprobs.gather(-1, wanted[:, None]).sum())
        greedy = bool((logprobs.argmax(-1) == wanted).all())
        self.counts["loglikelihood_requests"] += 1
        return total, greedy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(
            "kvcal refuses loglikelihood_rolling (perplexity tasks such as wikitext): a rolling log-likelihood has "
            f"no context to compress, and kvcal never scores uncompressed; {_NOT_COMPRESSED}"
        )


# kvcal-lm-eval registers the name first (lazily, "runtime.lm_eval_model:KvcalLM"): lm-eval then
# imports this module to resolve it, and the class is what it finds.
if MODEL_NAME not in model_registry:
    register_model(MODEL_NAME)(KvcalLM)
