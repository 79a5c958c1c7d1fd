"""The calibration job: load the model, run the stages, checkpoint, reduce, write the artifact.

Stages, in order (``--stages`` selects a subset):

* ``behaviour``   -> section ``behaviour``   (:mod:`profiler.behaviour_stage`)
* ``query-stats`` -> section ``query_stats`` (:mod:`profiler.query_stats`)
* ``budgets``     -> section ``budgets``     (:mod:`profiler.budget_tables`; needs INFsc from
  this run's behaviour stage or from the artifact already at the output path)
* ``moments``     -> section ``moments``     (:mod:`profiler.moments_calibration`: per-KV-head
  MomentKV correction errors on the first ``MOMENT_WINDOWS`` calibration windows; a few
  seconds per window, run by the main process alone, not checkpointed)

Running a subset keeps the other sections of an existing artifact at the output path when it
belongs to the same model (same weights, architecture and tokenizer fingerprints).

Under ``accelerate launch`` each process takes every ``world_size``-th probe / calibration
window, keeps its own work file, and at the end the sums are all-reduced; the main process
alone writes the artifact.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from artifacts import ARTIFACT_FILENAME, Artifact, ArtifactError, Section, open_artifact, write_artifact
from artifacts.schema import canonical_json
from profiler import distributed
from runtime.geometry import ModelGeometry
from profiler.attention_capture import capture_attention_implementation
from profiler.behaviour_stage import BehaviourState, run_probe
from profiler.budget_tables import DEFAULT_BETA, DEFAULT_MIN_BUDGET, DEFAULT_RATIOS, DEFAULT_TOKEN_BUDGETS, \
    budget_tables
from profiler.calibration_text import calibration_windows
from profiler.moments_calibration import measure_correction_errors
from profiler.checkpoint import interrupts_deferred, load_work, remove_work, save_work, work_file_path
from profiler.presets import PRESETS
from profiler.probe_source import file_probes, preset_probes
from profiler.query_stats import QueryStatsAccumulator, collect_queries

STAGE_SECTIONS = {"behaviour": "behaviour", "query-stats": "query_stats", "budgets": "budgets",
                  "moments": "moments"}
MOMENT_WINDOWS = 4  # calibration windows the moments stage measures on
MOMENT_KEEP_RATIOS = (0.25, 0.5)  # reference budgets: 75% and 50% compression
STAGES = tuple(STAGE_SECTIONS)


class JobInterrupted(Exception):
    """Ctrl-C: progress was saved to ``work_path``; rerun with ``--resume``."""

    def __init__(self, work_path: Path):
        super().__init__(f"interrupted; progress saved in {work_path}")
        self.work_path = work_path


@dataclass
class JobOptions:
    model: str | None = None  # local dir, hub id, or None for the embedded model
    out: Path | None = None  # default: <model dir>/kv_calibration.h5 when writable, else ./
    preset: str = "quick"
    stages: tuple[str, ...] = STAGES
    resume: bool = False
    probes_file: str | None = None  # JSON-lines probes instead of the needles preset
    max_new_tokens: int | None = None  # None: the preset's
    calib_dataset: str | None = None  # None: needles' prose haystack generator
    calib_split: str = "train"
    calib_field: str = "text"
    calib_samples: int | None = None
    calib_tokens: int | None = None
    batch_size: int | None = None
    n_sink: int | None = None
    token_budgets: tuple[int, ...] = DEFAULT_TOKEN_BUDGETS
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    beta: float = DEFAULT_BETA
    min_budget: int = DEFAULT_MIN_BUDGET
    checkpoint_every: int = 4  # probes (behaviour) or batches (query stats) between work-file writes
    device_map: str | None = None
    seed: int = 0
    progress: bool = True
    log: object = field(default=print, repr=False)


# ---------------------------------------------------------------------------------- helpers
def default_output(model_dir: str) -> Path:
    """``kv_calibration.h5`` in the model directory when writable, else in the current one."""
    directory = Path(model_dir)
    if directory.is_dir() and os.access(directory, os.W_OK):
        return directory / ARTIFACT_FILENAME
    return Path.cwd() / ARTIFACT_FILENAME


def _digest(*parts) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part if isinstance(part, bytes) else str(part).encode())
        sha.update(b"\0")
    return sha.hexdigest()


def _existing_sections(out: Path, identity, log) -> tuple[dict[str, Section], dict]:
    """Sections and config of an artifact already at ``out`` for the same model, else empty."""
    if not out.exists():
        return {}, {}
    try:
        with open_artifact(out) as reader:
            same = (reader.model.weights_fingerprint == identity.weights_fingerprint
                    and reader.model.arch_fingerprint == identity.arch_fingerprint
                    and reader.model.tokenizer_fingerprint == identity.tokenizer_fingerprint)
            if not same:
                log(f"note: {out} belongs to another model; it will be replaced")
                return {}, {}
            sections = {name: reader.section(name) for name in STAGE_SECTIONS.values() if reader.has(name)}
            return sections, dict(reader.config)
    except ArtifactError as exc:
        log(f"note: the existing {out} is not a valid artifact ({exc}); it will be replaced")
        return {}, {}


# ---------------------------------------------------------------------------------- the job
class ProfileJob:
    """One run of ``profile-model`` (one process of it under ``accelerate``)."""

    def __init__(self, options: JobOptions):
        unknown = [s for s in options.stages if s not in STAGE_SECTIONS]
        if unknown or not options.stages:
            raise ValueError(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
        if options.preset not in PRESETS:
            raise ValueError(f"unknown preset {options.preset!r}; choose from {', '.join(PRESETS)}")
        self.options = options
        self.stages = [s for s in STAGES if s in options.stages]  # canonical order
        preset = PRESETS[options.preset]
        self.max_new_tokens = options.max_new_tokens or preset.max_new_tokens
        self.calib_samples = options.calib_samples or preset.calib_samples
        self.calib_tokens = options.calib_tokens or preset.calib_tokens
        self.batch_size = options.batch_size or preset.batch_size
        self.n_sink = preset.n_sink if options.n_sink is None else options.n_sink
        if self.n_sink >= self.calib_tokens:
            raise ValueError(f"n_sink ({self.n_sink}) must be smaller than the window ({self.calib_tokens} tokens)")
        if options.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self.log = options.log
        self.info = distributed.process_info()

    def _say(self, message: str) -> None:
        if self.info.is_main:
            self.log(message)

    # -- setup --------------------------------------------------------------------------
    def load(self) -> None:
        from artifacts.fingerprint import model_identity
        from runtime.models import load_model, load_tokenizer, resolve_model

        options = self.options
        self.model_path = resolve_model(options.model)
        device_map = options.device_map
        if device_map is None and torch.cuda.is_available():
            device_map = "auto" if not self.info.distributed else {"": str(self.info.device)}
        started = time.perf_counter()
        self.tokenizer = load_tokenizer(options.model)
        self.model = load_model(options.model, device_map=device_map)
        self.geometry = ModelGeometry.of(self.model)
        self.identity = model_identity(self.model, self.tokenizer, options.model or "embedded")
        self.out = Path(options.out) if options.out else default_output(self.model_path)
        self._say(f"model {self.identity.name} ({self.identity.model_type}, {self.geometry.num_layers} layers, "
                  f"{self.geometry.num_q_heads} query / {self.geometry.num_kv_heads} KV heads, d={self.geometry.head_dim}) "
                  f"loaded in {time.perf_counter() - started:.1f} s; output: {self.out}")

        self.probes = None
        if "behaviour" in self.stages:
            self.probes = (file_probes(options.probes_file) if options.probes_file else
                           preset_probes(PRESETS[options.preset].probes, self.tokenizer,
                                         self.identity.tokenizer_fingerprint,
                                         dict(PRESETS[options.preset].probe_overrides)))
        longest = (self.probes.max_tokens() if self.probes is not None else 0) + self.max_new_tokens
        if self.probes is not None and longest > self.identity.max_position_embeddings:
            self._say(f"warning: the longest probe plus {self.max_new_tokens} new tokens is {longest} tokens, beyond "
                      f"the model's {self.identity.max_position_embeddings}-token context")
        self.windows = None
        if "query-stats" in self.stages or "moments" in self.stages:
            self.windows = calibration_windows(self.tokenizer, options.calib_dataset, self.calib_samples,
                                               self.calib_tokens, seed=options.seed, split=options.calib_split,
                                               field=options.calib_field)  # [N, T] int64

    def config(self) -> dict:
        """The JSON-able job configuration recorded in the artifact (per section)."""
        o = self.options
        config = {"profiler": {"preset": o.preset, "stages": list(self.stages), "processes": self.info.world_size,
                               "seed": o.seed}}
        if "behaviour" in self.stages:
            config["behaviour"] = {**self.probes.config, "num_probes": len(self.probes),
                                   "probes_sha256": self.probes.digest,
                                   "max_new_tokens": self.max_new_tokens, "decoding": "greedy",
                                   "context": "prompt tokens", "prefill": "sdpa"}
        if "query-stats" in self.stages:
            config["query_stats"] = {"source": o.calib_dataset or "needles prose haystack",
                                     "split": o.calib_split if o.calib_dataset else None,
                                     "num_samples": self.calib_samples, "sample_tokens": self.calib_tokens,
                                     "batch_size": self.batch_size, "n_sink": self.n_sink,
                                     "windows_sha256": _digest(self.windows.numpy().tobytes())}
        if "moments" in self.stages:
            config["moments"] = {"windows": min(MOMENT_WINDOWS, self.calib_samples), "window_tokens": self.calib_tokens,
                                 **self._moment_settings(), "keep_ratios": list(MOMENT_KEEP_RATIOS),
                                 "source": o.calib_dataset or "needles prose haystack"}
        if "budgets" in self.stages:
            config["budgets"] = {"token_budgets": sorted({int(b) for b in o.token_budgets}),
                                 "ratios": sorted({float(r) for r in o.ratios}), "beta": float(o.beta),
                                 "min_budget": int(o.min_budget),
                                 "token_seq_len": int(self.identity.max_position_embeddings)}
        return config

    # -- run ----------------------------------------------------------------------------
    def run(self) -> Path:
        self.load()
        config = self.config()
        fingerprint = _digest(canonical_json(config), self.identity.weights_fingerprint,
                              self.identity.arch_fingerprint, self.info.world_size, self.info.rank)
        self.work_path = work_file_path(self.out, self.info.rank, self.info.world_size)
        self.out.parent.mkdir(parents=True, exist_ok=True)

        geometry = self.geometry
        self.behaviour = BehaviourState(geometry.num_layers, geometry.num_q_heads)
        self.queries = QueryStatsAccumulator(geometry.num_layers, geometry.num_q_heads, geometry.head_dim)
        self.progress = {"behaviour": 0, "query-stats": 0}
        saved = load_work(self.work_path, fingerprint) if self.options.resume else None
        if saved is not None:
            self.progress, arrays = saved
            self.behaviour = BehaviourState.from_arrays(arrays)
            if "query_n" in arrays:
                self.queries = QueryStatsAccumulator.from_state(
                    {"n": arrays["query_n"], "total": arrays["query_total"], "outer": arrays["query_outer"]})
            self.log(f"[rank {self.info.rank}] resuming from {self.work_path}: "
                     f"{self.progress['behaviour']} probes and {self.progress['query-stats']} calibration batches done")
        elif self.options.resume:
            self._say(f"--resume: no work file at {self.work_path}; starting from the beginning")
        elif self.work_path.exists():
            self.log(f"note: discarding the work file {self.work_path} of an earlier run (use --resume to continue it)")
            remove_work(self.work_path)
        self._fingerprint = fingerprint

        try:
            if "behaviour" in self.stages:
                self._run_behaviour()
            if "query-stats" in self.stages:
                self._run_query_stats()
        except KeyboardInterrupt:
            self._checkpoint()
            raise JobInterrupted(self.work_path) from None

        sections = self._reduce_and_build()
        if "moments" in self.stages and self.info.is_main:
            sections["moments"] = self._run_moments()
        path = None
        if self.info.is_main:
            existing, old_config = _existing_sections(self.out, self.identity, self.log)
            sections = self._add_budgets(sections, existing, config)
            merged_config = {**old_config, **config} if existing else config
            kept = {name: section for name, section in existing.items() if name not in sections}
            if kept:
                self.log(f"keeping section(s) {', '.join(sorted(kept))} of the existing {self.out}")
            artifact = Artifact(model=self.identity, config=merged_config, sections={**kept, **sections})
            path = write_artifact(self.out, artifact)
            self.log(f"wrote {path} (sections: {', '.join(sorted(artifact.sections))})")
        distributed.barrier(self.info)
        remove_work(self.work_path)
        return path if path is not None else self.out

    def _checkpoint(self) -> None:
        arrays = self.behaviour.arrays()
        if self.progress["query-stats"] > 0:  # [L, Hq, d, d] sums are big (0.7 GB at 70B): only once non-zero
            arrays.update({f"query_{k}": v for k, v in self.queries.state().items()})
        save_work(self.work_path, self._fingerprint, self.progress, arrays)

    def _bar(self, stage: str, total: int, initial: int, unit: str):
        return tqdm(total=total, initial=initial, desc=stage, unit=unit, dynamic_ncols=True,
                    disable=not (self.options.progress and self.info.is_main))

    # -- stages -------------------------------------------------------------------------
    def _run_behaviour(self) -> None:
        shard = self.info.shard(len(self.probes))
        start, started = self.progress["behaviour"], time.perf_counter()
        since_checkpoint = 0
        with self._bar("behaviour", len(shard), start, "probe") as bar, \
                capture_attention_implementation(self.model):
            for position in range(start, len(shard)):
                index = shard[position]
                result = run_probe(self.model, self.tokenizer, self.geometry, self.probes[index], self.max_new_tokens)
                with interrupts_deferred():  # sums and progress move together
                    self.behaviour.add(index, result)
                    self.progress["behaviour"] = position + 1
                    since_checkpoint += 1
                    if since_checkpoint >= self.options.checkpoint_every:
                        self._checkpoint()
                        since_checkpoint = 0
                bar.set_postfix(success=f"{self.behaviour.success_rate():.0%}", refresh=False)
                bar.update(1)
        self._checkpoint()
        self._stage_seconds_behaviour = time.perf_counter() - started

    def _run_query_stats(self) -> None:
        shard = self.info.shard(self.windows.shape[0])
        batches = [shard[i:i + self.batch_size] for i in range(0, len(shard), self.batch_size)]
        start, started = self.progress["query-stats"], time.perf_counter()
        device = self.model.get_input_embeddings().weight.device
        since_checkpoint = 0
        # The hooks fill a per-batch accumulator, folded into the totals once the forward pass
        # is complete: an interruption mid-pass leaves the totals untouched.  Each layer sees
        # one addition per batch either way, so the sums are bit-identical to direct hooking.
        batch_sums = QueryStatsAccumulator(*self.queries.shape)
        with self._bar("query-stats", len(batches), start, "batch") as bar, torch.no_grad(), \
                collect_queries(self.geometry, batch_sums, self.n_sink):
            for position in range(start, len(batches)):
                ids = self.windows[batches[position]].to(device)  # [b, T]
                batch_sums.reset()
                self.model.model(input_ids=ids, use_cache=False)
                with interrupts_deferred():
                    self.queries.merge(batch_sums)
                    self.progress["query-stats"] = position + 1
                    since_checkpoint += 1
                    if since_checkpoint >= self.options.checkpoint_every:
                        self._checkpoint()
                        since_checkpoint = 0
                bar.update(1)
        self._checkpoint()
        self._stage_seconds_query = time.perf_counter() - started

    def _moment_settings(self) -> dict:
        """Query window and observation window sized for the calibration windows."""
        query_window = max(4, min(32, self.calib_tokens // 4))
        prefix = self.calib_tokens - query_window
        return {"query_window": query_window, "observation_window": max(1, min(32, prefix // 2)),
                "selection": "snapkv", "n_sink": int(self.n_sink), "recent_window": 8}

    def _run_moments(self) -> Section:
        started = time.perf_counter()
        settings = self._moment_settings()
        windows = self.windows[:MOMENT_WINDOWS]
        result = measure_correction_errors(
            self.model, windows, keep_ratios=MOMENT_KEEP_RATIOS, query_window=settings["query_window"],
            scorer=settings["selection"], observation_window=settings["observation_window"],
            n_sink=settings["n_sink"], recent_window=settings["recent_window"], progress=self.options.progress)
        errors = result["errors"].mean(axis=(2, 3))  # [R, 3]
        chosen = np.take_along_axis(result["errors"], (result["order"].astype(np.int64) + 1)[None, None], axis=1)
        parts = ", ".join(f"keep {r:g}: none {e[0]:.3f} / 0th {e[1]:.3f} / 1st {e[2]:.3f} / chosen {c:.3f}"
                          for r, e, c in zip(result["reference_ratios"], errors, chosen.mean(axis=(1, 2, 3))))
        counts = {name: int((result["order"] == value).sum()) for name, value in (("none", -1), ("0th", 0), ("1st", 1))}
        self._say(f"moments: {windows.shape[0]} windows x {windows.shape[1]} tokens, mean relative attention-output "
                  f"error {parts}; orders {counts}; {time.perf_counter() - started:.1f} s")
        return Section(arrays=result)

    # -- reduction and sections -----------------------------------------------------------
    def _reduce_and_build(self) -> dict[str, Section]:
        info, sections = self.info, {}
        if "behaviour" in self.stages:
            state = self.behaviour
            state.totals = distributed.all_reduce_sum(info, state.totals)
            state.steps = distributed.all_reduce_sum(info, state.steps)
            for done in distributed.gather_objects(info, state.done):
                state.done.update(done)
            arrays = state.section_arrays(self.probes.table)
            sections["behaviour"] = Section(arrays=arrays)
            successes = int(arrays["probe_success"].sum())
            top = np.argsort(arrays["INFsc"].ravel())[::-1][:3]
            heads = ", ".join(f"L{i // self.geometry.num_q_heads}H{i % self.geometry.num_q_heads}"
                              f"={arrays['INFsc'].ravel()[i]:.2f}" for i in top)
            seconds = getattr(self, "_stage_seconds_behaviour", float("nan"))
            self._say(f"behaviour: {len(self.probes)} probes, {int(arrays['probe_steps'].sum())} decode steps, "
                      f"success {successes}/{len(self.probes)} ({successes / len(self.probes):.0%}), "
                      f"top INFsc {heads}; {seconds:.1f} s this run")
        if "query-stats" in self.stages:
            state = self.queries.state()
            reduced = {name: distributed.all_reduce_sum(info, value) for name, value in state.items()}
            stats = QueryStatsAccumulator.from_state(reduced).finalize()
            sections["query_stats"] = Section(arrays=stats, attrs={"n_sink": int(self.n_sink)})
            seconds = getattr(self, "_stage_seconds_query", float("nan"))
            trace = np.trace(stats["cov"].astype(np.float64), axis1=-2, axis2=-1)
            self._say(f"query-stats: {self.calib_samples} windows x {self.calib_tokens} tokens, "
                      f"{int(stats['n'][0, 0])} queries per head (n_sink={self.n_sink}), "
                      f"mean trace(cov) {trace.mean():.3g}; {seconds:.1f} s this run")
        return sections

    def _add_budgets(self, sections: dict[str, Section], existing: dict[str, Section], config: dict
                     ) -> dict[str, Section]:
        if "budgets" not in self.stages:
            return sections
        behaviour = sections.get("behaviour") or existing.get("behaviour")
        if behaviour is None:
            raise ValueError(f"the budgets stage needs INFsc: run the behaviour stage too, or keep an artifact "
                               f"with a behaviour section for this model at {self.out}")
        o = self.options
        arrays, attrs = budget_tables(behaviour["INFsc"], self.geometry.num_kv_heads,
                                      max_seq_len=config["budgets"]["token_seq_len"], token_budgets=o.token_budgets,
                                      ratios=o.ratios, beta=o.beta, min_budget=o.min_budget)
        inf_kv = arrays["inf_kv"]
        table = arrays["token_tables"][min(1, len(arrays["token_tables"]) - 1)] if len(arrays["token_tables"]) else None
        detail = (f", b={arrays['token_budgets'][min(1, len(arrays['token_budgets']) - 1)]}: per-head "
                  f"{table.min()}..{table.max()}") if table is not None else ""
        self._say(f"budgets: {len(arrays['token_budgets'])} token budgets, {len(arrays['ratios'])} ratios, "
                  f"beta={o.beta}, KV-head INF weights {inf_kv.min():.3g}..{inf_kv.max():.3g} "
                  f"({int((inf_kv == 0).sum())} of {inf_kv.size} zero){detail}")
        return {**sections, "budgets": Section(arrays=arrays, attrs=attrs)}


def run_job(options: JobOptions) -> Path:
    return ProfileJob(options).run()
