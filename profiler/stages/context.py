"""What a stage may read: :class:`StageContext`, and the options of the inputs the stages share.

The job (:mod:`profiler.job`) loads the model, resolves every option and looks at the artifact
already at the output path; it hands the result to each stage as one frozen
:class:`StageContext`.  A stage reads its inputs there and nowhere else, and never imports the
job.  The calibration text and the needle probes are built on first use (a stage that needs
neither costs nothing); both are functions of the context's fields, so that a context stays
what it was made as.

Imports no torch (the parser reads :data:`CALIBRATION_TEXT_OPTIONS` and :data:`PROBE_OPTIONS`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from common.command_line import MAX_COUNT, MAX_SEED, MAX_TOKENS
from common.log import output
from common.options import Integer, Option, Text

CALIBRATION_SOURCE_DEFAULT = "needles prose haystack"
LOCAL_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".csv", ".parquet", ".arrow")  # a name with one is a path
_TRUE = ("1", "true", "yes", "on")


def check_calibration_source(spec: str) -> None:
    """``--calib-dataset`` checked before the model loads (``ValueError``): local files and
    directories exist, are of a kind the reader takes and are not empty; anything else is a
    datasets hub name (``org/name`` or ``name``, optionally ``:config``: else refused), in the local
    cache when the hub is offline, and otherwise one the hub confirms (asked once, with a timeout):
    one it does not know, or a hub that cannot be reached with no copy cached, is refused here, not
    after the model has loaded and ``datasets`` has retried for 40 s."""
    from profiler.calibration_text import RECORD_SUFFIXES, TEXT_SUFFIXES  # torch: not for the parser

    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"calib_dataset (--calib-dataset) names no file, directory or dataset: {spec!r}")
    paths = [Path(part).expanduser() for part in parts]
    looks_local = [
        part.startswith((".", "/", "~")) or Path(part).suffix in LOCAL_SUFFIXES or path.exists()
        for part, path in zip(parts, paths, strict=True)
    ]
    if any(looks_local):
        for path in paths:
            if not path.exists():
                raise ValueError(f"calib_dataset (--calib-dataset): no such file or directory: {path}")
            if path.is_file() and path.suffix not in TEXT_SUFFIXES + RECORD_SUFFIXES:
                raise ValueError(
                    f"calib_dataset (--calib-dataset): {path}: not read as calibration text; use .txt, .md, .jsonl "
                    "or .json files, or a directory of them (or a datasets save_to_disk directory)"
                )
            if path.is_dir() and not any(entry.is_file() for entry in path.rglob("*")):
                raise ValueError(f"calib_dataset (--calib-dataset): {path} is an empty directory")
        return
    from common.models import could_be_hub_id

    for name in parts:
        dataset = name.partition(":")[0]
        if not could_be_hub_id(dataset):
            raise ValueError(
                f"calib_dataset (--calib-dataset): {name!r} is no local file or directory, nor a datasets hub name "
                "(org/name or name, optionally :config)"
            )
        if _dataset_cached(dataset):
            continue
        if _hub_offline():
            raise ValueError(
                f"calib_dataset (--calib-dataset): {name!r} is no local file or directory, and the hub is offline "
                "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) with no copy of that dataset in the local cache"
            )
        _check_on_the_hub(name, dataset)


HUB_TIMEOUT = 10.0  # seconds the hub has to answer whether a calibration dataset exists


def _check_on_the_hub(name: str, dataset: str) -> None:
    """``dataset`` (not cached) exists on the hub and this user may read it: ValueError when the hub
    says otherwise, or cannot be reached (no network: ``datasets`` would retry for 40 s, after the
    model had loaded).  Any other answer of the hub is left to ``datasets``."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    where = (
        f"calib_dataset (--calib-dataset): {name!r} is no local file or directory, and no copy is in the local cache"
    )
    try:
        HfApi().dataset_info(dataset, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        raise ValueError(
            f"{where}; the hub's {dataset} is gated: accept its conditions on the hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{where}, and the hub has no dataset {dataset} (or it is private: log in with hf auth login)"
        ) from None
    except HFValidationError as exc:
        raise ValueError(f"{where}, and {dataset!r} is no hub name ({exc})") from None
    except HfHubHTTPError:
        return  # the hub answered otherwise (a server error...): datasets says what it makes of it
    except Exception as exc:  # noqa: BLE001 - no network, a timeout, a proxy: the transport's own types
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"{where}, and the hub cannot be reached to load it ({reason}); check the network, give local "
            "files, or a dataset in the cache with HF_HUB_OFFLINE=1"
        ) from None


