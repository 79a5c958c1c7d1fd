"""``generate-probes``: write a needle-probe grid as JSON lines, optionally showing some probes.

Examples::

    generate-probes --preset quick --out probes.jsonl               # embedded model's tokenizer
    generate-probes --preset smoke --out p.jsonl --show 3           # print 3 with spans coloured
    generate-probes --model ./my-model --families retrieval,counting --lengths 1024,8192 \\
        --depths 10,50,90 --haystack prose --out p.jsonl
    generate-probes --haystack dataset:./wiki.parquet --text-column body --out p.jsonl
"""

from __future__ import annotations

import sys

from common.command_line import MAX_COUNT, MAX_SEED, MAX_TOKENS, CommandParser, fail
from common.log import add_verbosity_arguments, configure, logger
from common.options import (
    Choice,
    Integer,
    ListOf,
    Number,
    Option,
    OutputFile,
    Switch,
    Text,
    add_options,
    check_outputs,
)
from common.version import add_version_argument
from needles.families import FAMILIES
from needles.spec import PRESETS, generate_probes, write_probes

DESCRIPTION = (
    """\
Generate REAL-style needle-in-a-haystack probes with token-level behaviour labels.

Each output line is one probe as JSON: id, family, length, depth, seed, question, answer,
input_ids (the whole prompt: the model's chat template around "context, blank line,
question" with the generation prompt, or "context, blank line, question, Answer:" for a
tokenizer without one - the prompt runtime.answer() builds), spans (a list of
{"label": "R"|"B"|"D", "start": i, "end": j} token ranges; every other token is W;
R = retrieval-reasoning, the answer; B = bias, question-related facts that are not the
answer; D = distraction, same-shaped statements with another answer),
context_end (input_ids[:context_end] is the question-free context) and meta.
Lengths are in tokens of the model's tokenizer (the prompt lands within 2%); depths are
percent of the context before the needle.  The same options and seed always give the same
bytes.

presets: """
    + "; ".join(
        f"{name} ({spec.size} probes, lengths {spec.lengths[0]}-{spec.lengths[-1]})" for name, spec in PRESETS.items()
    )
    + """
families: """
    + ", ".join(FAMILIES)
)


EPILOG = """\
haystacks: simple = short procedural sentences (what the embedded 135M model can retrieve
from); prose = varied paragraphs from a built-in grammar; files:PATH = a text file or a
directory of .txt/.md/.rst files; dataset:NAME_OR_PATH = a HuggingFace datasets dataset (hub
name, save_to_disk directory, or a local .json/.jsonl/.csv/.parquet/.txt file; see --text-column).

examples:
  generate-probes --preset quick --out probes.jsonl
  generate-probes --preset smoke --out p.jsonl --show 3
  generate-probes --model ./my-model --families retrieval,counting --lengths 1024,8192 \\
      --depths 10,50,90 --haystack prose --out p.jsonl
  generate-probes --haystack dataset:./wiki.parquet --text-column body --out p.jsonl

exit status: 0 on success, 2 on a bad option or an input that cannot be turned into probes."""


LOG = logger("needles")

