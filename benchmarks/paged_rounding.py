"""What a paged KV cache holds against the per-head budgets an artifact assigns (docs/design.md section 13).

    python benchmarks/paged_rounding.py --artifact PATH [--contexts 2048 8192 32768]
                                        [--ratios 0.5 0.75 0.9 0.95] [--page-sizes 1 16 32]
                                        [--policies inf/leverage curve/leverage] [--json OUT]

For each policy (its allocation decides the budgets; the scorer does not matter here), context
length ``n`` and compression ratio, the runtime's own per-KV-head budgets ``b[l, h]``
(``ServingPlan.head_budgets``, the embedded model's geometry) are rounded up to whole pages of ``P``
tokens in two layouts:

* **per-head pages** (block tables per KV head, as KV-Compress, arXiv 2410.00161, does): head
  ``(l, h)`` holds ``ceil(b[l, h] / P) * P`` tokens;
* **layer-wide pages** (vLLM's layout: a page holds ``P`` tokens of every KV head of a layer, so a
  layer holds as many tokens per head as its largest budget): layer ``l`` holds
  ``Hkv * ceil(max_h b[l, h] / P) * P``.

Printed: tokens held over the budgets' total (1.000 = no waste) and over the uncompressed cache
(``L * Hkv * n``: the memory actually saved).  Pure arithmetic on the artifact's numbers; the
embedded model is loaded only to bind the policies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def held_tokens(budgets: np.ndarray, page: int) -> tuple[int, int]:
    """Tokens held for int ``budgets [L, Hkv]`` in pages of ``page`` tokens: (per-head pages, layer-wide pages)."""
    per_head = int((np.ceil(budgets / page) * page).sum())
    widest = np.ceil(budgets.max(axis=1) / page) * page  # [L]
    layer_wide = int((widest * budgets.shape[1]).sum())
    return per_head, layer_wide


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="calibration artifact of the embedded model")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768], help="prompt tokens")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75, 0.9, 0.95], help="evicted fractions")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 32], help="tokens per page")
    parser.add_argument("--policies", nargs="+", default=["inf/leverage", "curve/leverage", "uniform/leverage"])
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if min(args.contexts) < 1 or min(args.page_sizes) < 1 or not all(0 < r < 1 for r in args.ratios):
        parser.error("need contexts >= 1, page sizes >= 1 and ratios in (0, 1)")

    from common.models import load_model, load_tokenizer, use_progress_bars
    from runtime import load_calibration, parse_policy
    from runtime.plan.serving_plan import bind

    use_progress_bars(no_progress=True)
    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    rows = []
    for name in args.policies:
        for context in args.contexts:
            for ratio in args.ratios:
                plan = bind(parse_policy(name).policy(ratio), calibration, model)
                budgets = plan.head_budgets(context)  # int64 [L, Hkv]
                row = {
                    "policy": name,
                    "context": context,
                    "ratio": ratio,
                    "budget_total": int(budgets.sum()),
                    "budget_min": int(budgets.min()),
                    "budget_max": int(budgets.max()),
                    "full": int(budgets.size * context),
                }
                for page in args.page_sizes:
                    row[f"per_head_{page}"], row[f"layer_wide_{page}"] = held_tokens(budgets, page)
                rows.append(row)
    header = " | ".join(f"per-head P={p} | layer-wide P={p}" for p in args.page_sizes)
    print("Tokens held / the budgets' total (held / the uncompressed cache):\n")
    print(f"| policy | context | evicted | budgets min-max | {header} |")
    print("|---|---|---|---|" + "---|---|" * len(args.page_sizes))
    for row in rows:
        cells = []
        for page in args.page_sizes:
            for layout in ("per_head", "layer_wide"):
                held = row[f"{layout}_{page}"]
                cells.append(f"{held / row['budget_total']:.3f} ({held / row['full']:.3f})")
        print(
            f"| {row['policy']} | {row['context']} | {row['ratio']:g} | {row['budget_min']}-{row['budget_max']} | "
            + " | ".join(cells)
            + " |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
