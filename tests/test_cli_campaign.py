"""The command-line campaign (issue 30): every command, every option, bad values.

Each case is one command line that must be refused: exit status 2, one line on stderr (no
usage dump, no traceback), before any model or tokenizer loads, and every file that was there
before byte-for-byte unchanged.  "Before any model loads" is proven, not timed: the loader every
command shares (``common.models._from_pretrained``) is replaced by a tripwire that raises
:class:`ModelLoadAttempted` (a ``BaseException``, which no command catches) for a model or a
tokenizer; reading a ``config.json`` stays allowed.

The cases are generated from the commands' declarations where they exist (profile-model's
settings: :func:`profiler.stages.settings_options`), so a new option is tried without a new
line here.  Run ``pytest tests/test_cli_campaign.py -q`` for the count; the lead's note records
it (cases tried, mishandled on main before the fixes, mishandled after).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import ModelLoadAttempted, forbid_model_loading

HUGE = "100000000000"  # 1e11: no count, length or seed of these commands may be that large


@dataclass(frozen=True)
class Case:
    command: str  # profile-model | evaluate-artifact | inspect-artifact | generate-probes
    args: tuple[str, ...]  # with {placeholders} of the workspace (see ``workspace``)
    needs: str = ""  # a phrase stderr must contain (e.g. "did you mean")
    offline: bool = True  # HF_HUB_OFFLINE=1; False: none of the offline switches set (the hub may be tried)

    @property
    def id(self) -> str:
        return f"{self.command} {' '.join(self.args)}" + ("" if self.offline else " (hub not set offline)")


# -- the cases --------------------------------------------------------------------------------

PROFILE_BASE = ("--preset", "smoke", "--out", "{tmp}/out.h5", "--no-progress")


def _all_stages() -> str:
    from profiler.stages import STAGE_NAMES

    return ",".join(STAGE_NAMES)


def _kind_values(kind) -> list[str]:
    """Bad command-line texts for a value of ``kind`` (common.options)."""
    from common.options import Choice, Integer, ListOf, Number, OutputFile, Text

    if isinstance(kind, OutputFile):
        # a directory, the input (and a link to it), a file of another kind, a directory that is a file
        return ["{emptydir}", "{art}", "{artlink}", "{other}", "{text}/out"]

    if isinstance(kind, Integer):
        below = (kind.minimum if kind.minimum is not None else 0) - 1
        return [str(below), "abc", "1.5", HUGE]
    if isinstance(kind, Number):
        values = ["nan", "inf", "abc"]
        values.append(f"{kind.low:g}" if kind.low_open else f"{kind.low - 1:g}")
        if math.isfinite(kind.high):
            values.append(f"{kind.high:g}" if kind.high_open else f"{kind.high + 1:g}")
        return values
    if isinstance(kind, Choice):
        return ["nope"]
    if isinstance(kind, ListOf):
        values = [",", *_kind_values(kind.item)[:2]]
        if kind.distinct and isinstance(kind.item, Choice):
            values.append(f"{kind.item.values[0]},{kind.item.values[0]}")
        return values
    if isinstance(kind, Text):
        return [""]
    return []


def _unavailable_attention() -> list[str]:
    """Attention implementations transformers knows that this machine cannot run (issue 41: an
    ImportError traceback once loading began): flash-attn without its package or a CUDA device, a hub
    kernel without the ``kernels`` package."""
    from transformers.utils import import_utils

    names = []
    if not import_utils.is_kernels_available():
        names.append("kernels-community/flash-attn")
        if not import_utils.is_flash_attn_2_available():
            names.append("flash_attention_2")
    return names


def _profile_cases() -> list[Case]:
    from profiler.stages import settings_options

    stages = ("--stages", _all_stages())
    cases = []
    for option in settings_options():
        if option.dest in ("calib_dataset", "probes_file"):
            continue  # paths: below
        for value in _kind_values(option.kind):
            cases.append(Case("profile-model", (*PROFILE_BASE, *stages, f"{option.flag}={value}")))
    paths = {
        "--calib-dataset": ["{tmp}/missing.txt", "{emptydir}", "{tmp}/data.csv", "no-such-org/no-such-dataset"],
        "--probes": ["{tmp}/missing.jsonl", "{emptydir}", "{text}", "{empty}"],
    }
    for flag, values in paths.items():
        for value in values:
            cases.append(Case("profile-model", (*PROFILE_BASE, *stages, flag, value)))
    cases += [
        Case("profile-model", (*PROFILE_BASE, "--stages", "behavior"), needs="did you mean"),
        Case("profile-model", (*PROFILE_BASE, "--stages", "query-stats,budget"), needs="did you mean"),
        Case("profile-model", (*PROFILE_BASE, "--stages", ",")),
        Case("profile-model", (*PROFILE_BASE, "--nope")),
        Case("profile-model", (*PROFILE_BASE, "--preset=nope")),
        Case("profile-model", (*PROFILE_BASE, "--checkpoint-every=0")),
        Case("profile-model", (*PROFILE_BASE, "--checkpoint-every", HUGE)),
        Case("profile-model", (*PROFILE_BASE, "--dtype", "float64")),
        Case("profile-model", (*PROFILE_BASE, "--attn-implementation", "nope")),
        *(Case("profile-model", (*PROFILE_BASE, "--attn-implementation", name)) for name in _unavailable_attention()),
        Case("profile-model", ("{tmp}/no-such-model", *PROFILE_BASE)),
        Case("profile-model", ("{text}", *PROFILE_BASE)),
        # D10: beyond the model's 8192 positions, and absurd
        Case("profile-model", (*PROFILE_BASE, "--stages", "query-stats", "--calib-tokens", "9000")),
        Case("profile-model", (*PROFILE_BASE, "--stages", "query-stats", "--calib-tokens", "100000000")),
        # D12: the schema caps k-means centres at 256
        Case("profile-model", (*PROFILE_BASE, "--stages", "behaviour,future-queries", "--query-centres", "1000")),
        # D6: combinations
        Case("profile-model", (*PROFILE_BASE, "--stages", "moments", "--moments-selection", "learned")),
        Case("profile-model", (*PROFILE_BASE, "--stages", "budgets")),
        Case("profile-model", (*PROFILE_BASE, "--stages", "learned-scorer", "--calib-samples", "1")),
        Case("profile-model", (*PROFILE_BASE, "--stages", "query-stats", "--n-sink", "8", "--calib-tokens", "8")),
        # outputs: a directory, a file that is not an artifact, an input, an artifact that does not validate (D5)
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{tmp}")),
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{text}")),
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{textlink}")),
        Case("profile-model", ("--preset", "smoke", "--stages", "behaviour", "--probes", "{art}", "--out", "{art}")),
        Case(
            "profile-model",
            ("--preset", "smoke", "--stages", "query-stats", "--calib-dataset", "{text}", "--out", "{text}"),
        ),
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{bad}")),
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{badlink}")),
        Case("profile-model", ("--preset", "smoke", "--stages", "query-stats", "--out", "{other}")),
    ]
    return cases


EVAL_BASE = ("--preset", "smoke", "--no-progress")


def _evaluate_cases() -> list[Case]:
    art = ("--artifact", "{art}")
    cases = [
        # D9: the artifact
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{tmp}/missing.h5")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{emptydir}")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{text}")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{bad}")),
        # D15
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{bad}", "--write-recommendation")),
        # D9: tasks, policies
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--tasks", "nope")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--haystacks", "nope")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "@@garbage@@")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "inf/nonexistent")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{other}")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{partial}", "--policies", "inf/keydiff")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{partial}", "--policies", "uniform/keydiff+correction")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "baseline", "--write-recommendation")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "global/kvzip", "--write-recommendation")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--write-recommendation", "--question-aware")),
        *(
            Case("evaluate-artifact", (*EVAL_BASE, *art, "--attn-implementation", name))
            for name in _unavailable_attention()
        ),
        # issue 41: a policy twice, by one name or two (after the whole evaluation, a traceback)
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "baseline,flagship,flagship"), needs="twice"),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "flagship,inf/leverage+correction"), needs="twice"),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--policies", "uniform/keydiff,baseline,baseline"), needs="twice"),
        # issue 41: an option that only means something with another (silently ignored)
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--replace-recommendation"), needs="--write-recommendation"),
        # numbers
        *(
            Case("evaluate-artifact", (*EVAL_BASE, *art, f"{flag}={value}"))
            for flag, values in {
                "--compression-ratios": ["1", "1.5", "-0.1", "nan", ",", "abc"],
                "--count": ["0", "-1", "abc", HUGE],
                "--max-new-tokens": ["0", "-1", "abc", HUGE],
                "--seed": ["abc", "-1", HUGE],
                "--paired-tolerance": ["-1", "101", "nan"],
                "--paired-confidence": ["0", "1", "nan"],
                "--preset": ["nope"],
                "--dtype": ["float64"],
                "--attn-implementation": ["nope"],
            }.items()
            for value in values
        ),
        # outputs (D7): the input, through a symlink, another artifact, a directory
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{art}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{art}", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{artlink}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--html", "{art}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--html", "{artlink}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--html", "{other}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{other}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{emptydir}")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/r.json", "--html", "{tmp}/r.json")),
        # issue 41: the journal OUT.partial.jsonl and the lock OUT.lock are written too: never over the
        # artifact (through a link, even with --force), nor over the other outputs
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/linked.json", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/linked.json", "--resume")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/linked.json")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{journalart}", "--json", "{tmp}/copy.json", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{journalart}", "--json", "{tmp}/copy.json")),
        Case(
            "evaluate-artifact", (*EVAL_BASE, "--artifact", "{journallink}", "--json", "{tmp}/linked.json", "--force")
        ),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/r.json", "--html", "{tmp}/r.json.partial.jsonl")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/locked.json", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{lockart}", "--json", "{tmp}/held.json", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/r.json", "--html", "{tmp}/r.json.lock")),
        # a local model directory's files are inputs too: never replaced by a result, even with --force
        *(
            Case("evaluate-artifact", ("{modeldir}", *EVAL_BASE, *art, option, f"{{modeldir}}/{name}", "--force"))
            for option in ("--json", "--html")
            for name in ("config.json", "model.safetensors", "tokenizer.json")
        ),
        Case("profile-model", ("{modeldir}", *PROFILE_BASE[:2], "--out", "{modeldir}/model.safetensors", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--resume")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--json", "{tmp}/r.json", "--resume", "--force")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--nope")),
        Case("evaluate-artifact", (*EVAL_BASE, *art, "--ratios", "0.5")),
        Case("evaluate-artifact", ("{tmp}/no-such-model", *EVAL_BASE, *art)),
    ]
    return cases


def _inspect_cases() -> list[Case]:
    return [
        Case("inspect-artifact", ("{tmp}/missing.h5",)),
        Case("inspect-artifact", ("{emptydir}",)),
        Case("inspect-artifact", ("{text}",)),
        Case("inspect-artifact", ("{bad}",)),
        Case("inspect-artifact", ("{art}", "--html", "{art}")),
        Case("inspect-artifact", ("{art}", "--html", "{artlink}")),
        Case("inspect-artifact", ("{artlink}", "--html", "{art}")),
        Case("inspect-artifact", ("{art}", "--html", "{other}")),
        Case("inspect-artifact", ("{art}", "--html", "{emptydir}")),
        *(Case("inspect-artifact", ("{art}", f"--budget={value}")) for value in ("-5", "0", "abc", "1.5", HUGE)),
        Case("inspect-artifact", ("{art}", "--nope")),
    ]


PROBES_OUT = ("--out", "{tmp}/p.jsonl")


def _generate_cases() -> list[Case]:
    cases = [
        *(
            Case("generate-probes", (*PROBES_OUT, f"{flag}={value}"))
            for flag, values in {
                "--show": ["-1", "abc", HUGE],
                "--lengths": ["100000000", "0", "-5", ",", "abc", "1.5"],
                "--depths": ["-1", "150", "nan", ",", "abc"],
                "--count": ["0", "-1", "abc", HUGE],
                "--seed": ["abc", "-1", HUGE],
                "--families": ["nope", ",", "retrieval,retrieval"],
                "--haystack": ["nope", "files:{tmp}/missing", "files:{emptydir}", "dataset:{tmp}/missing.parquet"],
                "--preset": ["nope"],
            }.items()
            for value in values
        ),
        Case("generate-probes", ("--out", "{emptydir}")),
        Case("generate-probes", ("--out", "{art}")),
        Case("generate-probes", ("--out", "{artlink}")),
        Case("generate-probes", ("--haystack", "files:{text}", "--out", "{text}")),
        Case("generate-probes", ("--haystack", "files:{text}", "--out", "{textlink}")),
        Case("generate-probes", ("{tmp}/p.jsonl", "--nope")),
        Case("generate-probes", ()),
    ]
    return cases


def _declared_cases() -> list[Case]:
    """Every option the three other commands declare (common.options: ``evaluate_cli.options()``,
    ``artifacts.cli.OPTIONS``, ``needles.cli.OPTIONS``), each with the bad values of its kind, a
    switch given a value, and the bad paths of a model or artifact argument."""
    import artifacts.cli
    import needles.cli
    import profiler.evaluate_cli
    from common.options import Option, Switch

    bad_models = ["{tmp}/no-such-model", "{text}", "{emptydir}"]
    bad_artifacts = ["{tmp}/missing.h5", "{emptydir}", "{text}", "{bad}", "{empty}", "{badlink}"]
    from profiler.cli import job_options

    run, execution = job_options()
    declared = {
        "profile-model": ((*run, *execution), PROFILE_BASE),
        "evaluate-artifact": (profiler.evaluate_cli.options(), (*EVAL_BASE, "--artifact", "{art}")),
        "inspect-artifact": (artifacts.cli.OPTIONS, ("{art}",)),
        "generate-probes": (needles.cli.OPTIONS, PROBES_OUT),
    }
    cases = []
    for command, (options, base) in declared.items():
        for option in options:
            if not isinstance(option, Option):
                continue  # renamed: tried by hand above
            if option.positional:
                values = bad_artifacts if option.dest == "path" else bad_models
                rest = base[1:] if command == "inspect-artifact" else base
                cases += [Case(command, (value, *rest)) for value in values]
                continue
            rest = base  # without the option itself when the base gives it (--artifact, --out, --preset)
            if option.flag in base:
                at = base.index(option.flag)
                rest = (*base[:at], *base[at + 2 :])
            if option.flag == "--artifact":
                values = bad_artifacts
            elif isinstance(option.kind, Switch):
                values = ["yes"]
            else:
                values = _kind_values(option.kind)
            cases += [Case(command, (*rest, f"{option.flag}={value}")) for value in values]
    return cases


# issue 41, second round: refused only after the work (or never), must be refused before it
LONG = 236  # a file name this long fits the file system (255 bytes) but not what the tool writes beside it


def _long(name: str, length: int = LONG) -> str:
    """A file name of ``length`` characters ending in ``name``."""
    return "x" * (length - len(name)) + name


UNWRITABLE = ("/proc/kvcal.out", "/proc/kvcal/sub/kvcal.out", "/sys/kvcal.out")  # directories nobody can write in


def _after_the_work_cases() -> list[Case]:
    """Every command's every output option (a name too long once the tool's suffixes and temporary
    names are added, a directory that cannot be written in) and every list option whose repeated
    values would repeat the work or break its results (issue 41: refused after the evaluation, or a
    traceback)."""
    art = ("--artifact", "{art}")
    profile = ("--preset", "smoke", "--stages", "query-stats", "--no-progress")
    recommend = ("--preset", "smoke", "--stages", "recommendation", "--out", "{art}", "--no-progress")
    cases = []
    outputs = [
        ("evaluate-artifact", (*EVAL_BASE, *art), "--json", ".json"),
        ("evaluate-artifact", (*EVAL_BASE, *art), "--html", ".html"),
        ("inspect-artifact", ("{art}",), "--html", ".html"),
        ("generate-probes", (), "--out", ".jsonl"),
        ("profile-model", profile, "--out", ".h5"),
    ]
    for command, base, flag, suffix in outputs:
        # long enough that a temporary name beside it (or the journal, the work file, the lock) is too long
        for length in (LONG, 240, 250, 255):
            cases.append(Case(command, (*base, flag, "{tmp}/" + _long(suffix, length)), needs="name"))
        cases.append(Case(command, (*base, flag, "{tmp}/" + _long("", 256) + "/out" + suffix)))
        for place in UNWRITABLE:
            cases.append(Case(command, (*base, flag, place + suffix)))
    # --write-recommendation rewrites the artifact beside itself and locks it: a long artifact name
    cases.append(Case("evaluate-artifact", (*EVAL_BASE, "--artifact", "{longart}", "--write-recommendation")))
    # a value twice in a list: the same cells twice (ratios), the same tasks twice (tasks, haystacks,
    # lengths, depths), the same candidate twice (the paired rule's ValueError after the work)
    twice = [
        ("evaluate-artifact", (*EVAL_BASE, *art), "--compression-ratios", "0.5,0.5"),
        ("evaluate-artifact", (*EVAL_BASE, *art, "--write-recommendation"), "--compression-ratios", "0.5,0.5"),
        ("evaluate-artifact", (*EVAL_BASE, *art), "--compression-ratios", "0.25,0.5,0.250"),
        ("evaluate-artifact", (*EVAL_BASE, *art), "--tasks", "retrieval,retrieval"),
        ("evaluate-artifact", (*EVAL_BASE, *art), "--tasks", "all,retrieval"),
        ("evaluate-artifact", (*EVAL_BASE, *art), "--haystacks", "simple,simple"),
        ("generate-probes", PROBES_OUT, "--lengths", "512,512"),
        ("generate-probes", PROBES_OUT, "--depths", "25,25.0"),
        # the artifact at --out holds the candidates' sections: the stage would run
        ("profile-model", recommend, "--recommend-policies", "flagship,flagship"),
        ("profile-model", recommend, "--recommend-policies", "flagship,inf/leverage+correction"),
        ("profile-model", recommend, "--recommend-policies", "uniform/keydiff,flagship,uniform/keydiff"),
    ]
    cases += [Case(command, (*base, flag, value)) for command, base, flag, value in twice]
    # --calib-dataset with the hub not set offline: what is no local path and no hub name, or a hub name
    # with no copy in the local cache that the hub cannot confirm (not there, or no network), is refused
    # before the model loads; datasets retried for 40 s after it had loaded
    calib = (*PROFILE_BASE, "--stages", "query-stats", "--calib-dataset")
    for value in (
        "nonexistent-org/x",
        "nonexistent-org/x:config",
        "no-such-dataset-name",
        "a/b/c",
        "org//x",
        "-org/x",
        "org/x y",
        "org--x/y",
        "{tmp}/missing-dir/",
        "{tmp}/notes.txt,nonexistent-org/x",
    ):
        cases.append(Case("profile-model", (*calib, value), offline=False))
    return cases


def all_cases() -> list[Case]:
    """The cases by hand, then those generated from the declarations (a case already written by hand
    counts once)."""
    cases = [*_profile_cases(), *_evaluate_cases(), *_inspect_cases(), *_generate_cases()]
    cases += _after_the_work_cases()
    seen = {case.id.replace("=", " ") for case in cases}  # --flag=value and --flag value: one case
    for case in _declared_cases():
        if case.id.replace("=", " ") not in seen:
            seen.add(case.id.replace("=", " "))
            cases.append(case)
    return cases


def _cases() -> list[Case]:
    """``all_cases()``, or the list in the JSON file ``KVCAL_CAMPAIGN_CASES`` names: the cases of a
    later checkout, tried on an older commit's code (``benchmarks/cli_campaign.py --commit``, whose
    commands may not declare their options yet)."""
    listed = os.environ.get("KVCAL_CAMPAIGN_CASES")
    if not listed:
        return all_cases()
    import json

    with open(listed, encoding="utf-8") as fh:
        return [Case(entry[0], tuple(entry[1]), *entry[2:]) for entry in json.load(fh)]


CASES = _cases()


# -- the workspace and the runner --------------------------------------------------------------


def _damage_one_dataset(path: Path) -> None:
    """Write a NaN into one dataset (h5py recomputes its fletcher32 checksum): the file stays a kvcal
    artifact whose metadata opens, but its query_stats section does not validate (values must be finite)."""
    with h5py.File(path, "r+") as h5:
        values = np.array(h5["query_stats/mean"][...])
        values.flat[0] = np.nan
        h5["query_stats/mean"][...] = values


def _keep_sections(source: Path, target: Path, names: tuple[str, ...]) -> None:
    """Write ``target``: the artifact at ``source`` with only the sections ``names`` (a real artifact
    of the same model, written by the one writer)."""
    from artifacts import Artifact, open_artifact, write_artifact

    with open_artifact(source) as reader:
        sections = {name: reader.section(name) for name in names}
        artifact = Artifact(model=reader.model, config=dict(reader.config), sections=sections)
    write_artifact(target, artifact)


@pytest.fixture(scope="module")
def artifact_templates(tmp_path_factory, smoke_artifact) -> dict[str, Path]:
    """The artifacts the cases name, made once (each case gets its own copies): a valid artifact of
    the embedded model (``art``: the suite's smoke artifact, conftest's ``smoke_run``), one with a
    damaged dataset (``bad``), one of another model (``other``), the embedded model's with the query
    statistics alone (``partial``)."""
    from conftest import make_random_artifact, make_random_identity

    from artifacts import write_artifact

    directory = tmp_path_factory.mktemp("campaign-artifacts")
    art = directory / "art.h5"
    shutil.copy(smoke_artifact, art)
    bad = directory / "bad.h5"
    shutil.copy(smoke_artifact, bad)
    _damage_one_dataset(bad)
    other = write_artifact(directory / "other.h5", make_random_artifact(make_random_identity(name="another-model")))
    partial = directory / "partial.h5"
    _keep_sections(art, partial, ("query_stats",))
    return {"art": art, "bad": bad, "other": Path(other), "partial": partial}


@pytest.fixture
def workspace(tmp_path, artifact_templates):
    """The files the cases name, fresh for each case: copies of the artifacts, symbolic links to
    them, a text file, an empty file, a CSV file, an empty directory."""
    paths: dict[str, Path] = {"tmp": tmp_path}
    for name, template in artifact_templates.items():
        paths[name] = tmp_path / template.name
        shutil.copy(template, paths[name])
    text = tmp_path / "notes.txt"
    text.write_text("a text file that is no artifact, no probe and no model\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    emptydir = tmp_path / "emptydir"
    emptydir.mkdir()
    # a local model directory of the embedded model's architecture (so that its artifacts serve it):
    # its config (what the commands read before loading), weights and tokenizer
    from common.models import load_config

    modeldir = paths["modeldir"] = tmp_path / "model"
    load_config().save_pretrained(modeldir)
    (modeldir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (modeldir / "tokenizer.json").write_text('{"version": "1.0"}\n')
    # artifacts where evaluate-artifact --json {tmp}/copy.json would keep its journal, --json {tmp}/held.json its lock
    paths["journalart"] = tmp_path / "copy.json.partial.jsonl"
    shutil.copy(paths["art"], paths["journalart"])
    paths["lockart"] = tmp_path / "held.json.lock"
    shutil.copy(paths["art"], paths["lockart"])
    paths["longart"] = tmp_path / ("a" * 248 + ".h5")  # its lock and its temporary name are longer than 255
    shutil.copy(paths["art"], paths["longart"])
    links = {
        "artlink": paths["art"],
        "badlink": paths["bad"],
        "textlink": text,
        "journallink": paths["art"],  # the journal of --json {tmp}/linked.json
        "locklink": paths["art"],  # the lock of --json {tmp}/locked.json
    }
    names = {"journallink": "linked.json.partial.jsonl", "locklink": "locked.json.lock"}
    for name, target in links.items():
        (tmp_path / names.get(name, name)).symlink_to(target)
    paths.update(
        {
            "text": text,
            "empty": empty,
            "emptydir": emptydir,
            **{name: tmp_path / names.get(name, name) for name in links},
        }
    )
    yield {name: str(path) for name, path in paths.items()}
    # about 50 MB of copies a case and about 390 cases: kept to the session's end (pytest's default),
    # they filled a CI machine's disk (20 GB)
    shutil.rmtree(tmp_path, ignore_errors=True)


def _snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every entry under ``directory`` (links not followed): a file's bytes, else None."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            found[str(path)] = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    return found


MAINS = {
    "profile-model": "profiler.cli",
    "evaluate-artifact": "profiler.evaluate_cli",
    "inspect-artifact": "artifacts.cli",
    "generate-probes": "needles.cli",
}


def run_case(case: Case, paths: dict[str, str], monkeypatch, capsys) -> list[str]:
    """Run ``case``; return what it mishandled (empty: handled)."""
    import importlib

    forbid_model_loading(monkeypatch)
    if case.offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    else:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    args = [arg.format(**paths) for arg in case.args]
    before = _snapshot(Path(paths["tmp"]))
    capsys.readouterr()
    problems = []
    main = importlib.import_module(MAINS[case.command]).main
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    except ModelLoadAttempted as exc:
        code = None
        problems.append(f"began loading the model ({exc})")
    except Exception as exc:  # noqa: BLE001 - a traceback is what the campaign looks for
        code = None
        problems.append(f"raised {type(exc).__name__}: {exc}")
    err = capsys.readouterr().err
    if code != 2 and not problems:
        problems.append(f"exit status {code}")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if code == 2 and len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    if "Traceback" in err:
        problems.append("a traceback")
    if case.needs and case.needs not in err:
        problems.append(f"no {case.needs!r}")
    after = _snapshot(Path(paths["tmp"]))
    changed = sorted(path for path, data in before.items() if after.get(path, b"<gone>") != data)
    if changed:
        problems.append(f"changed {changed}")
    return problems


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_command_line_is_refused_in_one_line_before_the_model_loads(case, workspace, monkeypatch, capsys):
    problems = run_case(case, workspace, monkeypatch, capsys)
    log = os.environ.get("KVCAL_CAMPAIGN_LOG")  # one line per case, for the note's count
    if log:
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{case.id}\t{'; '.join(problems) or 'handled'}\n")
    assert not problems, "; ".join(problems)


# -- kills and --resume (slow: a real profile-model run of a tiny model, killed) ---------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    from conftest import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("campaign-tiny-model"), embedded_tokenizer, probes=12, seed=5)


RESUME_CHANGES = [
    (("--dtype", "bfloat16"), "dtype"),
    (("--attn-implementation", "eager"), "attn_implementation"),
]


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(("change", "named"), RESUME_CHANGES, ids=[" ".join(c) for c, _ in RESUME_CHANGES])
def test_a_killed_run_resumed_with_another_load_is_refused_before_the_model_loads(
    tiny_model_dir, tmp_path, monkeypatch, capsys, signal_name, change, named
):
    """Kill a run at its first checkpoint; ``--resume`` with another ``--dtype`` or
    ``--attn-implementation`` is refused in one line naming it, before the model loads (the
    tripwire), the work file kept byte for byte; the same ``--resume`` then finishes the run."""
    import signal

    from conftest import single_thread, start_profile, tiny_profile_args

    from artifacts import open_artifact
    from profiler.cli import main

    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = tiny_profile_args(tiny_model_dir, out, "--stages", "behaviour,budgets", "--checkpoint-every", "1")
    proc = start_profile(args, work)
    proc.send_signal(getattr(signal, signal_name))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and work.exists() and not out.exists(), err[-2000:]
    saved = work.read_bytes()

    with monkeypatch.context() as patched:
        forbid_model_loading(patched)
        capsys.readouterr()
        assert main([*args, *change, "--resume"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err, err
    assert work.read_bytes() == saved and not out.exists()
    with single_thread():
        assert main([*args, "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    with open_artifact(out) as reader:
        reader.validate()
    assert not work.exists()
