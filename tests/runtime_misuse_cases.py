"""A campaign of bad calls to the runtime's public API: each must raise a named error with a clear
one-line message, never return a silently wrong result (issue 30).

Every case is a name, a call that must be refused, the exception types it may raise and a pattern
its message must match (the thing the caller got wrong, named).  ``tests/test_runtime_misuse.py``
runs them all; run this file to count them:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/runtime_misuse_cases.py

A case is *handled* when the call raises one of the expected types whose message matches and is
one line; *mishandled* otherwise: no error (accepted), another type (an ``AttributeError`` or an
``IndexError`` from deep inside is no answer), or a message that does not say what is wrong.
Counts before and after issue 30's fixes: docs/results.md R-runtime-misuse-2026-11-26.
"""

from __future__ import annotations

import atexit
import math
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_tiny_llama  # noqa: E402
from test_runtime_policy import write_tiny_artifact  # noqa: E402
from tiny_architectures import make_tiny  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[], object]
    errors: tuple[type[BaseException], ...]
    match: str  # a regular expression the message must contain (re.search)


@dataclass(frozen=True)
class Outcome:
    handled: bool
    what: str  # "refused: ...", "accepted: ..." or "wrong error: ..."


def run_case(case: Case) -> Outcome:
    """Call ``case`` and judge what came back (see the module docstring)."""
    try:
        result = case.call()
    except case.errors as exc:
        message = str(exc)
        if "\n" in message.strip() or not re.search(case.match, message):
            return Outcome(False, f"unclear {type(exc).__name__}: {message[:200]!r}")
        return Outcome(True, f"refused: {type(exc).__name__}: {message[:200]}")
    except Exception as exc:  # noqa: BLE001 - an unexpected type is the finding
        return Outcome(False, f"wrong error {type(exc).__name__}: {str(exc)[:200]!r}")
    return Outcome(False, f"accepted: returned {type(result).__name__}")


# -- inputs ---------------------------------------------------------------------------------------

_MODELS: dict[str, torch.nn.Module] = {}
_DIR = Path(tempfile.mkdtemp(prefix="kvcal-misuse-"))  # the cases' artifacts, removed when the process ends
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


def tiny(layers: int = 2):
    """A tiny random Llama, built once per layer count (the calls never change its weights)."""
    if layers not in _MODELS:
        _MODELS[layers] = make_tiny_llama(num_layers=layers)
    return _MODELS[layers]


def sliding():
    """A tiny Mistral whose layers attend through a sliding window (tests/tiny_architectures.py)."""
    if "sw" not in _MODELS:
        _MODELS["sw"] = make_tiny("mistral-sw")
    return _MODELS["sw"]


def ids(batch: int = 1, length: int = 24, vocab: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (batch, length), generator=generator)


def policy(**fields):
    from runtime import CompressionPolicy

    return CompressionPolicy(**({"keep_ratio": 0.5} | fields))


def calibration(layers: int = 2, sections=("query_stats", "budgets")):
    from runtime import load_calibration

    model = tiny(layers)
    path = write_tiny_artifact(_DIR / f"tiny-{layers}-{'-'.join(sections)}.h5", model, sections)
    return load_calibration(model, path=path)


class Words:
    """A tokenizer for the tiny models: one id per word (ids 4..127), as ``answer`` needs it."""

    pad_token_id = 0
    eos_token_id = 2
    bos_token_id = 1
    chat_template = None

    def __call__(self, text, add_special_tokens=True, **kwargs):
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text, add_special_tokens=True, **kwargs):
        words = [4 + sum(map(ord, word)) % 124 for word in text.split()]
        return ([self.bos_token_id] if add_special_tokens else []) + words

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(str(int(t)) for t in tokens)


def consumed_cache_generation():
    """A compressed cache a first generation consumed, given to a second one."""
    from runtime import compress_prompt
    from runtime.serve.generation import generate_from_cache

    model, prompt = tiny(), ids()
    cache, report = compress_prompt(model, prompt, policy(), context_columns=20)
    mask = torch.ones_like(prompt)
    generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=3, pad_token_id=0)
    return generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=3, pad_token_id=0)


