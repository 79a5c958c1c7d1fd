"""``evaluate-artifact``: does this artifact help this model, and which policy should I serve?

Runs needle tasks (generated with seeds disjoint from the profiler's) through the model
uncompressed and under every (policy, compression ratio); prints a Markdown table and, per
compression ratio, the policy the artifact's paired rule serves (``profiler.paired_decision``,
the flagship the reference: what ``--write-recommendation`` records), and writes JSON
(``docs/evaluation-format.md``, every task's answers included) and an HTML report on request.

With ``--json OUT`` every finished task is appended to a journal ``OUT.partial.jsonl``
(``profiler.evaluation_journal``): a run killed at any moment loses at most the task in flight,
and ``--resume`` continues it (same settings, checked) to the JSON an uninterrupted run writes.
An existing journal or ``OUT`` is never replaced without ``--resume`` or ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import hashlib
import json
import sys
from pathlib import Path

from common.command_line import MAX_COUNT, MAX_SEED, MAX_TOKENS, CommandParser, fail
from common.log import OUTPUT, add_verbosity_arguments, configure, logger
from common.models import ATTENTION_HELP, AUTO_ATTENTION, DTYPE_CHOICES, DTYPE_HELP
from common.names import ALLOCATIONS, NAMED_POLICIES, SCORER_NAMES, STATISTICS
from common.options import (
    Choice,
    Integer,
    ListOf,
    Number,
    Option,
    OutputFile,
    Renamed,
    Switch,
    Text,
    add_options,
    check_given,
    check_outputs,
)
from common.version import add_version_argument

from .arguments import check_attention_implementation
from .evaluation_journal import (
    JournalError,
    JournalWriter,
    check_recorded,
    configuration_differences,
    journal_path,
    read_journal,
)
from .evaluation_results import (
    COMPRESSION_GRID,
    EVALUATION_SCHEMA,
    EVALUATION_SEED_OFFSET,
    RECOMMENDATION_CANDIDATES,
    cell_keys,
    markdown_table,
    paired_recommendation,
)
from .held_out_tasks import HAYSTACKS
from .paired_decision import DEFAULT_CONFIDENCE, DEFAULT_TOLERANCE

# The runtime's vocabulary, torch-free (common.names): --help lists it without loading torch.
SCORERS = SCORER_NAMES

# The recommendation stage's candidates and two artifact-free references; those the artifact
# cannot serve (a missing section) are left out with a note.  Policies given with --policies
# must all be servable.
DEFAULT_POLICIES = ("baseline", *RECOMMENDATION_CANDIDATES, "uniform/keydiff", "uniform/expected_attention:prompt")
DEFAULT_TASKS = ("all",)
# the settings of --lm-eval-tasks' run (flag, dest), refused without it
LM_EVAL_SETTINGS = (
    ("--lm-eval-limit", "lm_eval_limit"),
    ("--lm-eval-metadata", "lm_eval_metadata"),
    ("--lm-eval-include", "lm_eval_include"),
)
TASK_PRESETS = ("smoke", "quick", "standard")


LOG = logger("profiler")

DESCRIPTION = (
    "Measure how much of the KV cache a model can drop with a calibration artifact, per "
    "eviction policy and compression ratio, on needle tasks it was not calibrated on. Prints "
    "a Markdown table (accuracy with 95% Wilson interval and n, attention-output error, KV bytes, "
    "prefill and decode time) and, per compression ratio, the policy the artifact's paired rule serves: "
    "the flagship unless a cheaper candidate is shown, on the same tasks, not to be worse by more than "
    "--paired-tolerance with --paired-confidence (a dearer one: better), with every candidate's paired "
    "wins, losses and bound, and a note where the tasks are too few for any candidate to replace the "
    "flagship or the intervals do not separate the policies. With --json OUT every finished task is "
    "kept in OUT.partial.jsonl; --resume continues an interrupted run."
)
MODEL = Text(description="a model directory or hub id", metavar="MODEL")


def _check_tasks(tasks) -> None:
    """--tasks: 'all' alone or families (the parser refuses a family twice)."""
    if "all" in tasks and len(tasks) > 1:
        raise ValueError(f"--tasks {','.join(tasks)}: 'all' means every family; give it alone, or list families")


def _check_json_object(text: str) -> None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--lm-eval-metadata {text!r} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--lm-eval-metadata {text!r} is not a JSON object ({{...}})")


@functools.cache
def options() -> tuple:
    """evaluate-artifact's options, each declared once (:mod:`common.options`): the parser is built
    from them, and :func:`check_options` checks the given values before any model work."""
    from needles.families import FAMILIES

    return (
        Option(
            "model", "model", MODEL, None, "model directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
        ),
        Option(
            "--artifact",
            "artifact",
            Text(metavar="ARTIFACT"),
            None,
            "calibration file (default: kv_calibration.h5 next to the model weights, else in the hub snapshot of a "
            "hub id, else in kvcal's cache; found before the model loads)",
        ),
        Option(
            "--compression-ratios",
            "ratios",
            ListOf(Number(0.0, 1.0, high_open=True), distinct=True),
            COMPRESSION_GRID,
            "compression ratios, fractions of the context cache evicted, each once (default "
            + ",".join(f"{r:g}" for r in COMPRESSION_GRID)
            + ")",
            shown="RATIOS",
        ),
        Renamed("--ratios", "was renamed --compression-ratios (the fractions of the context cache evicted)"),
        Option(
            "--policies",
            "policies",
            ListOf(Text()),
            DEFAULT_POLICIES,
            "comma-separated policies, each once, cheapest to serve first (the paired rule's cost order: one listed "
            f"before the flagship is cheaper than it, one after dearer). Default: {','.join(DEFAULT_POLICIES)} (those "
            "the artifact cannot serve are left out)",
            shown="POLICIES",
        ),
        Option(
            "--tasks",
            "tasks",
            ListOf(Choice(("all", *FAMILIES), what="task family"), distinct=True),
            DEFAULT_TASKS,
            "needle families, each once, or 'all' alone (default: all, those the model fails uncompressed included: "
            "a task both policies fail is a tie in the paired rule)",
            shown="TASKS",
            check=_check_tasks,
        ),
        Option(
            "--haystacks",
            "haystacks",
            ListOf(Choice(HAYSTACKS, what="haystack"), distinct=True),
            HAYSTACKS,
            f"haystacks of the tasks, each once and with its own seed (default {','.join(HAYSTACKS)})",
            shown="HAYSTACKS",
        ),
        Option(
            "--preset",
            "preset",
            Choice(TASK_PRESETS),
            "quick",
            "lengths and depths of the tasks, as the needles preset of that name (default quick: "
            "1K/2K/4K tokens x depths 10/50/90); lengths beyond the model's context are dropped",
        ),
        Option(
            "--count",
            "count",
            Integer(1, MAX_COUNT),
            1,
            "tasks per (family, haystack, length, depth) cell (default 1)",
            shown="COUNT",
        ),
        Option(
            "--seed",
            "seed",
            Integer(0, MAX_SEED),
            None,
            f"task seed of the first haystack, the next haystack's + 1 and so on (default: the profiler's probe "
            f"seed + {EVALUATION_SEED_OFFSET})",
            shown="SEED",
        ),
        Option(
            "--question-aware",
            "question_aware",
            Switch(),
            False,
            "compress the whole prompt, question included (default: compress the context before the question is seen)",
        ),
        Option(
            "--max-new-tokens",
            "max_new_tokens",
            Integer(1, MAX_TOKENS),
            24,
            "greedy answer length (default 24)",
            shown="MAX_NEW_TOKENS",
        ),
        Option("--dtype", "dtype", Choice(DTYPE_CHOICES), None, DTYPE_HELP, shown="{" + ",".join(DTYPE_CHOICES) + "}"),
        Option(
            "--attn-implementation",
            "attn_implementation",
            Text(metavar="NAME"),
            AUTO_ATTENTION,
            ATTENTION_HELP,
            check=check_attention_implementation,
        ),
        Renamed(
            "--tolerance",
            "was replaced by --paired-tolerance: the policy printed per compression ratio is now the paired "
            "rule's against the flagship on the same tasks (what --write-recommendation records)",
        ),
        Option(
            "--allow-mismatch",
            "allow_mismatch",
            Switch(),
            False,
            "use an artifact made for other weights/tokenizer of the same architecture (warns)",
        ),
        Option(
            "--json",
            "json_out",
            OutputFile(what="JSON results"),
            None,
            "write the results as JSON to OUT (docs/evaluation-format.md: aggregates and every task's answers); "
            "while the run goes on, every finished task is kept in OUT.partial.jsonl, removed once OUT is written",
        ),
        Option(
            "--resume",
            "resume",
            Switch(),
            False,
            "continue the interrupted run whose journal is OUT.partial.jsonl (--json OUT): its tasks are not run "
            "again, and every setting the results depend on must be the same (refused, naming what differs)",
        ),
        Option(
            "--force",
            "force",
            Switch(),
            False,
            "start over even when OUT or its journal OUT.partial.jsonl exists (without --resume or --force "
            "either is refused)",
        ),
        Option(
            "--write-recommendation",
            "write_recommendation",
            Switch(),
            False,
            "record per compression ratio the policy to serve in the artifact's recommendation section, "
            "which calibration.policy(compression_ratio=...) serves: the flagship unless a cheaper candidate is "
            "shown on the same tasks not to be worse by more than --paired-tolerance with --paired-confidence "
            "(a dearer one: better), docs/artifact-format.md; when the section already holds per-task outcomes "
            "at the same ratios of policies this run measured too, the new tasks are added to them (use another "
            "--seed; a task run again counts once) and the rule decides on all, among the recorded policies; "
            "the artifact is rewritten atomically, its other sections kept, and only if it is still the file "
            "the run read at its start (its SHA-256; else refused, nothing written)",
        ),
        Option(
            "--paired-tolerance",
            "paired_tolerance",
            Number(0.0, 100.0),
            DEFAULT_TOLERANCE * 100,
            f"accuracy points a cheaper policy may give up against the flagship on the same tasks, for the "
            f"printed decision and --write-recommendation (default {DEFAULT_TOLERANCE * 100:g})",
            shown="PAIRED_TOLERANCE",
        ),
        Option(
            "--paired-confidence",
            "paired_confidence",
            Number(0.0, 1.0, low_open=True, high_open=True),
            DEFAULT_CONFIDENCE,
            f"one-sided confidence that it gives up no more, for the printed decision and "
            f"--write-recommendation (default {DEFAULT_CONFIDENCE:g})",
            shown="PAIRED_CONFIDENCE",
        ),
        Option(
            "--replace-recommendation",
            "replace_recommendation",
            Switch(),
            False,
            "with --write-recommendation (refused without it): decide on this run's tasks alone, dropping the "
            "recorded ones",
        ),
        Option(
            "--lm-eval-tasks",
            "lm_eval_tasks",
            ListOf(Text(metavar="TASK"), distinct=True),
            None,
            "also run these lm-evaluation-harness tasks (the lm-eval extra: pip install 'kvcal[lm-eval]'), each "
            "uncompressed (lm-eval's hf model: the reference) and at every --compression-ratios through kvcal serving "
            "what the artifact serves, after the needle tasks; printed as a second table (score, n, 95%% Wilson "
            "interval, paired W/L against uncompressed on the same documents), kept in --json's lm_eval and "
            "shown by --html. "
            "Measured only: the recommendation never reads them. RULER's offline tasks (niah_single_1, "
            "niah_multikey_2, niah_multikey_3, ruler_vt, ruler_cwe, ruler_fwe) need --lm-eval-metadata "
            "'{\"max_seq_lengths\":[4096]}' (lengths the model holds)",
            shown="TASKS",
        ),
        Option(
            "--lm-eval-limit",
            "lm_eval_limit",
            Integer(1, MAX_COUNT),
            None,
            "the first N documents of each lm-eval task (default: all)",
            shown="N",
        ),
        Option(
            "--lm-eval-metadata",
            "lm_eval_metadata",
            Text(metavar="JSON"),
            None,
            "a JSON object handed to lm-eval's tasks as their metadata (lm_eval --metadata); the tokenizer is the "
            "model's unless it names one",
            check=_check_json_object,
        ),
        Option(
            "--lm-eval-include",
            "lm_eval_include",
            ListOf(Text(metavar="DIR")),
            None,
            "directories of task YAML files of your own for --lm-eval-tasks (lm_eval --include_path)",
            shown="DIRS",
        ),
        Option("--html", "html_out", OutputFile(what="HTML report"), None, "write the HTML report to OUT"),
        Option(
            "--no-progress",
            "no_progress",
            Switch(),
            False,
            "no progress bars (there are none when stderr is not a terminal)",
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="evaluate-artifact",
        description=DESCRIPTION,
        epilog="Policies: 'baseline' (uncompressed), or ALLOCATION/SCORER[:STATISTICS][+SUFFIX...] with "
        f"ALLOCATION in {'|'.join(ALLOCATIONS)} (global: learned or kvzip, whose scores compare across "
        "heads; curve: the artifact's budget_curves section) "
        f"and SCORER in {'|'.join(SCORERS)} (STATISTICS {'|'.join(STATISTICS)} for expected_attention: "
        "calibrated = the artifact's query statistics of calibration text, future = of the questions and "
        "answers of needle probes (section future_queries; prototype_attention uses its centres), prompt = "
        "the prompt's own; "
        "kvzip runs a reconstruction pass per task, timed in its prefill, and is never recommended: "
        "calibration.policy() cannot serve it); MomentKV suffixes: +correction (each "
        "head's order from the artifact), +correction0, +correction1 (every head), +moments "
        "(moment-informed eviction; expected_attention or snapkv)"
        + ", or a named policy ("
        + ", ".join(f"{name} = {policy}" for name, policy in NAMED_POLICIES.items())
        + ")"
        + ".",
    )
    add_version_argument(parser)
    add_verbosity_arguments(parser, "only warnings and errors: no notes, no progress bars (the results are printed)")
    add_options(parser, options())
    return parser


def _task_spec(args, config: dict, model_context: int):
    from needles import FAMILIES, PRESETS

    from .held_out_tasks import held_out_tasks

    families = tuple(FAMILIES) if args.tasks == ("all",) else args.tasks
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {', '.join(FAMILIES)} (or 'all')")
    unknown = [h for h in args.haystacks if h not in HAYSTACKS]
    if unknown:
        raise ValueError(f"unknown haystacks {unknown}; known: {', '.join(HAYSTACKS)}")
    # the configuration's entries are free-form (docs/artifact-format.md section 2): one that is
    # not the object (or seed) expected is ignored
    behaviour = config.get("behaviour") if isinstance(config, dict) else None
    profiler_spec = behaviour.get("spec") if isinstance(behaviour, dict) else None
    profiler_seed = profiler_spec.get("seed") if isinstance(profiler_spec, dict) else None
    if isinstance(profiler_seed, bool) or not isinstance(profiler_seed, int):
        profiler_seed = None
    tasks = held_out_tasks(
        PRESETS[args.preset],
        families=families,
        haystacks=args.haystacks,
        count=args.count,
        profiler_seed=profiler_seed,
        model_context=model_context,
        seed=args.seed,
    )
    return tasks, profiler_seed


def _servable(policies, calibration, ratio: float, explicit: bool, quiet: bool = False):
    """``policies`` the calibration can serve; with the default list the others are left out (noted)."""
    kept = []
    for spec in policies:
        missing = [] if spec.is_baseline else spec.policy(ratio).missing(calibration)
        if missing:
            if explicit:
                raise ValueError(missing[0])
            if not quiet:
                LOG.warning(f"evaluate-artifact: leaving out {spec.name}: {missing[0]}")
            continue
        kept.append(spec)
    return kept


def _check_distinct(policies) -> None:
    """No policy twice in --policies (``profiler.recommendation.check_distinct``)."""
    from .recommendation import check_distinct

    check_distinct(policies, "--policies")


def _check_recommendable(args, policies) -> None:
    if args.write_recommendation and not any(not p.is_baseline and not p.needs_reconstruction for p in policies):
        raise ValueError(
            "--write-recommendation needs at least one compression policy that calibration.policy() can serve "
            "(kvzip needs a reconstruction pass per prompt)"
        )


def _servable_in_file(path: Path, policies, args):
    """``(policies, served, identity, config)``: the artifact at ``path`` read and validated (every
    dataset) before the model loads, ``served`` the ``policies`` it serves (explicit ``--policies``:
    all, or ValueError), its model identity and configuration; the model's own check of the artifact
    (its fingerprints) follows once it is loaded (``runtime.load_calibration``)."""
    from artifacts import open_artifact
    from artifacts.reader import is_artifact_file
    from runtime.plan.calibration import Calibration, Recommendation, _serving_fields

    from .model_config import other_architecture

    if not is_artifact_file(path):
        raise ValueError(f"--artifact {path} is not a kvcal artifact (an HDF5 calibration file)")
    with open_artifact(path) as reader:
        reader.validate()
        read = {name: (lambda key, name=name: reader.read(name, key)) for name in reader.sections}
        fields = _serving_fields(reader.model, read, {name: reader.datasets(name) for name in reader.sections})
        if reader.has("recommendation"):
            section = reader.section("recommendation")
            fields["recommendation"] = Recommendation.from_section(section.arrays, section.attrs)
        preview = Calibration(path, reader.model, reader.config, tuple(reader.sections), **fields, reader=reader)
        if other_architecture(args.config, reader.model.arch_fingerprint):
            raise ValueError(
                f"--artifact {path} is the artifact of another architecture ({reader.model.name}); it cannot serve "
                "this model"
            )
        kept = _servable(policies, preview, args.ratios[0], explicit=args.policies != DEFAULT_POLICIES, quiet=True)
        identity, config = reader.model, dict(reader.config)
    _check_recommendable(args, kept)
    return policies, kept, identity, config


def write_recommendation(
    path,
    evaluation: dict,
    policies,
    *,
    extend: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    confidence: float = DEFAULT_CONFIDENCE,
    expected_sha256: str | None = None,
) -> str:
    """Rewrite the artifact at ``path`` with a ``recommendation`` section from ``evaluation`` (under
    the output's lock: a profile-model run writing it at the same time is refused, not overwritten).
    ``expected_sha256``: the SHA-256 of the artifact the run measured, as read at its start; a file
    that differs now (replaced or edited during the run) is refused (ValueError), nothing written.

    When the artifact's section recorded per-task outcomes (schema 1.4) at the same compression
    ratios of candidates this run measured too, and ``extend``, the new tasks are added to them and
    the paired rule decides again on all of them, among the recorded candidates.  Returns a line
    saying what was done."""
    from artifacts import Artifact, open_artifact, write_artifact
    from common.atomic import output_lock

    from .recommendation import can_extend, recommendation_section, recorded_candidates

    candidates = [spec.name for spec in policies if not spec.is_baseline and not spec.needs_reconstruction]
    tasks = evaluation["tasks"]
    ratios = sorted({float(r["compression_ratio"]) for r in evaluation["results"]})
    with output_lock(path, "evaluate-artifact"):
        if expected_sha256 is not None and _file_digest(path) != expected_sha256:
            raise ValueError(
                f"{path} changed since the run read it (SHA-256 {expected_sha256[:12]}... at the start, "
                f"{_file_digest(path)[:12]}... now): its results measured another file; nothing was written, run again"
            )
        with open_artifact(path) as reader:
            sections = {name: reader.section(name) for name in reader.sections}
            config, identity = dict(reader.config), reader.model
        previous = sections.get("recommendation")
        if extend and previous is not None and can_extend(previous, candidates, ratios):
            candidates = recorded_candidates(previous)  # the recorded ones, in their order; the others stay out
        else:
            previous = None
        section = recommendation_section(
            evaluation,
            candidates,
            tasks["seed"],
            ",".join(tasks["families"]),
            tolerance=tolerance,
            confidence=confidence,
            previous=previous,
        )
        entry = {
            "candidates": candidates,
            "compression_ratios": ratios,
            "tasks": {key: tasks[key] for key in ("specs", "families", "haystacks", "seed")},
            "question_aware": evaluation["question_aware"],
            "source": "evaluate-artifact",
        }
        recorded = config.get("recommendation")
        if previous is not None and isinstance(recorded, dict):  # the task specs of every run decided on
            earlier = recorded.get("earlier_tasks") if isinstance(recorded.get("earlier_tasks"), list) else []
            entry["earlier_tasks"] = [*earlier, recorded.get("tasks")]
        config["recommendation"] = entry
        sections = {**sections, "recommendation": section}
        write_artifact(path, Artifact(model=identity, config=config, sections=sections))
    served = ", ".join(
        f"{ratio:g}: {name.decode()}"
        for ratio, name in zip(section["compression_ratios"], section["policy"], strict=True)
    )
    how = "added to the recorded tasks" if previous is not None else "recorded"
    return f"{section.attrs['tasks']} tasks {how}, rule {section['rule'][0].decode()}; serving {served}"


def _file_digest(path) -> str:
    """SHA-256 of the file's bytes (the artifact a journal's results were measured with)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_configuration(args, identity, artifact, policies, tasks, task_ids, loaded=None) -> dict:
    """Everything the results depend on, as the journal records it: ``--resume`` needs it unchanged.
    ``identity``: the artifact's model identity; ``artifact``: its path; ``task_ids``: the tasks' probe
    ids in order.  ``loaded``: what the model was loaded as (``common.models.loaded_as``; before it
    loads, :func:`_expected_load`), recorded when it is not the CPU default (float32, sdpa), whose
    journals keep their form."""
    from common.models import CPU_DEFAULT_LOAD

    model = {
        "argument": args.model,
        "name": identity.name,
        "weights_fingerprint": identity.weights_fingerprint,
        "tokenizer_fingerprint": identity.tokenizer_fingerprint,
    }
    if loaded is not None and loaded != CPU_DEFAULT_LOAD:
        model["loaded"] = dict(loaded)
    return {
        "schema": EVALUATION_SCHEMA,
        "model": model,
        "artifact": {"path": str(artifact), "sha256": _file_digest(artifact)},
        "policies": [p.name for p in policies],
        "compression_ratios": list(args.ratios),
        "tasks": tasks.to_dict(),
        "task_ids": list(task_ids),
        "max_new_tokens": args.max_new_tokens,
        "question_aware": args.question_aware,
    }


