"""The JSON-lines journal the long paired benchmarks resume from: a settings line, then one record per
finished cell (``kvpress_side_by_side.py``, ``ruler_table.py``, ``blockwise_quality.py``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def read_journal(path: Path, settings: dict | None, key: Callable[[dict], tuple], program: str) -> dict:
    """``key(record) -> record`` of an earlier run.  With ``settings`` (a run): a missing journal is
    started with them, one written with other settings is refused (``program``'s error, exit 2's
    kind: ``sys.exit`` with the message).  Without (a report): whatever the journal holds.  A line
    cut by a kill is passed over (that cell runs again)."""
    if not path.exists():
        if settings is None:
            sys.exit(f"{program}: error: no journal {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return {}
    lines = path.read_text().splitlines()
    if settings is not None and (not lines or json.loads(lines[0]).get("settings") != settings):
        sys.exit(f"{program}: error: {path} was written with other settings; use another --out")
    done = {}
    for line in lines[1:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[key(record)] = record
    return done
