"""Where the behaviour stage's probes come from: a needles preset, or a JSON-lines file.

A probes file holds one :meth:`needles.probe.Probe.to_json` record per line (what
``generate-probes`` writes); probes are tokenized already, so the file must have been made
with the profiled model's tokenizer.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, is_dataclass
from pathlib import Path

from needles.probe import Probe


def read_probes(path: str | Path) -> list[Probe]:
    path = Path(path)
    probes = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    probes.append(Probe.from_json(line))
                except (ValueError, TypeError, KeyError) as exc:
                    raise ValueError(f"{path}:{number}: not a probe record ({exc})") from exc
    if not probes:
        raise ValueError(f"{path}: no probes in the file")
    return probes


def preset_probes(name: str, tokenizer) -> tuple[list[Probe], dict]:
    """Probes of the needles preset ``name`` for ``tokenizer`` and the spec that made them."""
    try:
        from needles import PRESETS, generate_probes
    except ImportError as exc:
        raise RuntimeError("needles' probe generator is not available; pass --probes FILE.jsonl") from exc
    if name not in PRESETS:
        raise ValueError(f"unknown needles probe preset {name!r}; known: {', '.join(PRESETS)}")
    spec = PRESETS[name]
    probes = list(generate_probes(spec, tokenizer))
    if not probes:
        raise ValueError(f"needles preset {name!r} produced no probes")
    return probes, _jsonable_spec(spec)


def _jsonable_spec(spec) -> dict:
    if is_dataclass(spec):
        record = asdict(spec)
    elif hasattr(spec, "to_dict"):
        record = spec.to_dict()
    else:
        record = {"repr": repr(spec)}
    return {key: (list(value) if isinstance(value, tuple) else value) for key, value in record.items()}


def probes_digest(probes: list[Probe]) -> str:
    """SHA-256 of the probes' JSON records: identifies the exact probe set."""
    sha = hashlib.sha256()
    for probe in probes:
        sha.update(probe.to_json().encode())
        sha.update(b"\n")
    return sha.hexdigest()
