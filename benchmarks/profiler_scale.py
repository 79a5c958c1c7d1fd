"""What ``profile-model`` costs per stage at the layer geometry users calibrate, by context length.

    python benchmarks/profiler_scale.py [--geometry 8b|70b] [--layers 2] [--mlp-width 2048]
        [--contexts 4096 8192 16384 32768] [--stages forward behaviour ...] [--dtype bfloat16]
        [--new-tokens 4] [--threads 1] [--timeout 900] [--out profiler_scale.jsonl]

A random-weight Llama with the attention geometry of Llama-3.1-8B (hidden 4096, 32 query / 8 KV heads,
d = 128) or of a 70B-class model (hidden 8192, 64 / 8, d = 128), ``--layers`` layers, the MLP width
reduced to ``--mlp-width`` (8B: 14336, 70B: 28672; the MLP's weights and its ``[T, width]``
activations scale with it: docs/design.md "The profiler at user scale" adds the difference back), the
embedded tokenizer's vocabulary (49152, tied embeddings), is saved with the embedded tokenizer to a
temporary directory and loaded the way ``profile-model`` loads a checkpoint
(``common.models.load_model``, ``--dtype``).  Then, for every (context, stage), a fresh child process
runs one unit of the stage's work through the same functions the stage calls:

* ``forward``: the ``query-stats`` unit: one ``[1, T]`` calibration window through ``model.model``
  with the pre-RoPE query hooks (``runtime.compression.prompt_statistics.QueryMoments.collect``);
* ``behaviour``: one ``T``-token probe greedy-decoded for ``--new-tokens`` with the decode-attention
  capture (``profiler.behaviour.run_probe``);
* ``future-queries``: the same probe, its question's and answer's queries recorded
  (``profiler.future_queries.probe_future_queries``);
* ``learned-scorer``: one ``T``-token window's KVzip reconstruction pass ``[c; instruction; c]``
  (``2T + 9`` tokens) and teacher (``profiler.learned_scorer.record_window``);
* ``moments``: one ``T``-token window under the default selections, leverage and keydiff
  (``profiler.moments.measure_correction_errors_by_selection``);
* ``budget-curves``: one window and one probe (``profiler.budget_curves.measure_curves``, KeyDiff).

The probe is ``T`` random token ids (random weights read no text) with an R span in its middle and a
32-token question; the window is ``T`` random ids.  Recorded per child, one JSON line each in
``--out`` as it finishes (a killed run keeps what it measured): the stage's wall seconds (loading
excluded), the resident memory before the stage and its peak during the stage (``VmHWM``, reset
through ``/proc/self/clear_refs`` once the model is loaded), the weights' bytes, and the extra
memory ``peak - before``.  A child past ``--timeout`` seconds is killed and recorded as such.  The
numbers and the extrapolation to a whole model on one GPU: docs/design.md, docs/results.md
R-profiler-scale-2026-11-27.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GEOMETRIES = {  # hidden, query heads, KV heads, head dim, the real MLP width (gpt-oss: each expert's)
    "8b": (4096, 32, 8, 128, 14336),
    "70b": (8192, 64, 8, 128, 28672),
    # gpt-oss-20b (its config.json): 32 experts, 4 per token, sliding layers of 128 tokens alternating with
    # full ones, YaRN over 4096 x 32 positions, learned attention sinks
    "gpt-oss-20b": (2880, 64, 8, 64, 2880),
}
# gpt-oss's sinks as built here: uniform in [SINKS_LOW, SINKS_HIGH) per head (transformers initialises them
# near 0, where they would hardly move an output: the sinks path would go unmeasured)
SINKS_LOW, SINKS_HIGH = 2.0, 7.0
STAGES = ("forward", "behaviour", "future-queries", "learned-scorer", "moments", "budget-curves")
QUESTION_TOKENS = 32


def build_model_dir(
    directory: Path, geometry: str, layers: int, mlp_width: int, dtype: str, tokenizer=None, device=None
) -> None:
    """A random-weight Llama of ``geometry`` (gpt-oss for ``gpt-oss-20b``, its sinks drawn in ``[SINKS_LOW,
    SINKS_HIGH)``) saved with ``tokenizer`` (default: the embedded one) in ``directory``, its weights drawn
    on ``device`` (default: the CPU; a GPU draws 8B-wide layers in seconds rather than minutes)."""
    import torch
    import transformers

    from common.models import load_tokenizer

    hidden, heads, kv_heads, head_dim, _ = GEOMETRIES[geometry]
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=mlp_width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    if geometry.startswith("gpt-oss"):
        config = transformers.GptOssConfig(**common, num_local_experts=32, num_experts_per_tok=4, sliding_window=128)
        model_class = transformers.GptOssForCausalLM
    else:
        config = transformers.LlamaConfig(**common, rope_theta=500000.0)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in the saved dtype: no float32 copy of 70B-wide layers
    try:
        with torch.device(device or "cpu"):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(previous)
    for layer in model.model.layers:
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:
            with torch.no_grad():
                sinks.uniform_(SINKS_LOW, SINKS_HIGH)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset this process's peak resident memory (VmHWM) to the current one; False where Linux refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _probe(length: int, seed: int = 0):
    """A ``length``-token probe of random ids: an R span at 40-41%, a B and a D span, a 32-token question."""
    import random

    from needles.probe import Probe, Span

    rng = random.Random(seed)
    ids = [rng.randrange(100, 40000) for _ in range(length)]
    context_end = length - QUESTION_TOKENS
    r0, b0, d0 = int(0.40 * context_end), int(0.20 * context_end), int(0.60 * context_end)
    spans = [Span("R", r0, r0 + 8), Span("B", b0, b0 + 8), Span("D", d0, d0 + 8)]
    return Probe(f"scale-{length}", "hand", length, 40.0, seed, "q?", "zebra", ids, spans, context_end=context_end)


def _window(length: int, seed: int = 1):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (1, length), generator=generator)  # [1, T]


def run_stage(stage: str, model, tokenizer, context: int, new_tokens: int):
    """One unit of ``stage``'s work at ``context`` tokens (see the module docstring)."""
    import torch

    from runtime.math.geometry import ModelGeometry

    geometry = ModelGeometry.of(model)
    if stage == "forward":
        from runtime.compression.prompt_statistics import QueryMoments

        sums = QueryMoments(geometry.num_layers, geometry.num_q_heads, geometry.head_dim)
        with torch.no_grad(), sums.collect(geometry, n_sink=4):
            model.model(input_ids=_window(context), use_cache=False)
    elif stage == "behaviour":
        from profiler.behaviour import run_probe

        run_probe(model, tokenizer, geometry, _probe(context), new_tokens)
    elif stage == "future-queries":
        from profiler.future_queries import probe_future_queries

        probe_future_queries(model, tokenizer, geometry, _probe(context), new_tokens)
    elif stage == "learned-scorer":
        from profiler.learned_scorer import RECONSTRUCTION_INSTRUCTION, record_window

        ids = tokenizer(RECONSTRUCTION_INSTRUCTION, add_special_tokens=False)["input_ids"]
        record_window(model, _window(context)[0], torch.tensor(ids, dtype=torch.long))
    elif stage == "moments":
        from profiler.moments import measure_correction_errors_by_selection

        measure_correction_errors_by_selection(
            model,
            _window(context),
            [("leverage", "uniform"), ("keydiff", "uniform")],
            keep_ratios=(0.25, 0.5),
            query_window=32,
            observation_window=32,
            n_sink=4,
            recent_window=8,
            progress=False,
        )
    elif stage == "budget-curves":
        from profiler.budget_curves import measure_curves

        measure_curves(model, _window(context), [_probe(context)], progress=False)
    else:
        raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")


