"""The id of a needles probe (a task): how :mod:`needles.spec` names one and how the artifact's
validator recognises one in ``/recommendation/task_ids``, stated once.

    probe_id("retrieval", 1024, 50.0, 7, 0)   # 'retrieval-L1024-D50-S7-R0'
    PROBE_ID.fullmatch(text)                  # a well-formed id
"""

from __future__ import annotations

import re

# family, length in tokens, needle depth in percent (``:g``), seed, replicate
PROBE_ID = re.compile(r"[a-z0-9_]+-L[0-9]+-D[0-9.e+-]+-S-?[0-9]+-R[0-9]+")


def probe_id(family: str, length: int, depth: float, seed: int, replicate: int) -> str:
    """``{family}-L{length}-D{depth:g}-S{seed}-R{replicate}``."""
    return f"{family}-L{length}-D{depth:g}-S{seed}-R{replicate}"