def _model_context(config) -> int:
    """The model's positions (its text model's ``max_position_embeddings``), 4096 where it names none:
    the longest tasks are chosen from it, before the model loads."""
    from .model_config import model_positions

    return model_positions(config) or 4096


def _expected_load(args) -> dict | None:
    """What the model will be loaded as (``common.models.loaded_as``), told before it loads where the
    options decide it (``--dtype`` named, or none on a CPU: float32; attention auto, sdpa or eager),
    else None (``--dtype auto``, or none on a GPU: the checkpoint's dtype; another attention)."""
    import torch

    from common.models import AUTO_ATTENTION

    dtype = args.dtype
    if dtype is None:
        dtype = None if torch.cuda.is_available() else "float32"
    elif dtype == "auto":
        dtype = None
    attention = args.attn_implementation
    if attention in (AUTO_ATTENTION, "sdpa"):
        text = args.config.get_text_config() if hasattr(args.config, "get_text_config") else args.config
        attention = "eager" if getattr(text, "attn_logit_softcapping", None) else "sdpa"
    elif attention != "eager":
        attention = None
    if dtype is None or attention is None:
        return None
    return {"dtype": dtype, "attn_implementation": attention}


def _check_resumable(previous, configuration: dict, compare_load: bool = True) -> None:
    """JournalError when the journal ``previous`` was written under settings other than
    ``configuration``, naming each that differs (``compare_load`` False: what the model is loaded as
    is left out, for the check before it loads when the options do not decide it)."""
    recorded = previous.configuration
    if not compare_load:
        recorded, configuration = (
            {**c, "model": {k: v for k, v in c.get("model", {}).items() if k != "loaded"}}
            if isinstance(c.get("model"), dict)
            else c
            for c in (recorded, configuration)
        )
    differences = configuration_differences(recorded, configuration)
    if differences:
        raise JournalError(
            f"--resume: the journal {previous.path} was written with other settings; "
            + "; ".join(differences)
            + ". Rerun with the interrupted run's settings, or --force to start over"
        )


