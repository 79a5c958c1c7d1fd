"""Where the behaviour stage's probes come from: a needles preset, or a JSON-lines file.

:class:`ProbeSet` is an indexable collection that builds needles probes lazily, one grid cell
at a time (``needles.make_probe``, exactly what ``needles.generate_probes`` yields for that
cell): REAL's ``paper`` grid holds ~7,000 probes of up to 30K tokens, far too many token ids to
keep in every process.  The per-probe table of the artifact (length, depth, family, seed)
comes from the grid cells without tokenizing anything.

A probes file holds one :meth:`needles.probe.Probe.to_json` record per line (what
``generate-probes`` writes); its probes are tokenized already, so the file must have been made
with the profiled model's tokenizer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from needles import PRESETS, load_probes, make_haystack, make_probe
from needles.probe import Probe


class ProbeSet:
    """``len(probes)``, ``probes[i]`` (a :class:`Probe`), the table arrays, a digest, a config."""

    def __init__(self, table: dict[str, np.ndarray], build, digest: str, config: dict, longest: int | None = None):
        self.table = (
            table  # probe_length int64 [P], probe_depth float64 [P], probe_family S64 [P], probe_seed int64 [P]
        )
        self._build = build
        self.digest = digest  # identifies the exact probe set (for the resume fingerprint)
        self.config = config  # JSON-able description for the artifact
        self._longest = longest

    def __len__(self) -> int:
        return len(self.table["probe_length"])

    def __getitem__(self, index: int) -> Probe:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._build(index)

    def max_tokens(self) -> int:
        """Longest prompt: exact for materialised probes, else the asked lengths (needles
        prompts land within them)."""
        if self._longest is not None:
            return self._longest
        return int(self.table["probe_length"].max()) if len(self) else 0


def _table(lengths, depths, families, seeds) -> dict[str, np.ndarray]:
    return {
        "probe_length": np.asarray(lengths, dtype=np.int64),
        "probe_depth": np.asarray(depths, dtype=np.float64),
        "probe_family": np.array([f.encode("ascii", "replace")[:64] for f in families], dtype="S64"),
        "probe_seed": np.asarray(seeds, dtype=np.int64),
    }


def probes_from_list(probes: list[Probe], config: dict) -> ProbeSet:
    if not probes:
        raise ValueError("no probes")
    table = _table(
        [p.length for p in probes], [p.depth for p in probes], [p.family for p in probes], [p.seed for p in probes]
    )
    return ProbeSet(
        table, probes.__getitem__, probes_digest(probes), config, longest=max(len(p.input_ids) for p in probes)
    )


def file_probes(path: str | Path) -> ProbeSet:
    probes = load_probes(path)
    if not probes:
        raise ValueError(f"{path}: no probes in the file")
    return probes_from_list(probes, {"source": "file", "path": str(path)})


def preset_probes(name: str, tokenizer, tokenizer_fingerprint: str = "", overrides: dict | None = None) -> ProbeSet:
    """The needles preset ``name`` (with ``ProbeSpec`` fields replaced by ``overrides``) for
    ``tokenizer``, built lazily."""
    if name not in PRESETS:
        raise ValueError(f"unknown needles probe preset {name!r}; known: {', '.join(PRESETS)}")
    spec = PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
    cells = list(spec.cells())  # (family, length, depth, replicate) in generation order
    if not cells:
        raise ValueError(f"needles preset {name!r} has no probes")
    haystack = make_haystack(spec.haystack, text_column=spec.text_column, split=spec.split)

    def build(index: int) -> Probe:
        family, length, depth, replicate = cells[index]
        return make_probe(
            tokenizer,
            family,
            length,
            depth,
            seed=spec.seed,
            replicate=replicate,
            haystack=haystack,
            tolerance=spec.tolerance,
        )

    table = _table([c[1] for c in cells], [c[2] for c in cells], [c[0] for c in cells], [spec.seed] * len(cells))
    config = {"source": "needles", "preset": name, "overrides": sorted(overrides or {}), "spec": spec.to_dict()}
    digest = hashlib.sha256(f"needles|{sorted(config['spec'].items())}|{tokenizer_fingerprint}".encode()).hexdigest()
    return ProbeSet(table, build, digest, config)


def probes_digest(probes: list[Probe]) -> str:
    """SHA-256 of the probes' JSON records: identifies the exact probe set."""
    sha = hashlib.sha256()
    for probe in probes:
        sha.update(probe.to_json().encode())
        sha.update(b"\n")
    return sha.hexdigest()
