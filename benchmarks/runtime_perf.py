"""Runtime performance on the embedded model against the unmodified one.

    python benchmarks/runtime_perf.py [--contexts 1024 4096] [--batch-sizes 1 8 32] [--decode-tokens 8]
                                      [--warmup-steps 2] [--keep-ratio 0.25] [--artifact PATH] [--repeats 1]
                                      [--max-prefill-tokens 32768] [--profile-steps 3] [--threads 1]
                                      [--json OUT] [--quick]

"plain" is the unmodified embedded model (``common.models.load_model()``, a second instance
that ``runtime.compression.ragged_attention.enable`` never touches) with transformers' DynamicCache and SDPA.  Every
number is measured within one run on this machine, as ratios to plain where it matters, so
background load hits both sides alike.  For each context length (``--contexts``, filler
sentences, no probe generator) and each batch size (``--batch-sizes``, the context repeated
in every row):

1. **decode ms/token**, greedy, of each cache configuration, all measured in one loop that
   alternates between them step by step (the starting configuration rotates every step),
   after ``--warmup-steps`` untimed steps each (taken before the loop, the ragged caches'
   before plain's cache is built, to keep the peak memory down); a cell is "ratio (ms)": the
   median ms per step of the configuration over its ``--decode-tokens`` timed steps, and its
   ratio to plain's median in the same loop (< 1: faster than plain).  The median, because
   plain's step (DynamicCache concatenates the whole cache every step) is prone to allocator
   spikes of +50% and more on CPU (freshly faulted pages: the JSON has every step's time and
   minor page faults, and the means).  A cost recurring less often than every
   ``--decode-tokens`` steps (a buffer regrowth) may be missed: raise ``--decode-tokens``.
   Configurations:

   * ``plain``: DynamicCache, the full context;
   * ``ragged full``: RaggedCache prefilled, nothing evicted;
   * ``uniform/keydiff``: ``CompressionPolicy(keep_ratio=K, scorer="keydiff")``;
   * with correction: ``inf/keydiff+correction`` (with ``--artifact``:
     ``parse_policy("inf/keydiff+correction").policy(1 - K)``, per-head orders from the
     artifact) or, without one, ``uniform/keydiff+correction1``
     (``CompressionPolicy(keep_ratio=K, scorer="keydiff", correction="order1")``);
   * leverage: the flagship ``inf/leverage+correction`` (``runtime.plan.policy_spec.FLAGSHIP.policy(1 - K)``)
     with ``--artifact``, else ``uniform/leverage`` (``CompressionPolicy(keep_ratio=K)``);
   * ``curve/keydiff+correction`` when the artifact has a ``budget_curves`` section,

   where K is ``--keep-ratio`` (default 0.25).  Bars: nothing evicted <= 1.05x plain at every
   batch; K = 25% kept <= 0.75x plain at B=8, 4K and never above 1.0x.
2. **compression time** (``runtime.compression.prefill``: scoring + eviction of every head of the batch)
   as a percentage of the ragged prefill (``runtime.compression.prefill.prefill`` into a RaggedCache, nothing
   recorded) of the same batch and context.  The ragged prefill is measured at batch B when
   B x context <= ``--max-prefill-tokens``, else estimated as B x the batch-1 time (marked
   ``~``).  Bar: <= 5% at B=8, 4K.  Also at batch 1 (when 1 is among the batch sizes): plain
   and ragged prefill seconds, and the "all-in" overhead (ragged prefill + compression) /
   plain prefill - 1.
3. **per-step split** of a ragged decode step (each ragged configuration, B, context):
   ``--profile-steps`` decode steps under ``torch.profiler`` (CPU activity, after one
   profiled warm-up step, outside the timed loop), summing the CPU time (self + children) of
   the events named by the runtime's ``torch.profiler.record_function`` labels
   ``kvcal.attention``, ``kvcal.correction`` and ``kvcal.eviction`` (a labelled event nested
   in another counts for the inner label only); "rest" (the rest of the model) = the step's
   total minus those.  A label the runtime does not emit is reported "n/a" (its time is in
   "rest").  The milliseconds include the profiler's overhead: read the split, not the speed.
4. **KV bytes** held after compression vs the full cache (DynamicCache at that batch; target
   <= 0.27 at 25% kept), and vs the budget formula ``sum(per-head budgets) x 2 x d x bytes``
   (target <= 1.05); MomentKV sums are reported separately (``moment bytes``).
5. With ``--artifact``: time to load and validate the artifact (fingerprint already known).

The bars are checked on the cells run and printed as PASS / FAIL lines after the tables.

Prefill and compression timings are the fastest of ``--repeats`` runs (batch-1 plain and
ragged prefills alternate).  Caches of one batch size are built, untimed, by prefilling the
context once at batch 1 (``runtime.compression.prefill.prefill_for_policies``: recording what every
policy's scorer needs) and repeating its row (``batch_repeat_interleave``); the compressed
caches are compressed (timed) at batch B.  Peak memory is about two full caches at the
largest batch and context (fp32 B=32 x 4K: ~6 GB each) plus the compressed ones and the
models (measured: docs/results.md R-runtime-perf-memory-2026-11-22).  ``--quick`` is a smoke run (contexts
1024, batch sizes 1 8, 4 decode tokens; explicit options win).  ``--threads 1`` (default)
avoids intra-op threads spinning against other processes on a shared machine.
Prints markdown tables (stdout; progress on stderr) and, with ``--json``, writes everything
(per-step times included) as JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer, use_progress_bars  # noqa: E402
from runtime import FLAGSHIP, CompressionPolicy, RaggedCache, load_calibration, parse_policy  # noqa: E402
from runtime.compression.prefill import compress, prefill, prefill_for_policies  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.kv_store.transformers_compat import cache_argument  # noqa: E402

PLAIN, FULL = "plain", "ragged full"
LABELS = ("kvcal.attention", "kvcal.correction", "kvcal.eviction")  # the runtime's record_function labels
STEP, WARMUP = "kvcal_bench.decode_step", "kvcal_bench.warmup_step"
QUICK = {"contexts": [1024], "batch_sizes": [1, 8], "decode_tokens": 4}
DEFAULTS = {"contexts": [1024, 4096], "batch_sizes": [1, 8, 32], "decode_tokens": 8}
SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "A bird sings in the tree.",
    "The river runs to the sea.",
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def context_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of filler sentences."""
    text, index = [], 0
    while len(tokenizer(" ".join(text))["input_ids"]) < length:
        text.extend(SENTENCES[(index + k) % len(SENTENCES)] for k in range(50))
        index += 3
    return torch.tensor([tokenizer(" ".join(text))["input_ids"][:length]])