def _check_journal(args):
    """Before any model work: the journal ``--resume`` continues (None to start afresh), or
    ValueError when an existing journal or output would be replaced without --resume / --force."""
    if args.resume and args.force:
        raise ValueError("--resume continues the journal and --force discards it: give one")
    if not args.json_out:
        if args.resume:
            raise ValueError("--resume continues the journal kept beside --json OUT: give the interrupted run's --json")
        return None
    journal, out = journal_path(args.json_out), Path(args.json_out)  # checked by _check_outputs
    if args.force:
        return None
    if journal.exists():
        if not args.resume:
            raise ValueError(
                f"{journal} holds the tasks of an interrupted run writing {out}: --resume continues it, --force "
                "discards it and starts over"
            )
        return read_journal(journal)
    if out.exists():
        raise ValueError(
            f"{out} exists"
            + (f" and there is no journal {journal} to resume (the run finished)" if args.resume else "")
            + ": --force replaces it, or choose another --json"
        )
    if args.resume:
        LOG.warning(f"evaluate-artifact: --resume: no journal at {journal}; starting from the beginning")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args)
    from common.atomic import output_lock
    from common.models import ModelError, load_config
    from runtime.math.geometry import check_config

    try:  # every path, number and combination before any model work
        check_given(options(), args)  # --attn-implementation (imports transformers)
        _check_outputs(args, None)  # before anything is read: a directory, a device, an unwritable place
        args.config = load_config(args.model)  # the model exists (its weights are not read)
        check_config(args.config)  # MLA, Gemma 3n, Gemma 4, Beam: refused by name before the weights load
        _check_outputs(args, _found_artifact(args))  # before the lock of --json is taken
        _check_lm_eval(args)
    except (ValueError, OSError, ModelError) as exc:
        return fail("evaluate-artifact", exc)
    with contextlib.ExitStack() as held:
        if args.json_out:  # one run at a time per output: two would append to one journal
            try:
                held.enter_context(output_lock(args.json_out, "evaluate-artifact"))
            except OSError as exc:
                return fail("evaluate-artifact", exc)
        return _run(args)