def _hub_offline() -> bool:
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


def _dataset_cached(name: str) -> bool:
    """Whether a datasets hub ``name`` (``org/name``) has a copy in the hub cache or the datasets cache."""
    from huggingface_hub import constants

    hub = Path(os.environ.get("HF_HUB_CACHE", constants.HF_HUB_CACHE)) / f"datasets--{name.replace('/', '--')}"
    datasets = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
    return hub.exists() or (datasets / name.replace("/", "___")).exists()


def check_probe_file(path: str) -> None:
    """``--probes`` checked before the model loads (``ValueError``): a file of probe records, at least one."""
    from needles.spec import load_probes

    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(f"probes_file (--probes): no such file: {path}")
    if not file.is_file():
        raise ValueError(f"probes_file (--probes): {path} is {'a directory' if file.is_dir() else 'not a file'}")
    try:
        probes = load_probes(file)
    except UnicodeDecodeError:
        raise ValueError(f"probes_file (--probes): {path} is not a JSON-lines probe file (binary content)") from None
    except ValueError as exc:
        raise ValueError(f"probes_file (--probes): {exc}") from None
    if not probes:
        raise ValueError(f"probes_file (--probes): {path} holds no probes")


CALIBRATION_TEXT_TITLE = "calibration text (query-stats, learned-scorer, budget-curves and moments stages)"
CALIBRATION_TEXT_OPTIONS: tuple[Option, ...] = (
    Option(
        "--calib-dataset",
        "calib_dataset",
        Text(metavar="PATHS"),
        None,
        "local .txt/.md/.jsonl/.json files or directories (comma-separated), or a datasets name[:config] "
        "(default: needles' built-in prose)",
        check=check_calibration_source,
    ),
    Option("--calib-split", "calib_split", Text(metavar="SPLIT"), "train", "datasets split (default: train)"),
    Option(
        "--calib-field",
        "calib_field",
        Text(metavar="FIELD"),
        "text",
        "text field of JSON records / datasets rows (default: text)",
    ),
    Option(
        "--calib-samples",
        "calib_samples",
        Integer(1, MAX_COUNT),
        lambda preset: preset.calib_samples,
        "number of calibration windows (default: the preset's)",
    ),
    Option(
        "--calib-tokens",
        "calib_tokens",
        Integer(1, MAX_TOKENS),
        lambda preset: preset.calib_tokens,
        "tokens per calibration window, at most the model's positions (default: the preset's)",
    ),
    Option(
        "--n-sink",
        "n_sink",
        Integer(0, MAX_TOKENS),
        lambda preset: preset.n_sink,
        "leading tokens of each window left out (default: the preset's, 4)",
    ),
    Option("--seed", "seed", Integer(0, MAX_SEED), 0, "seed of the built-in calibration text (default 0)"),
)

PROBE_TITLE = "needle probes (behaviour, future-queries, budget-curves and learned-scorer stages)"
PROBE_OPTIONS: tuple[Option, ...] = (
    Option(
        "--probes",
        "probes_file",
        Text(metavar="FILE"),
        None,
        "JSON-lines probe file (from generate-probes) instead of the preset's needles probes",
        check=check_probe_file,
    ),
    Option(
        "--max-new-tokens",
        "max_new_tokens",
        Integer(1, MAX_TOKENS),
        lambda preset: preset.max_new_tokens,
        "greedy decode steps per probe, behaviour and future-queries stages (default: the preset's)",
    ),
)