def dynamic_cache_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )


def free() -> None:
    """Collect garbage and, with glibc, hand freed heap memory back to the system (several GB of
    caches come and go per cell; without it the next cell starts from a fragmented heap)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- prefill and compression ---------------------------------------------------------------


@torch.no_grad()
def plain_prefill(model, ids):
    """DynamicCache prefilled with ``ids`` by the unmodified model; the greedy next token; seconds."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True), time.perf_counter() - start


@torch.no_grad()
def ragged_prefill_seconds(model, ids) -> float:
    """Seconds of the ragged prefill of ``ids`` (nothing recorded); the cache is dropped."""
    cache = RaggedCache.for_model(model)
    start = time.perf_counter()
    prefill(model, cache, ids)
    seconds = time.perf_counter() - start
    del cache
    free()
    return seconds


def repeated(cache, batch: int):
    """``cache`` with its single row repeated ``batch`` times (in place)."""
    if batch > 1:
        cache.batch_repeat_interleave(batch)
    return cache


def compressed_copy(model, source: RaggedCache, batch: int, policy, calibration, repeats: int):
    """``source`` (batch 1, prefilled for the policy) repeated to ``batch`` rows and compressed:
    the cache, its CompressionReport and the fastest compression seconds of ``repeats``."""
    times, cache, report = [], None, None
    for _ in range(repeats):
        del cache
        free()
        cache = repeated(source.copy(), batch)
        start = time.perf_counter()
        report = compress(model, cache, policy, calibration)
        times.append(time.perf_counter() - start)
    return cache, report, min(times), times


