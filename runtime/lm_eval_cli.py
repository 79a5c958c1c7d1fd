"""``kvcal-lm-eval``: lm-evaluation-harness's own command line with the model ``kvcal`` registered.

    kvcal-lm-eval --model kvcal --model_args compression_ratio=0.75 --tasks niah_single_1 \\
        --metadata '{"max_seq_lengths":[2048]}' --limit 4

It takes exactly ``lm_eval``'s arguments.  Why a command of its own: lm-eval 0.4.13 (its newest
release) finds a ``--model`` name only in its own registry and reads no entry points for models
(upstream PR #4013 adds that; merged, in no release yet), so ``lm_eval --model kvcal`` cannot find
kvcal.  This command registers ``kvcal`` in its own process only, through lm-eval's public
registry (``model_registry.register("kvcal", target="runtime.lm_eval_model:KvcalLM")``: kvcal's
runtime and torch load when the run asks for the model), then runs lm-eval's console entry,
``lm_eval.__main__.cli_evaluate``, on the same arguments.  kvcal declares the entry point that
discovery reads (``[project.entry-points."lm_eval.models"]`` in pyproject.toml), so with an lm-eval
release that has it plain ``lm_eval --model kvcal`` finds kvcal; RULER's tasks then still need the
tokenizer named (below), which only this command fills in (docs/results.md R-lm-eval-plugin-2026-11-28:
lm-eval at PR #4013's commit).

One argument is added: RULER's tasks build their prompts with the tokenizer that ``tokenizer``,
``pretrained`` or ``model`` names in ``--model_args`` or ``--metadata`` and stop when none does,
while kvcal's default model (the embedded one) is named by no argument.  So for ``--model kvcal``
naming none of the three, ``tokenizer=<the embedded model's directory>`` (the tokenizer of the
model kvcal then loads) goes into ``--metadata``, lm-eval's public argument for it (into its JSON
object when there is one), and one log line says so.

lm-eval is imported inside :func:`main` only: the base install, without the ``lm-eval`` extra,
imports this module, and the command then says how to install the extra.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from common.log import configure, logger

MODEL = "kvcal"
TARGET = "runtime.lm_eval_model:KvcalLM"
# the keys RULER's tasks read a tokenizer from (lm_eval/tasks/ruler/common_utils.py, TOKENIZER_ARG_KEYS)
TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")
# lm-eval's spellings of the options read here (lm_eval run --help)
MODEL_OPTIONS = ("--model", "-M")
MODEL_ARGS_OPTIONS = ("--model_args", "-a")
METADATA_OPTIONS = ("--metadata",)
MISSING = (
    "kvcal-lm-eval needs lm-evaluation-harness, which is not installed: pip install 'kvcal[lm-eval]' "
    "(in a checkout of kvcal: pip install -e '.[lm-eval]')"
)
HELP = (
    "kvcal-lm-eval: lm-evaluation-harness's command line (lm_eval, whose help follows) with the model "
    "'kvcal' registered: kvcal-lm-eval --model kvcal --model_args compression_ratio=0.75 --tasks ... "
    "(kvcal's model_args: README, 'Evaluating with lm-evaluation-harness')."
)
LOG = logger("runtime")


def _occurrences(argv: list[str], options: tuple[str, ...]):
    """Each ``(index, values, inline)`` of ``options`` in ``argv``: ``--opt v1 v2`` (values up to the
    next option, as lm-eval's ``nargs="+"``; ``inline`` False) or ``--opt=v`` (``inline`` True)."""
    index = 0
    while index < len(argv):
        option, equals, value = argv[index].partition("=")
        if option not in options:
            index += 1
        elif equals:
            yield index, [value], True
            index += 1
        else:
            end = index + 1
            while end < len(argv) and not argv[end].startswith("-"):
                end += 1
            yield index, argv[index + 1 : end], False
            index = end


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _arguments(values: list[str]) -> dict:
    """What an ``--model_args`` / ``--metadata`` occurrence sets, as lm-eval reads it: a JSON object
    (its first value), else ``key=value`` pairs, comma-separated or one a value (values unparsed)."""
    parsed = _json_object(values[0]) if values else None
    if parsed is not None:
        return parsed
    pairs = {}
    for value in values:
        for part in re.split(r",(?=\s*\w+=)", value):  # commas before a key: [4096,8192] stays whole
            key, _, text = part.partition("=")
            pairs[key.strip()] = text.strip()
    return pairs


def with_tokenizer_default(argv: list[str], tokenizer: str | None = None) -> tuple[list[str], str | None]:
    """``argv`` with ``tokenizer`` (default: the embedded model's directory) added to ``--metadata``
    when ``--model kvcal`` names no tokenizer, pretrained or model in ``--model_args`` or
    ``--metadata``; and the tokenizer added (None when ``argv`` is returned as it is)."""
    argv = list(argv)
    models = [values for _, values, _ in _occurrences(argv, MODEL_OPTIONS) if values]
    if not models or models[-1][0] != MODEL:  # argparse: the last --model counts
        return argv, None
    named = {}
    for options in (MODEL_ARGS_OPTIONS, METADATA_OPTIONS):
        for _, values, _ in _occurrences(argv, options):
            named.update(_arguments(values))
    if any(str(named.get(key) or "").strip() for key in TOKENIZER_KEYS):
        return argv, None
    if tokenizer is None:
        from common.models import embedded_model_dir

        tokenizer = str(embedded_model_dir())
    objects = [(i, v, inline) for i, v, inline in _occurrences(argv, METADATA_OPTIONS) if v and _json_object(v[0])]
    if objects:  # merged into the (last) JSON object lm-eval reads
        index, values, inline = objects[-1]
        merged = json.dumps({**_json_object(values[0]), "tokenizer": tokenizer})
        if inline:
            argv[index] = f"{argv[index].partition('=')[0]}={merged}"
        else:
            argv[index + 1] = merged
    else:  # one --metadata more: lm-eval merges its occurrences
        argv += [METADATA_OPTIONS[0], json.dumps({"tokenizer": tokenizer})]
    return argv, tokenizer


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills itself only while empty)
        from lm_eval.__main__ import cli_evaluate
        from lm_eval.api.registry import model_registry
    except ImportError as error:
        if (error.name or "").split(".")[0] != "lm_eval":
            raise
        print(MISSING, file=sys.stderr)
        return 2
    if MODEL not in model_registry:
        model_registry.register(MODEL, target=TARGET)
    if {"-h", "--help"} & set(argv):
        print(HELP + "\n")
    else:
        configure(argparse.Namespace())  # kvcal's notes to stderr (common.log)
        argv, tokenizer = with_tokenizer_default(argv)
        if tokenizer is not None:
            LOG.info(
                f"kvcal-lm-eval: --model kvcal names no tokenizer, so the task metadata gets tokenizer={tokenizer} "
                "(the embedded model's, which kvcal loads); name one with --model_args or --metadata"
            )
    sys.argv = [sys.argv[0] if sys.argv and sys.argv[0] else "kvcal-lm-eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