def check_shared_settings(settings: Mapping[str, Any]) -> None:
    """What the shared inputs' options must satisfy together (``ValueError``)."""
    if settings["n_sink"] >= settings["calib_tokens"]:
        raise ValueError(
            f"n_sink ({settings['n_sink']}) must be smaller than the window ({settings['calib_tokens']} tokens)"
        )


def digest(*parts) -> str:
    """SHA-256 of ``parts`` (bytes as they are, anything else as its ``str``), NUL-separated."""
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part if isinstance(part, bytes) else str(part).encode())
        sha.update(b"\0")
    return sha.hexdigest()


@dataclass(frozen=True, eq=False)
class StageContext:
    """Everything a stage reads, fixed before the first stage is made.

    ``settings``: every option's value, resolved (:func:`common.options.resolve_settings`:
    given or the default), by ``dest``; ``stage_names``: the stages of this run, in canonical
    order; ``existing_sections``: the sections of the artifact already at ``out`` that the run
    keeps (same model).  ``info`` is this process's place in a multi-process run
    (``profiler.distributed.ProcessInfo``), ``progress`` whether to draw progress bars.
    """

    preset_name: str
    preset: Any  # profiler.presets.ProfilePreset
    settings: Mapping[str, Any]
    stage_names: tuple[str, ...]
    model: Any  # a transformers causal LM
    tokenizer: Any
    geometry: Any  # runtime.math.geometry.ModelGeometry
    identity: Any  # artifacts.ModelIdentity
    out: Path
    existing_sections: frozenset[str]
    info: Any  # profiler.distributed.ProcessInfo
    progress: bool
    log: Callable[[str], None] = output("profiler")  # a line of the command's output (common.log)

    def say(self, message: str) -> None:
        """Log ``message`` on the main process."""
        if self.info.is_main:
            self.log(message)

    @cached_property
    def windows(self):
        """Calibration text as token windows ``[N, T]`` int64 (loaded on first use)."""
        from profiler.calibration_text import calibration_windows  # torch: not for the parser

        settings = self.settings
        return calibration_windows(
            self.tokenizer,
            settings["calib_dataset"],
            settings["calib_samples"],
            settings["calib_tokens"],
            seed=settings["seed"],
            split=settings["calib_split"],
            field=settings["calib_field"],
        )

    def windows_digest(self) -> str:
        return digest(self.windows.numpy().tobytes())

    def probes(self):
        """The needle probes the probe stages share (behaviour, future-queries, learned-scorer,
        budget-curves): ``--probes`` (a JSON-lines file) or the preset's, built lazily
        (:class:`profiler.probe_source.ProbeSet`)."""
        from profiler.probe_source import file_probes, preset_probes
        from runtime.math.geometry import position_limit

        probes_file = self.settings["probes_file"]
        if probes_file:
            probes = file_probes(probes_file)
        else:
            probes = preset_probes(
                self.preset.probes,
                self.tokenizer,
                self.identity.tokenizer_fingerprint,
                dict(self.preset.probe_overrides),
            )
        # dynamic NTK's original context, Llama 4's first chunk (the capture's attention sees every earlier token)
        limit = position_limit(self.geometry.text_config, first_chunk=True)
        longest = probes.max_tokens() + self.settings["max_new_tokens"]
        if limit is not None and longest > limit[0]:
            raise ValueError(
                f"the longest probe plus {self.settings['max_new_tokens']} new tokens is {longest} tokens, past "
                f"{limit[1]}: kvcal profiles and serves it inside that limit only; choose shorter probes "
                "(--probes FILE from generate-probes, or a preset with shorter ones)"
            )
        return probes

    def calibration_config(self) -> dict:
        dataset = self.settings["calib_dataset"]
        return {
            "source": dataset or CALIBRATION_SOURCE_DEFAULT,
            "split": self.settings["calib_split"] if dataset else None,
            "num_samples": self.settings["calib_samples"],
            "sample_tokens": self.settings["calib_tokens"],
        }