# -- decode ----------------------------------------------------------------------------------


@torch.no_grad()
def decode_steps(model, cache, token, steps: int) -> torch.Tensor:
    """``steps`` untimed greedy steps (warm-up); the next token."""
    for _ in range(steps):
        token = model(token, **cache_argument(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return token


@torch.no_grad()
def interleaved_decode(runs: dict, steps: int) -> tuple[dict, dict, dict]:
    """Greedy steps alternating between the configurations ``{name: (model, cache, token)}`` (one
    step each in turn, the first one rotating): the milliseconds and the minor page faults of
    every step of each, and its next token."""
    names = list(runs)
    tokens = {name: token for name, (_, _, token) in runs.items()}
    step_ms = {name: [] for name in names}
    step_faults = {name: [] for name in names}
    for step in range(steps):
        offset = step % len(names)
        for name in names[offset:] + names[:offset]:
            model, cache, _ = runs[name]
            faults = minor_faults()
            start = time.perf_counter()
            logits = model(tokens[name], **cache_argument(model, cache), use_cache=True).logits
            tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
            step_ms[name].append(1000 * (time.perf_counter() - start))
            step_faults[name].append(minor_faults() - faults)
    return step_ms, step_faults, tokens


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@torch.no_grad()
def step_split(model, cache, token, steps: int) -> dict:
    """Per-step milliseconds of ``steps`` profiled decode steps: total, each label (None when the
    runtime did not emit it) and the rest (see the module docstring, item 3)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps + 1):
            with record_function(STEP if step else WARMUP):
                logits = model(token, **cache_argument(model, cache), use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
    return split_events(prof.events(), steps)


def split_events(events, steps: int) -> dict:
    """Exclusive CPU time of each label inside the ``STEP`` events (a labelled event nested in a
    labelled one is taken out of the outer label), per step, in ms."""
    step_us = 0.0
    label_us = {label: 0.0 for label in LABELS}
    present = set()
    for event in events:
        if event.name == STEP:
            step_us += event.cpu_time_total
        if event.name not in LABELS:
            continue
        enclosing, parent, in_step = None, event.cpu_parent, False
        while parent is not None:
            if enclosing is None and parent.name in LABELS:
                enclosing = parent
            if parent.name in (STEP, WARMUP):
                in_step = parent.name == STEP
                break
            parent = parent.cpu_parent
        if not in_step:
            continue
        present.add(event.name)
        label_us[event.name] += event.cpu_time_total
        if enclosing is not None:
            label_us[enclosing.name] -= event.cpu_time_total
    per_step = {"step_ms": step_us / steps / 1000}
    for label in LABELS:
        per_step[label] = label_us[label] / steps / 1000 if label in present else None
    per_step["rest_ms"] = per_step["step_ms"] - sum(label_us[label] for label in present) / steps / 1000
    return per_step


# -- one (batch, context) cell ------------------------------------------------------------------


def run_cell(models, single, batch, args, policies, base, results) -> None:
    """Every configuration at one batch size and context: compression, KV bytes, interleaved decode,
    per-step split.  ``base``: the batch-1 prefills of this context."""
    plain_model, model = models
    context = single.shape[1]
    cell = {"batch": batch, "context": context, "compression": {}, "kv_bytes": {}}
    b1 = base["ragged_prefill_s"]
    if batch == 1:
        cell["ragged_prefill_s"], cell["ragged_prefill_measured"] = b1, True
    elif batch * context <= args.max_prefill_tokens:
        ids = single.expand(batch, -1).contiguous()
        cell["ragged_prefill_s"] = min(ragged_prefill_seconds(model, ids) for _ in range(args.repeats))
        cell["ragged_prefill_measured"] = True
        log(f"B={batch} T={context}: ragged prefill {cell['ragged_prefill_s']:.2f} s")
    else:
        cell["ragged_prefill_s"], cell["ragged_prefill_measured"] = batch * b1, False

    token = base["token"].expand(batch, 1)
    compressed_runs = {}
    # the compressed caches first (each passes through a full copy), then the two full ones
    for name, (policy, calibration) in policies.items():
        cache, report, seconds, times = compressed_copy(model, base["ragged"], batch, policy, calibration, args.repeats)
        cell["compression"][name] = {
            "seconds": seconds,
            "seconds_all": times,
            "percent_of_ragged_prefill": 100 * seconds / cell["ragged_prefill_s"],
        }
        cell["kv_bytes"][name] = {
            "held": cache.kv_bytes(),
            "formula": int(report.budgets.sum()) * cache.bytes_per_token(),
            "moments": cache.moment_bytes() if hasattr(cache, "moment_bytes") else None,
        }
        compressed_runs[name] = (model, cache, token)
        log(f"B={batch} T={context}: {name} compressed in {seconds:.2f} s")
        del cache, report
    full = repeated(base["ragged"].copy(), batch)
    full.stop_observing()
    cell["kv_bytes"][FULL] = {"held": full.kv_bytes(), "formula": None, "moments": None}
    # warm-up steps, the ragged caches' before plain's cache exists: what their first growth
    # frees goes back to the system (free()) instead of adding to the peak
    ragged_runs = {FULL: (model, full, token)} | compressed_runs
    ragged_runs = {name: (m, c, decode_steps(m, c, t, args.warmup_steps)) for name, (m, c, t) in ragged_runs.items()}
    free()
    plain = repeated(copy.deepcopy(base["plain"]), batch)
    cell["kv_bytes"][PLAIN] = {"held": dynamic_cache_bytes(plain), "formula": None, "moments": None}
    full_bytes = cell["kv_bytes"][PLAIN]["held"]
    for entry in cell["kv_bytes"].values():
        entry["vs_full"] = entry["held"] / full_bytes
        entry["vs_formula"] = entry["held"] / entry["formula"] if entry["formula"] else None
    runs = {PLAIN: (plain_model, plain, decode_steps(plain_model, plain, token, args.warmup_steps))} | ragged_runs
    del plain, full, compressed_runs, ragged_runs  # runs holds the only references: dropped one by one below

    log(f"B={batch} T={context}: interleaved decode, {args.decode_tokens} tokens x {len(runs)} configurations")
    step_ms, step_faults, tokens = interleaved_decode(runs, args.decode_tokens)
    median_ms = {name: statistics.median(times) for name, times in step_ms.items()}
    mean_ms = {name: statistics.fmean(times) for name, times in step_ms.items()}
    cell["decode_ms"] = median_ms
    cell["decode_ratio"] = {name: ms / median_ms[PLAIN] for name, ms in median_ms.items()}
    cell["decode_mean_ms"] = mean_ms
    cell["decode_mean_ratio"] = {name: ms / mean_ms[PLAIN] for name, ms in mean_ms.items()}
    cell["decode_step_ms"] = step_ms
    cell["decode_step_minor_faults"] = step_faults

    # the profiler holds every event in memory: each cache is dropped as soon as it is done with
    del runs[PLAIN]
    free()
    cell["step_split"] = {}
    for name in list(runs):
        run_model, cache, _ = runs.pop(name)
        if args.profile_steps:
            cell["step_split"][name] = step_split(run_model, cache, tokens[name], args.profile_steps)
        del cache
        free()
    if args.profile_steps:
        log(f"B={batch} T={context}: profiled {args.profile_steps} steps of each ragged configuration")
    results["cells"].append(cell)


def run_context(models, single, args, policies, results) -> None:
    """Batch-1 prefills of ``single [1, T]`` (plain and ragged, alternated), then every batch size."""
    plain_model, model = models
    context = single.shape[1]
    plain_times, ragged_times = [], []
    for repeat in range(args.repeats):
        for mode in ("plain", "ragged") if repeat % 2 == 0 else ("ragged", "plain"):
            if mode == "plain":
                plain, token, seconds = plain_prefill(plain_model, single)
                plain_times.append(seconds)
            else:
                ragged_times.append(ragged_prefill_seconds(model, single))
    ragged = RaggedCache.for_model(model)
    with torch.no_grad():
        prefill_for_policies(model, ragged, single, [policy for policy, _ in policies.values()])
    base = {"plain": plain, "token": token, "ragged": ragged, "ragged_prefill_s": min(ragged_times)}
    results["prefill"][str(context)] = {
        "plain_s": min(plain_times),
        "ragged_s": min(ragged_times),
        "plain_s_all": plain_times,
        "ragged_s_all": ragged_times,
    }
    log(f"T={context}: batch-1 prefill plain {min(plain_times):.2f} s, ragged {min(ragged_times):.2f} s")
    for batch in args.batch_sizes:
        run_cell(models, single, batch, args, policies, base, results)
    prefill_row = results["prefill"][str(context)]
    prefill_row["all_in_overhead"] = {
        name: (prefill_row["ragged_s"] + cell["compression"][name]["seconds"]) / prefill_row["plain_s"] - 1.0
        for cell in results["cells"]
        if cell["context"] == context and cell["batch"] == 1
        for name in cell["compression"]
    }
    del base, ragged, plain
    free()


# -- report ---------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def megabytes(count) -> str:
    return "n/a" if count is None else f"{count / 2**20:.1f}"


def report(results: dict) -> str:
    names = results["configurations"]
    compressed = results["policies"]
    cells = results["cells"]
    parts = [
        f"Decode ms/token, ratio to plain (ms per step; median of {results['decode_tokens']} interleaved greedy steps, "
        f"{results['keep_ratio']:.0%} kept where compressed):",
        "",
        table(
            ["batch", "context", *names],
            [
                [str(c["batch"]), str(c["context"])]
                + [f"{c['decode_ratio'][name]:.2f} ({c['decode_ms'][name]:.1f})" for name in names]
                for c in cells
            ],
        ),
        "",
        "Compression (runtime.compression.prefill: scoring + eviction) as % of the ragged prefill of the same batch "
        "(seconds; ~ = prefill estimated as B x batch-1):",
        "",
        table(
            ["batch", "context", "ragged prefill s", *compressed],
            [
                [
                    str(c["batch"]),
                    str(c["context"]),
                    ("" if c["ragged_prefill_measured"] else "~") + f"{c['ragged_prefill_s']:.2f}",
                ]
                + [
                    f"{c['compression'][name]['percent_of_ragged_prefill']:.1f}% "
                    f"({c['compression'][name]['seconds']:.2f})"
                    for name in compressed
                ]
                for c in cells
            ],
        ),
        "",
        "Batch-1 prefill, seconds; all-in = (ragged prefill + compression) / plain prefill - 1:",
        "",
        table(
            ["context", "plain", "ragged", "ragged/plain", *(f"all-in {name}" for name in compressed)],
            [
                [context, f"{row['plain_s']:.2f}", f"{row['ragged_s']:.2f}", f"{row['ragged_s'] / row['plain_s']:.2f}"]
                + [
                    f"{100 * row['all_in_overhead'][name]:+.1f}%" if name in row["all_in_overhead"] else "n/a"
                    for name in compressed
                ]
                for context, row in results["prefill"].items()
            ],
        ),
        "",
        "KV bytes (MiB; x of the full DynamicCache; x of the budget formula; moment sums MiB):",
        "",
        table(
            ["batch", "context", "full (plain)", FULL, *compressed],
            [
                [str(c["batch"]), str(c["context"]), megabytes(c["kv_bytes"][PLAIN]["held"])]
                + [f"{megabytes(c['kv_bytes'][FULL]['held'])} (x{c['kv_bytes'][FULL]['vs_full']:.3f})"]
                + [
                    f"{megabytes(entry['held'])} (x{entry['vs_full']:.3f}; x{entry['vs_formula']:.3f} formula; "
                    f"moments {megabytes(entry['moments'])})"
                    for entry in (c["kv_bytes"][name] for name in compressed)
                ]
                for c in cells
            ],
        ),
    ]
    split_rows = []
    for c in cells:
        for name, split in c["step_split"].items():
            total = split["step_ms"]

            def share(ms, total=total):
                return "n/a" if ms is None else f"{ms:.1f} ({100 * ms / total:.0f}%)"

            split_rows.append(
                [str(c["batch"]), str(c["context"]), name, f"{total:.1f}"]
                + [share(split[label]) for label in LABELS]
                + [share(split["rest_ms"])]
            )
    if split_rows:
        parts += [
            "",
            f"Ragged decode step split (torch.profiler, {results['profile_steps']} steps; ms per step incl. "
            "profiler overhead; n/a = label not emitted by the runtime):",
            "",
            table(["batch", "context", "configuration", "step ms", *LABELS, "rest"], split_rows),
        ]
    parts += ["", "Bars:", ""] + [f"- {line}" for line in results["bars"]]
    if "artifact_load_ms" in results:
        parts += ["", f"artifact load (fingerprint known): {results['artifact_load_ms']:.1f} ms"]
    return "\n".join(parts)


def bars(results: dict) -> list[str]:
    """The bars of the module docstring, checked on the cells that were run."""
    compressed, cells = results["policies"], results["cells"]
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    lines = []
    worst = max((c["decode_ratio"][FULL], c["batch"], c["context"]) for c in cells)
    lines.append(
        f"{verdict(worst[0] <= 1.05)} nothing evicted <= 1.05x plain at every batch "
        f"(worst {worst[0]:.2f}x at B={worst[1]}, T={worst[2]})"
    )
    bar_cell = next((c for c in cells if c["batch"] == 8 and c["context"] == 4096), None)
    for name in compressed:
        worst = max((c["decode_ratio"][name], c["batch"], c["context"]) for c in cells)
        lines.append(
            f"{verdict(worst[0] <= 1.0)} {name} never above 1.0x plain (worst {worst[0]:.2f}x at B={worst[1]}, "
            f"T={worst[2]})"
        )
        if bar_cell is None:
            continue
        ratio = bar_cell["decode_ratio"][name]
        percent = bar_cell["compression"][name]["percent_of_ragged_prefill"]
        lines.append(f"{verdict(ratio <= 0.75)} {name} <= 0.75x plain at B=8, T=4096 ({ratio:.2f}x)")
        lines.append(f"{verdict(percent <= 5.0)} {name} compression <= 5% of prefill at B=8, T=4096 ({percent:.1f}%)")
    if bar_cell is None:
        lines.append("not measured (no B=8, T=4096 cell): 25% kept <= 0.75x plain, compression <= 5% of prefill")
    return lines


# -- main -----------------------------------------------------------------------------------------


def build_policies(args, model, tokenizer, results) -> dict:
    """``{name: (CompressionPolicy, calibration or None)}`` of the compressed configurations."""
    keep = args.keep_ratio
    if not args.artifact:
        return {
            "uniform/keydiff": (CompressionPolicy(keep_ratio=keep, scorer="keydiff"), None),
            "uniform/keydiff+correction1": (
                CompressionPolicy(keep_ratio=keep, scorer="keydiff", correction="order1"),
                None,
            ),
            "uniform/leverage": (CompressionPolicy(keep_ratio=keep), None),
        }
    load_calibration(model, tokenizer, path=args.artifact)  # computes the weights fingerprint once
    start = time.perf_counter()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    results["artifact_load_ms"] = 1000 * (time.perf_counter() - start)
    policies = {
        "uniform/keydiff": (CompressionPolicy(keep_ratio=keep, scorer="keydiff"), None),
        "inf/keydiff+correction": (parse_policy("inf/keydiff+correction").policy(1.0 - keep), calibration),
        f"{FLAGSHIP.name} {FLAGSHIP.allocation}/{FLAGSHIP.scorer}"
        + ("+correction" if FLAGSHIP.options.get("correction") == "calibrated" else ""): (
            FLAGSHIP.policy(1.0 - keep),
            calibration,
        ),
    }
    if calibration.budget_curve is not None:  # per-head budgets from the artifact's budget curves
        policies["curve/keydiff+correction"] = (
            parse_policy("curve/keydiff+correction").policy(1.0 - keep),
            calibration,
        )
    for policy, with_calibration in policies.values():
        if missing := policy.missing(with_calibration):  # before anything long runs
            raise ValueError(missing[0])
    return policies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="context tokens (default 1024 4096)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="timed greedy steps per cell (default 8)")
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="untimed decode steps before the timed ones (default 2)"
    )
    parser.add_argument(
        "--keep-ratio", type=float, default=0.25, help="kept fraction of the context (default 0.25: compression 0.75)"
    )
    parser.add_argument("--artifact", default=None, help="calibration artifact: INF budgets, calibrated correction")
    parser.add_argument(
        "--repeats", type=int, default=1, help="prefill / compression runs, the fastest kept (default 1)"
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=32768,
        help="measure the ragged prefill at batch B when B x context <= this, else B x batch-1 (default 32768)",
    )
    parser.add_argument(
        "--profile-steps", type=int, default=3, help="profiled decode steps for the per-step split (0: off; default 3)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="smoke run: contexts 1024, batch sizes 1 8, 4 tokens")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if (
        not 0 < args.keep_ratio < 1
        or min(args.contexts) < 64
        or min(args.batch_sizes) < 1
        or args.decode_tokens < 1
        or args.warmup_steps < 0
        or args.repeats < 1
        or args.profile_steps < 0
        or args.threads < 1
    ):
        parser.error(
            "need 0 < keep-ratio < 1, contexts >= 64, batch sizes >= 1, decode-tokens >= 1, warmup-steps >= 0, "
            "repeats >= 1, profile-steps >= 0, threads >= 1"
        )
    torch.set_num_threads(args.threads)
    use_progress_bars(no_progress=True)

    plain_model, model, tokenizer = load_model(), load_model(), load_tokenizer()
    results = {
        "model": model.config.name_or_path,
        "threads": args.threads,
        "keep_ratio": args.keep_ratio,
        "decode_tokens": args.decode_tokens,
        "warmup_steps": args.warmup_steps,
        "profile_steps": args.profile_steps,
        "repeats": args.repeats,
        "contexts": args.contexts,
        "batch_sizes": args.batch_sizes,
        "artifact": args.artifact,
        "prefill": {},
        "cells": [],
    }
    policies = build_policies(args, model, tokenizer, results)
    results["policies"] = {name: policy.describe() for name, (policy, _) in policies.items()}
    results["configurations"] = [PLAIN, FULL, *policies]
    longest = context_ids(tokenizer, max(args.contexts))

    enable(model)  # plain_model stays the unmodified sdpa model
    plain_prefill(plain_model, longest[:, :256])  # warm-up
    ragged_prefill_seconds(model, longest[:, :256])
    for context in args.contexts:
        run_context((plain_model, model), longest[:, :context], args, policies, results)
    results["bars"] = bars(results)
    print(report(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