def _check_lm_eval(args) -> None:
    """--lm-eval-*: the others only with --lm-eval-tasks; lm-eval installed and knowing every task."""
    given = [flag for flag, dest in LM_EVAL_SETTINGS if getattr(args, dest) is not None]
    if args.lm_eval_tasks is None:
        if given:
            raise ValueError(f"{', '.join(given)} say how --lm-eval-tasks runs; add --lm-eval-tasks, or drop them")
        return
    from .lm_eval_tasks import check_tasks

    check_tasks(list(args.lm_eval_tasks), include=args.lm_eval_include)


def _run_lm_eval(args, model, tokenizer, calibration) -> dict:
    from .lm_eval_tasks import markdown_table, run_tasks

    section = run_tasks(
        model,
        tokenizer,
        calibration,
        list(args.lm_eval_tasks),
        list(args.ratios),
        limit=args.lm_eval_limit,
        metadata=json.loads(args.lm_eval_metadata) if args.lm_eval_metadata else None,
        include=args.lm_eval_include,
        question="aware" if args.question_aware else "auto",
    )
    print("\n" + markdown_table(section))
    return section


def _artifact_path(args) -> Path:
    """The artifact the run reads, found before the model loads: ``--artifact`` (a file, or a directory
    holding kv_calibration.h5), else the first that exists of next to a local model's weights, the hub
    snapshot of a hub id, kvcal's cache (``runtime.plan.calibration.artifact_locations``: where
    load_calibration looks once the model is loaded, from the same model name); ArtifactError naming
    them when there is none."""
    from common.models import resolve_model
    from runtime.plan.calibration import ARTIFACT_FILENAME, artifact_of_source

    if args.artifact is not None:
        path = Path(args.artifact).expanduser()
        if path.is_dir():
            if not (path / ARTIFACT_FILENAME).is_file():
                raise ValueError(f"--artifact {args.artifact} is a directory with no {ARTIFACT_FILENAME} in it")
            path = path / ARTIFACT_FILENAME
        if not path.exists():
            raise ValueError(f"--artifact {args.artifact}: no such file")
        return path
    return artifact_of_source(resolve_model(args.model), give_path="give --artifact")