def raw_generate(cache_rows: int = 1, **options):
    """``model.generate`` through a compressed one-row cache, as the generation module's docstring
    shows, with ``options`` (beams, several sequences) that need more rows than it holds."""
    from runtime import cache_argument, compress_prompt, ragged_attention

    model, prompt = tiny(), ids()
    cache, _ = compress_prompt(model, prompt, policy(), context_columns=20)
    with ragged_attention(model):
        return model.generate(
            prompt,
            **cache_argument(model, cache),
            **({"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0} | options),
        )


def prefilled(model=None, length: int = 24):
    from runtime import RaggedCache
    from runtime.compression.prefill import prefill

    model = model or tiny()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids(length=length))
    return cache


def cases() -> list[Case]:
    """Every case of the campaign (inputs are built when a case runs)."""
    import runtime.kv_store.cache
    from runtime import (
        CompressionPolicy,
        RaggedCache,
        answer,
        compress_prompt,
        generate,
        load_calibration,
        parse_policy,
    )
    from runtime.compression.prefill import compress, prefill

    # named by issue 30's fix; on the code before it (counted there) any ValueError would do
    CacheConsumedError = getattr(runtime.kv_store.cache, "CacheConsumedError", ValueError)  # noqa: N806

    from artifacts import ArtifactError

    value = (ValueError, TypeError)
    found: list[Case] = []

    def case(name, call, match, errors=value):
        found.append(Case(name, call, errors, match))

    # CompressionPolicy: every field with a value it cannot take
    for field, bad, match in [
        ("compression_ratio", 1.0, "compression_ratio"),
        ("compression_ratio", -0.1, "compression_ratio"),
        ("compression_ratio", math.nan, "compression_ratio"),
        ("compression_ratio", "0.5", "compression_ratio"),
        ("compression_ratio", True, "compression_ratio"),
        ("keep_ratio", 0.0, "keep_ratio"),
        ("keep_ratio", math.inf, "keep_ratio"),
        ("budget", 0, "budget"),
        ("budget", 2.5, "budget"),
        ("allocation", "bogus", "allocation"),
        ("beta", math.nan, "beta"),
        ("min_budget", -1, "min_budget"),
        ("scorer", "nope", "scorer"),
        ("statistics", "calibrated", "statistics"),
        ("n_sink", -1, "n_sink"),
        ("window", 2.5, "window"),
        ("correction", "order3", "correction"),
        ("tau", -1.0, "tau"),
        ("moment_rounds", 0, "moment_rounds"),
        ("evict_every", 0, "evict_every"),
        ("moment_eviction", "yes", "moment_eviction"),
    ]:
        fields = {"compression_ratio": 0.5} if field in ("keep_ratio", "budget") else {"keep_ratio": 0.5}
        if field in ("compression_ratio", "keep_ratio", "budget"):
            fields = {}
        case(
            f"CompressionPolicy({field}={bad!r})",
            lambda f=field, b=bad, o=fields: CompressionPolicy(**o, **{f: b}),
            match,
        )
    case("CompressionPolicy() with no ratio or budget", lambda: CompressionPolicy(), "exactly one")
    case(
        "CompressionPolicy(keep_ratio=0.5, compression_ratio=0.5)",
        lambda: CompressionPolicy(keep_ratio=0.5, compression_ratio=0.5),
        "exactly one",
    )

    # parse_policy: text that is no policy
    for text, match in [
        ("", "policy"),
        ("inf/", "policy"),
        ("@@garbage@@", "policy"),
        ("inf/nonexistent", "nonexistent"),
        ("nope/leverage", "nope"),
        ("inf/keydiff+nope", r"\+nope"),
        ("inf/keydiff+correction0+correction1", "correction"),
        ("inf/keydiff+correction+correction", "correction"),
        (None, "policy"),
        (3, "policy"),
    ]:
        case(f"parse_policy({text!r})", lambda t=text: parse_policy(t), match)

    # load_calibration and calibration.policy
    case(
        "load_calibration(path missing)",
        lambda: load_calibration(tiny(), path=_DIR / "missing.h5"),
        "missing.h5: no such calibration artifact",
        (ArtifactError,),
    )
    case(
        "load_calibration(path a directory)",
        lambda: load_calibration(tiny(), path=_DIR),
        "kv_calibration.h5: no such calibration artifact",  # a directory is where to look
        (ArtifactError,),
    )

    def text_file():
        path = _DIR / "notes.txt"
        path.write_text("not an artifact\n")
        return load_calibration(tiny(), path=path)

    case("load_calibration(path a text file)", text_file, "notes.txt: not a readable HDF5 file", (ArtifactError,))
    case("load_calibration(a path where the model goes)", lambda: load_calibration(str(_DIR / "x.h5")), "model", value)

    def other_architecture():
        calibration(3)
        from runtime import load_calibration

        return load_calibration(tiny(2), path=_DIR / "tiny-3-query_stats-budgets.h5")

    case(
        "load_calibration(another architecture's artifact)",
        other_architecture,
        "another architecture.*num_layers",
        (ArtifactError,),
    )
    for ratio in (math.nan, -0.5, 1.0, 1.5, "0.75", True, None):
        case(f"calibration.policy({ratio!r})", lambda r=ratio: calibration().policy(r), "compression_ratio|ratio")

    # prefill / compress / compress_prompt
    case(
        "prefill(float input_ids)",
        lambda: prefill(tiny(), RaggedCache.for_model(tiny()), ids().float()),
        "input_ids|integer|dtype",
    )
    case(
        "prefill(attention_mask of the wrong width)",
        lambda: prefill(tiny(), RaggedCache.for_model(tiny()), ids(), torch.ones(1, 5, dtype=torch.long)),
        "attention_mask",
    )
    case(
        "prefill(a cache of another model)",
        lambda: prefill(tiny(2), RaggedCache.for_model(tiny(3)), ids()),
        "layers|cache",
    )
    case("compress(policy None)", lambda: compress(tiny(), prefilled(), None), "policy")
    case("compress(an empty cache)", lambda: compress(tiny(), RaggedCache.for_model(tiny()), policy()), "empty")
    case("compress(a cache of another model)", lambda: compress(tiny(2), prefilled(tiny(3)), policy()), "layers")
    case("compress(a policy that is a string)", lambda: compress(tiny(), prefilled(), "inf/leverage"), "policy")
    case(
        "compress_prompt(a policy that is a dict)",
        lambda: compress_prompt(tiny(), ids(), {"keep_ratio": 0.5}),
        "policy",
    )
    case(
        "compress_prompt(policy needing an artifact, none given)",
        lambda: compress_prompt(tiny(), ids(), policy(allocation="inf")),
        "calibration|artifact",
    )
    case(
        "compress_prompt(calibration of another architecture)",
        lambda: compress_prompt(tiny(2), ids(), policy(allocation="inf"), calibration=calibration(3)),
        "another architecture",
    )
    case(
        "compress_prompt(context_columns = prompt length)",
        lambda: compress_prompt(tiny(), ids(), policy(), context_columns=24),
        "context_columns",
    )
    case("compress_prompt(block_size 0)", lambda: compress_prompt(tiny(), ids(), policy(), block_size=0), "block_size")

    # generate: generate()'s own options, the cache, beams and sequences
    def gen(**options):
        return lambda: generate(tiny(), ids(), policy(), context_columns=20, pad_token_id=0, **options)

    case("generate(num_beams=0)", gen(num_beams=0, max_new_tokens=3), "num_beams")
    case("generate(num_return_sequences=0)", gen(num_return_sequences=0, max_new_tokens=3), "num_return_sequences")
    case(
        "generate(num_return_sequences=3 > num_beams=2)",
        gen(num_beams=2, num_return_sequences=3, max_new_tokens=3),
        "num_return_sequences",
    )
    case("generate(max_new_tokens=-1)", gen(max_new_tokens=-1), "max_new_tokens")
    case(
        "generate(a compressed cache a generation consumed)",
        consumed_cache_generation,
        "consumed|already",
        (CacheConsumedError,),
    )
    case("model.generate(num_beams=3) through an unexpanded cache", lambda: raw_generate(num_beams=3), "num_beams")
    case(
        "model.generate(num_return_sequences=2, do_sample) through an unexpanded cache",
        lambda: raw_generate(num_return_sequences=2, do_sample=True),
        "num_return_sequences",
    )
    case("generate(assisted decoding)", gen(max_new_tokens=3, prompt_lookup_num_tokens=2), "crop|assisted|speculative")

    # sliding-window models
    case(
        "generate(sliding-window model, prompt past its context)",
        lambda: generate(
            _short_context(make_tiny("mistral-sw"), 32), ids(length=40, vocab=512), policy(), context_columns=30
        ),
        "max_position_embeddings|context",
    )
    case(
        "compress_prompt(sliding-window model, a calibration of another model)",
        lambda: compress_prompt(sliding(), ids(vocab=512), policy(allocation="inf"), calibration=calibration()),
        "another architecture|architecture",
    )
    case(
        "generate(sliding-window model, a consumed cache)",
        lambda: _consumed_on(sliding()),
        "consumed|already",
        (CacheConsumedError,),
    )

    # answer
    words = Words()
    case("answer(context an int)", lambda: answer(tiny(), words, 5, "q", policy()), "context")
    case("answer(question None)", lambda: answer(tiny(), words, "a b c", None, policy()), "question")
    case("answer(no questions)", lambda: answer(tiny(), words, "a b c", [], policy()), "question")
    case("answer(two contexts, one question)", lambda: answer(tiny(), words, ["a b", "c d"], "q", policy()), "question")
    case(
        "answer(max_new_tokens=0)",
        lambda: answer(tiny(), words, "a b c d e", "q r", policy(), chat=False, max_new_tokens=0),
        "max_new_tokens",
    )
    case(
        "answer(max_new_tokens=2.5)",
        lambda: answer(tiny(), words, "a b c d e", "q r", policy(), chat=False, max_new_tokens=2.5),
        "max_new_tokens",
    )
    case(
        "answer(a policy that is a string)",
        lambda: answer(tiny(), words, "a b c d e", "q r", "inf/leverage", chat=False),
        "policy",
    )
    return found


def _short_context(model, positions: int):
    model.config.max_position_embeddings = positions
    return model


def _consumed_on(model):
    from runtime import compress_prompt
    from runtime.serve.generation import generate_from_cache

    prompt = ids(length=80, vocab=512)  # longer than the window (64)
    cache, report = compress_prompt(model, prompt, policy(), context_columns=70)
    mask = torch.ones_like(prompt)
    generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=2)
    return generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=2)


def main() -> int:
    torch.set_num_threads(1)
    handled = 0
    all_cases = cases()
    for case in all_cases:
        outcome = run_case(case)
        handled += outcome.handled
        print(f"{'ok ' if outcome.handled else 'BAD'} {case.name}: {outcome.what}")
    print(f"{len(all_cases)} cases, {len(all_cases) - handled} mishandled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