def child(args) -> None:
    """Load the model, run one stage at one context, print one JSON record."""
    import torch

    torch.set_num_threads(args.threads)
    from common.models import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model_dir)
    model = load_model(args.model_dir, dtype=args.dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():  # page every weight in: a memory-mapped checkpoint is read on first use
        for parameter in model.parameters():
            parameter.float().sum()
    _probe(4 * QUESTION_TOKENS)  # imports outside the measurement
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    started = time.perf_counter()
    run_stage(args.stage, model, tokenizer, args.context, args.new_tokens)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    record = {
        "stage": args.stage,
        "context": args.context,
        "seconds": round(seconds, 2),
        "rss_before_gib": round(before / 2**20, 3),
        "peak_gib": round(peak / 2**20, 3),
        "extra_gib": round((peak - before) / 2**20, 3),
        "weights_gib": round(weights / 2**30, 3),
        "peak_reset": reset,
    }
    print("RESULT " + json.dumps(record), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mlp-width", type=int, default=2048)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child before it is killed")
    parser.add_argument("--out", type=Path, default=Path("profiler_scale.jsonl"))
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        child(args)
        return

    hidden, heads, kv_heads, head_dim, real_mlp = GEOMETRIES[args.geometry]
    setup = {
        "geometry": args.geometry,
        "hidden": hidden,
        "q_heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "layers": args.layers,
        "mlp_width": args.mlp_width,
        "real_mlp_width": real_mlp,
        "dtype": args.dtype,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    with tempfile.TemporaryDirectory(prefix="kvcal-scale-") as directory:
        started = time.perf_counter()
        build_model_dir(Path(directory), args.geometry, args.layers, args.mlp_width, args.dtype)
        print(f"model saved in {time.perf_counter() - started:.0f} s: {setup}", flush=True)
        for context in args.contexts:
            for stage in args.stages:
                command = [
                    sys.executable,
                    __file__,
                    "--model-dir",
                    directory,
                    "--stage",
                    stage,
                    "--context",
                    str(context),
                    "--dtype",
                    args.dtype,
                    "--threads",
                    str(args.threads),
                    "--new-tokens",
                    str(args.new_tokens),
                ]
                environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
                try:
                    done = subprocess.run(
                        command, capture_output=True, text=True, timeout=args.timeout, env=environment
                    )
                    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                    if done.returncode == 0 and lines:
                        record = json.loads(lines[-1][len("RESULT ") :])
                    else:
                        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
                        record = {"stage": stage, "context": context, "failed": tail[0][:300]}
                except subprocess.TimeoutExpired:
                    record = {"stage": stage, "context": context, "timed_out_s": args.timeout}
                record = {**setup, **record}
                print(json.dumps(record), flush=True)
                with args.out.open("a") as fh:
                    fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