def _found_artifact(args) -> Path | None:
    """The artifact the run will read when it can be found now, else None (:func:`_run` reports why, in
    its turn): what the lock of --json, taken before that, is checked against."""
    from artifacts import ArtifactError
    from common.models import ModelError

    try:
        return _artifact_path(args)
    except (ValueError, OSError, ArtifactError, ModelError):
        return None


def _check_outputs(args, artifact: Path | None) -> None:
    """--json and --html, and the files written beside them (the journal ``OUT.partial.jsonl`` and
    the lock ``OUT.lock`` of --json; the artifact's lock with --write-recommendation): writable, not
    the artifact (nor a link to it, even with --force), not each other, and --json and --html not
    over a file that is not their kind (an HDF5 file) without --force (``_check_journal``: an
    existing journal, --resume and --force)."""
    from common.atomic import lock_file_path
    from common.models import model_files

    also = []
    if args.json_out:
        also += [
            ("the journal of --json", journal_path(args.json_out), "evaluation journal"),
            ("the lock of --json", lock_file_path(args.json_out), "lock file", False),
        ]
    if artifact is not None and args.write_recommendation:
        also.append(("the artifact's lock", lock_file_path(artifact), "lock file", False))
    inputs = [*model_files(args.model), *([artifact] if artifact is not None else [])]
    check_outputs(options(), args, inputs=inputs, force=args.force, also=also)