# generate-probes' options, each declared once (common.options): the parser is built from them
OPTIONS = (
    Option(
        "--preset",
        "preset",
        Choice(tuple(sorted(PRESETS))),
        "quick",
        "probe grid to start from (default: quick)",
        shown="{" + ",".join(sorted(PRESETS)) + "}",
    ),
    Option(
        "--model",
        "model",
        Text(),
        None,
        "model directory or hub id whose tokenizer and chat template to use "
        "(default: the embedded SmolLM2-135M-Instruct)",
        shown="MODEL",
    ),
    Option("--seed", "seed", Integer(0, MAX_SEED), None, "grid seed (default: the preset's, 0)", shown="SEED"),
    Option(
        "--out",
        "out",
        OutputFile(what="probe file"),
        None,
        "output JSON-lines file (never the haystack file, nor a file that is not text)",
        required=True,
    ),
    Option("--show", "show", Integer(0, MAX_COUNT), 0, "print the first N probes with R/B/D spans coloured"),
    Option(
        "--families",
        "families",
        ListOf(Choice(tuple(FAMILIES), what="family"), distinct=True),
        None,
        f"comma-separated families (default: all: {','.join(FAMILIES)})",
        shown="FAMILIES",
    ),
    Option(
        "--lengths",
        "lengths",
        ListOf(Integer(1, MAX_TOKENS), distinct=True),
        None,
        f"comma-separated prompt lengths in tokens, each once and at most {MAX_TOKENS}",
        shown="LENGTHS",
    ),
    Option(
        "--depths",
        "depths",
        ListOf(Number(0.0, 100.0), distinct=True),
        None,
        "comma-separated depths in percent, each once",
        shown="DEPTHS",
    ),
    Option("--count", "count", Integer(1, MAX_COUNT), None, "probes per (family, length, depth) cell", shown="COUNT"),
    Option(
        "--haystack",
        "haystack",
        Text(),
        None,
        "simple (default) | prose | files:PATH | dataset:NAME_OR_PATH",
        shown="HAYSTACK",
    ),
    Option(
        "--text-column",
        "text_column",
        Text(),
        None,
        "text column of a dataset haystack (default: text)",
        shown="TEXT_COLUMN",
    ),
    Option("--split", "split", Text(), None, "split of a dataset haystack (default: train)", shown="SPLIT"),
    Option(
        "--no-colour",
        "no_colour",
        Switch(),
        False,
        "plain text for --show (also without a terminal, or with NO_COLOR set)",
    ),
    Option(
        "--no-progress",
        "no_progress",
        Switch(),
        False,
        "no progress bar (there is none when stderr is not a terminal)",
    ),
)


def _haystack_files(haystack: str | None) -> str | None:
    """The path of a ``files:PATH`` haystack (an input the output must not replace), else None."""
    kind, _, rest = (haystack or "").partition(":")
    return rest if kind in ("files", "file") and rest else None


def check_haystack(spec) -> None:
    """The haystack checked before the tokenizer loads (``HaystackError``, a ValueError): a known kind,
    a ``files:`` path that exists and holds text, a local ``dataset:`` file or directory that exists."""
    from pathlib import Path

    from needles.haystacks import DATASET_BUILDERS, DatasetHaystack, HaystackError, TextFilesHaystack, make_haystack

    haystack = make_haystack(spec.haystack, text_column=spec.text_column, split=spec.split)
    if isinstance(haystack, TextFilesHaystack):
        haystack.files()
    if isinstance(haystack, DatasetHaystack):
        path = Path(haystack.source).expanduser()
        local = haystack.source.startswith((".", "/", "~")) or path.suffix in DATASET_BUILDERS
        if local and not path.exists():
            raise HaystackError(f"haystack dataset {haystack.source}: no such file or directory")


def build_parser() -> CommandParser:
    parser = CommandParser(prog="generate-probes", description=DESCRIPTION, epilog=EPILOG, raw_description=True)
    add_version_argument(parser)
    add_verbosity_arguments(parser, "no progress bar and only warnings and errors (--show still prints)")
    add_options(parser, OPTIONS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args)
    changes = {
        name: value
        for name, value in (
            ("families", args.families),
            ("lengths", args.lengths),
            ("depths", args.depths),
            ("count", args.count),
            ("haystack", args.haystack),
            ("text_column", args.text_column),
            ("split", args.split),
            ("seed", args.seed),
        )
        if value is not None
    }
    try:
        spec = PRESETS[args.preset].replace(**changes)
        check_haystack(spec)  # every input and the output before the tokenizer loads
        check_outputs(OPTIONS, args, inputs=[_haystack_files(spec.haystack)])
        # The command loads the tokenizer with the loader every kvcal command shares (it also
        # converts the embedded model); the probe generator itself only takes the object.
        from common.models import load_tokenizer, use_progress_bars

        progress = use_progress_bars(args.no_progress or args.quiet)
        tokenizer = load_tokenizer(args.model)
        shown = []

        def stream():
            for probe in generate_probes(spec, tokenizer, progress=progress):
                if len(shown) < args.show:
                    shown.append(probe)
                yield probe

        written = write_probes(stream(), args.out)
    except (ValueError, OSError, RuntimeError) as exc:  # bad spec/input, I/O, common.models.ModelError
        return fail("generate-probes", exc)
    if shown:
        from needles.show import render_probe, use_colour

        colour = use_colour(sys.stdout, args.no_colour)
        for probe in shown:
            print(render_probe(probe, tokenizer, colour=colour))
            print()
    LOG.info(f"wrote {written} probes to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
