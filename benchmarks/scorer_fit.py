"""How well a learned scorer can imitate KVzip's reconstruction importance, per feature set.

    python benchmarks/scorer_fit.py [--windows 12] [--held-out 3] [--tokens 512] [--threads 1]

On the embedded model and the profiler's built-in calibration text: the teacher
(:func:`profiler.learned_scorer.record_window`) on every window, ridge fits per (layer, KV
head) on the first windows for both feature sets (``kv``: pre-RoPE key and value; ``hidden``:
the attention input), and on the held-out windows the R^2 and the rank correlation of
prediction and teacher, for each ridge strength.  Also KeyDiff's rank correlation with the
teacher on the same tokens, as the reference a scorer with no parameters reaches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.models import load_model, load_tokenizer  # noqa: E402
from profiler.calibration_text import calibration_windows  # noqa: E402
from profiler.learned_scorer import (
    RECONSTRUCTION_INSTRUCTION,
    RIDGE_GRID,
    RidgeSums,
    predict,  # noqa: E402
    r_squared,
    record_window,
    spearman,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--held-out", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None), load_tokenizer(None)
    windows = calibration_windows(tokenizer, None, args.windows, args.tokens, seed=0)
    instruction = torch.tensor(tokenizer(RECONSTRUCTION_INSTRUCTION, add_special_tokens=False)["input_ids"])
    config = model.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim, hidden = config.head_dim, config.hidden_size
    sums = {
        "kv": [RidgeSums(kv_heads, 2 * head_dim, 1) for _ in range(layers)],
        "hidden": [RidgeSums(1, hidden, kv_heads) for _ in range(layers)],
    }
    held_out = []
    started = time.perf_counter()
    for index in range(args.windows):
        records = record_window(model, windows[index], instruction, hidden=True)
        if index < args.windows - args.held_out:
            for layer, record in enumerate(records):
                sums["kv"][layer].add(record.kv, record.teacher.unsqueeze(-1))
                sums["hidden"][layer].add(record.hidden.unsqueeze(0), record.teacher.T.unsqueeze(0))
        else:
            held_out.append(records)
    print(f"{args.windows} windows x {args.tokens} tokens recorded in {time.perf_counter() - started:.0f} s")
    teacher = np.stack(
        [np.concatenate([w[layer].teacher.numpy() for w in held_out], axis=1) for layer in range(layers)]
    )  # [L, Hkv, n]
    features = {
        "kv": [np.concatenate([w[layer].kv.numpy() for w in held_out], axis=1) for layer in range(layers)],
        "hidden": [np.concatenate([w[layer].hidden.numpy() for w in held_out])[None] for layer in range(layers)],
    }
    keydiff = []
    for layer in range(layers):
        for head in range(kv_heads):
            rho = []
            for w in held_out:
                keys = w[layer].kv[head, :, :head_dim]  # pre-RoPE; KeyDiff is served on post-RoPE keys
                anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)
                scores = -torch.nn.functional.cosine_similarity(keys, anchor[None], dim=-1)
                rho.append(spearman(scores.numpy(), w[layer].teacher[head].numpy()))
            keydiff.append(np.mean(rho))
    print(f"KeyDiff (pre-RoPE keys) rank correlation with the teacher: mean {np.mean(keydiff):.3f}")
    for kind in ("kv", "hidden"):
        for ridge in RIDGE_GRID:
            r2, rho = np.zeros((layers, kv_heads)), np.zeros((layers, kv_heads))
            for layer in range(layers):
                prediction = predict(sums[kind][layer].solve(ridge), features[kind][layer])  # [G, n, M]
                prediction = prediction[:, :, 0] if kind == "kv" else prediction[0].T  # [Hkv, n]
                for head in range(kv_heads):
                    r2[layer, head] = r_squared(prediction[head], teacher[layer, head])
                    rho[layer, head] = spearman(prediction[head], teacher[layer, head])
            print(
                f"{kind:6s} ridge {ridge:g}: held-out R^2 mean {r2.mean():.3f} (min {r2.min():.3f}), "
                f"rank correlation mean {rho.mean():.3f} (min {rho.min():.3f})"
            )


if __name__ == "__main__":
    main()
