"""Artifacts that differ only in the number of future-query centres, from one collection of queries.

    python benchmarks/future_centres.py --artifact kv_calibration.h5 --centres 1 2 8 16 --out-prefix out/fq
        [--preset quick] [--max-new-tokens 24] [--queries queries.npz]

Collects the future queries of ``--preset``'s needle probes once, exactly as profile-model's
``future-queries`` stage does (:func:`profiler.future_queries.probe_future_queries`; the profile
preset's probes and their overrides), or loads them from ``--queries`` (written there after a
collection), then for each ``K`` writes ``<out-prefix>K.h5``: a copy of ``--artifact`` whose
``future_queries`` section has ``K`` k-means centres (:func:`profiler.future_queries.kmeans_centres`,
seed 0, 50 iterations, every collected query: the stage's default sample of 4096 is not reached on
the quick preset).  What ``benchmarks/runtime_quality.py`` then measures per artifact is how many
centres ``prototype_attention`` wants (the stage's ``--query-centres`` default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts import Artifact, Section, open_artifact, write_artifact  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from profiler.future_queries import kmeans_centres, probe_future_queries  # noqa: E402
from profiler.presets import PRESETS  # noqa: E402
from profiler.probe_source import preset_probes  # noqa: E402
from runtime.compression.prompt_statistics import QueryMoments  # noqa: E402
from runtime.math.geometry import ModelGeometry  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="the embedded model's artifact to copy")
    parser.add_argument("--centres", type=int, nargs="+", required=True, help="numbers of centres K")
    parser.add_argument("--out-prefix", required=True, help="writes <prefix>K.h5 per K")
    parser.add_argument("--preset", default="quick", help="profile preset whose probes are decoded (default quick)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's")
    parser.add_argument("--queries", default=None, help="npz of collected queries: loaded if it exists, else written")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    max_new_tokens = args.max_new_tokens or preset.max_new_tokens
    with open_artifact(args.artifact) as reader:
        identity, config = reader.model, dict(reader.config)
        sections = {name: reader.section(name) for name in reader.sections if name != "future_queries"}
    cached = Path(args.queries) if args.queries else None
    if cached is not None and cached.exists():
        saved = np.load(cached)
        queries, config_probes = saved["queries"], int(saved["probes"])
    else:
        model, tokenizer = load_model(), load_tokenizer()
        geometry = ModelGeometry.of(model)
        probes = preset_probes(preset.probes, tokenizer, identity.tokenizer_fingerprint, dict(preset.probe_overrides))
        parts = []
        for index in range(len(probes)):
            parts.append(probe_future_queries(model, tokenizer, geometry, probes[index], max_new_tokens))
            print(f"probe {index + 1}/{len(probes)}: {parts[-1].shape[0]} future queries", flush=True)
        queries, config_probes = np.concatenate(parts), len(probes)
        if cached is not None:
            np.savez(cached, queries=queries, probes=config_probes)
    layers, heads, dim = queries.shape[1:]
    moments = QueryMoments(layers, heads, dim)
    for layer in range(layers):
        moments.add(layer, queries[:, layer])
    stats = moments.finalize()
    per_head = queries.reshape(queries.shape[0], layers * heads, dim).transpose(1, 0, 2)
    spread = ((per_head - per_head.mean(1, keepdims=True)) ** 2).sum((1, 2))
    for k in args.centres:
        centres, weights = kmeans_centres(per_head, k, seed=0, iterations=50)
        nearest = ((per_head[:, :, None] - centres[:, None]) ** 2).sum(-1).min(-1).sum(-1)
        section = Section(
            {
                **stats,
                "centres": centres.reshape(layers, heads, k, dim).astype(np.float32),
                "centre_weights": weights.reshape(layers, heads, k),
            }
        )
        future_config = {
            "source": "benchmarks/future_centres.py",
            "preset": args.preset,
            "num_probes": config_probes,
            "max_new_tokens": max_new_tokens,
            "centres": k,
            "sample": int(queries.shape[0]),
        }
        out = Path(f"{args.out_prefix}{k}.h5")
        write_artifact(
            out,
            Artifact(
                model=identity,
                config={**config, "future_queries": future_config},
                sections={**sections, "future_queries": section},
            ),
        )
        print(f"K={k}: {out} (k-means leaves {np.mean(nearest / np.maximum(spread, 1e-30)):.0%} of the spread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