def _run(args) -> int:
    from artifacts import ArtifactError, open_artifact
    from common.atomic import check_output_path
    from common.models import ModelError, load_model, load_tokenizer, loaded_as, use_progress_bars
    from runtime import load_calibration
    from runtime.plan.policy_spec import parse_policy

    from .evaluation import evaluate

    progress = use_progress_bars(args.no_progress or args.quiet)

    try:
        policies = [parse_policy(text) for text in args.policies]
        _check_distinct(policies)
        if not any(p.is_baseline for p in policies):
            policies.insert(0, parse_policy("baseline"))
        if args.write_recommendation and args.question_aware:
            raise ValueError("--write-recommendation records question-agnostic measurements; drop --question-aware")
        if args.replace_recommendation and not args.write_recommendation:
            raise ValueError(
                "--replace-recommendation says how --write-recommendation records this run's tasks; without "
                "--write-recommendation nothing is recorded: add it, or drop --replace-recommendation"
            )
        previous = _check_journal(args)
        artifact = _artifact_path(args)
        _check_outputs(args, artifact)  # the journal and the locks too: never the artifact, even through a link
        # the file this run measures: --write-recommendation writes into it only if it is still this one
        started_sha256 = _file_digest(artifact) if args.write_recommendation else None
        # read, validated and checked against the policies before the model loads
        policies, served, identity, artifact_config = _servable_in_file(artifact, policies, args)
        if args.write_recommendation:
            check_output_path(artifact, "artifact")
        # the tasks, from the model's config (its positions) and the artifact's (the profiler's seed)
        tasks, profiler_seed = _task_spec(args, artifact_config, _model_context(args.config))
        if previous is not None:  # the journal --resume continues: its settings and every row it holds
            expected = run_configuration(args, identity, artifact, served, tasks, tasks.ids(), _expected_load(args))
            _check_resumable(previous, expected, compare_load=_expected_load(args) is not None)
            check_recorded(previous, cell_keys(served, args.ratios), tasks.ids())
        model = load_model(args.model, dtype=args.dtype, attn_implementation=args.attn_implementation)
        tokenizer = load_tokenizer(args.model)
        calibration = load_calibration(model, tokenizer, path=artifact, allow_mismatch=args.allow_mismatch)
        policies = _servable(policies, calibration, args.ratios[0], explicit=args.policies != DEFAULT_POLICIES)
        _check_recommendable(args, policies)
        if args.write_recommendation:
            check_output_path(calibration.path, "artifact")
    except (ValueError, OSError, ArtifactError, ModelError) as exc:
        return fail("evaluate-artifact", exc)

    probes = tasks.probes(tokenizer)
    created = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    writer, recorded = None, {}
    if args.json_out:
        configuration = run_configuration(
            args,
            calibration.identity,
            calibration.path,
            policies,
            tasks,
            [probe.id for probe in probes],
            loaded_as(model),
        )
        try:
            if previous is not None:
                # checked before the model loaded; again now for what only the loaded model tells (its
                # dtype under --dtype auto) and an artifact changed meanwhile
                _check_resumable(previous, configuration)
                check_recorded(previous, cell_keys(policies, args.ratios), configuration["task_ids"])
                created, recorded = previous.created or created, previous.rows
                writer = JournalWriter.resume(previous)
                LOG.info(
                    f"evaluate-artifact: resuming {previous.path}: {len(recorded)} of {len(probes)} tasks recorded"
                )
            else:
                writer = JournalWriter.start(journal_path(args.json_out), configuration, created)
        except (ValueError, OSError) as exc:
            return fail("evaluate-artifact", exc)
    try:
        evaluation = evaluate(
            model,
            tokenizer,
            probes,
            policies,
            list(args.ratios),
            calibration=calibration,
            question_aware=args.question_aware,
            max_new_tokens=args.max_new_tokens,
            progress=progress,
            on_task=writer.append if writer is not None else None,
            recorded=recorded,
        )
    except KeyboardInterrupt:
        if writer is None:
            raise
        done = len(recorded) + writer.tasks
        LOG.error(
            f"\nevaluate-artifact: interrupted; {done} of {len(probes)} tasks are kept in {writer.path}: rerun with "
            "--resume to continue"
        )
        return 130
    candidates = [spec.name for spec in policies if not spec.is_baseline and not spec.needs_reconstruction]
    evaluation.update(
        {
            "created": created,
            "model": {
                "name": calibration.identity.name,
                "weights_fingerprint": calibration.identity.weights_fingerprint,
            },
            "artifact": str(calibration.path),
            "tasks": {
                **tasks.to_dict(),
                "families": list(tasks.families),
                "haystacks": list(tasks.haystacks),
                "count": len(probes),
                "seed": tasks.seed,
                "profiler_seed": profiler_seed,
            },
            "task_summary": f"{tasks.describe()}; {'question-aware' if args.question_aware else 'question-agnostic'}",
            "recommendation": paired_recommendation(
                evaluation, candidates, tolerance=args.paired_tolerance / 100.0, confidence=args.paired_confidence
            )
            if candidates
            else None,
        }
    )
    print(markdown_table(evaluation))
    if args.lm_eval_tasks:
        try:
            evaluation["lm_eval"] = _run_lm_eval(args, model, tokenizer, calibration)
        except (KeyboardInterrupt, Exception) as exc:  # the needle tasks stay in the journal: --resume keeps them
            kept = f"; the needle tasks are kept in {writer.path} (--resume runs what is missing)" if writer else ""
            LOG.error(f"evaluate-artifact: the lm-eval tasks stopped: {exc!r}{kept}")
            LOG.debug("where the lm-eval tasks stopped", exc_info=True)  # -v shows the traceback
            return 130 if isinstance(exc, KeyboardInterrupt) else 2
    if args.json_out:
        from common.atomic import write_atomic

        try:
            write_atomic(args.json_out, json.dumps(evaluation, indent=2, sort_keys=True) + "\n", what="JSON results")
        except OSError as exc:
            LOG.error(f"evaluate-artifact: {exc} (the measured tasks are kept in {writer.path})")
            return 2
        writer.path.unlink(missing_ok=True)  # everything it held is in the JSON now
    if args.write_recommendation:
        calibration.close()
        try:
            done = write_recommendation(
                calibration.path,
                evaluation,
                policies,
                extend=not args.replace_recommendation,
                tolerance=args.paired_tolerance / 100.0,
                confidence=args.paired_confidence,
                expected_sha256=started_sha256,
            )
        except (ValueError, OSError, ArtifactError) as exc:
            LOG.error(f"evaluate-artifact: could not write the recommendation into {calibration.path}: {exc}")
            return 2
        LOG.info(f"\nwrote the recommendation section into {calibration.path}: {done}", extra=OUTPUT)
    if args.html_out:
        from artifacts.report import write_report

        try:
            with open_artifact(calibration.path) as reader:
                write_report(args.html_out, reader, evaluation)
        except (OSError, ArtifactError) as exc:
            LOG.error(f"evaluate-artifact: {exc}")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
