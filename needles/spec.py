"""Probe grids: :class:`ProbeSpec`, the named :data:`PRESETS`, and :func:`generate_probes`.

A spec is the cross product families x lengths x depths x ``count`` replicates.  Every probe
gets its own seed, derived from the spec seed and its grid cell with SHA-256 (never Python's
``hash()``), which fixes both its needle and its haystack; so the same spec and seed give
byte-identical probes on any machine (for the same tokenizer).

Presets:

* ``smoke`` - every family at 512 tokens, depths 25/75 (14 probes; for tests);
* ``quick`` - every family at 1K/2K/4K tokens, depths 10/50/90 (63 probes; CPU-sized);
* ``standard`` - every family at 1K..8K tokens in 1K steps, depths 5..95 in steps of 10 (560);
* ``paper`` - REAL's grid (its section 2.1): 30 lengths 1K..30K in steps of 1,024 and 33
  depths 2%..98% in steps of 3%, for every family (6,930 probes; needs a long-context model).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.atomic import atomic_path
from common.probe_ids import probe_id
from needles.families import FAMILIES, render_needle
from needles.haystacks import Haystack, make_haystack
from needles.placement import place_needle
from needles.probe import Probe


@dataclass(frozen=True)
class ProbeSpec:
    """A grid of probes (see the module docstring)."""

    families: tuple[str, ...] = tuple(FAMILIES)
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # whole prompt, in tokens of the target tokenizer
    depths: tuple[float, ...] = (10.0, 50.0, 90.0)  # percent of the context before the needle
    count: int = 1  # probes per (family, length, depth) cell, each with its own needle
    haystack: str = "simple"  # simple | prose | files:PATH | dataset:NAME_OR_PATH
    text_column: str = "text"  # for dataset haystacks
    split: str = "train"  # for dataset haystacks
    seed: int = 0
    tolerance: float = 0.02  # allowed relative deviation of the prompt length

    def __post_init__(self):
        object.__setattr__(self, "families", tuple(self.families))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        object.__setattr__(self, "depths", tuple(float(d) for d in self.depths))
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown needle families {unknown}; known: {', '.join(FAMILIES)}")
        if not self.families or not self.lengths or not self.depths:
            raise ValueError("a probe spec needs at least one family, length and depth")
        if any(n < 64 for n in self.lengths):
            raise ValueError(f"lengths must be at least 64 tokens, got {self.lengths}")
        if any(not 0.0 <= d <= 100.0 for d in self.depths):
            raise ValueError(f"depths are percentages in [0, 100], got {self.depths}")
        if self.count < 1:
            raise ValueError(f"count must be at least 1, got {self.count}")
        if not 0.0 < self.tolerance < 0.5:
            raise ValueError(f"tolerance must be in (0, 0.5), got {self.tolerance}")

    @property
    def size(self) -> int:
        return len(self.families) * len(self.lengths) * len(self.depths) * self.count

    def replace(self, **changes) -> ProbeSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(self).items()
        }

    def cells(self) -> Iterator[tuple[str, int, float, int]]:
        """(family, length, depth, replicate) in generation order."""
        for family in self.families:
            for length in self.lengths:
                for depth in self.depths:
                    for replicate in range(self.count):
                        yield family, length, depth, replicate


PRESETS: dict[str, ProbeSpec] = {
    "smoke": ProbeSpec(lengths=(512,), depths=(25.0, 75.0)),
    "quick": ProbeSpec(lengths=(1024, 2048, 4096), depths=(10.0, 50.0, 90.0)),
    "standard": ProbeSpec(lengths=tuple(range(1024, 8193, 1024)), depths=tuple(float(d) for d in range(5, 96, 10))),
    "paper": ProbeSpec(lengths=tuple(1024 * k for k in range(1, 31)), depths=tuple(float(d) for d in range(2, 99, 3))),
}


def cell_seed(seed: int, family: str, length: int, depth: float, replicate: int, purpose: str) -> int:
    """A 63-bit seed for one grid cell and purpose ("needle" or "haystack"), platform-independent."""
    key = f"{seed}|{family}|{length}|{depth!r}|{replicate}|{purpose}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1


def _check_tokenizer(tokenizer) -> None:
    """needles works on a tokenizer object and never loads one: callers pass it in."""
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        raise TypeError(
            f"needles needs a tokenizer object, not {tokenizer!r}: load it first, e.g. "
            "transformers.AutoTokenizer.from_pretrained(path) (generate-probes --model does that)"
        )


def make_probe(
    tokenizer,
    family: str,
    length: int,
    depth: float,
    *,
    seed: int = 0,
    replicate: int = 0,
    haystack: str | Haystack = "simple",
    tolerance: float = 0.02,
) -> Probe:
    """One probe of ``family`` at ``length`` tokens and ``depth`` percent (see :class:`ProbeSpec`)."""
    _check_tokenizer(tokenizer)
    source = make_haystack(haystack)
    needle_seed = cell_seed(seed, family, length, depth, replicate, "needle")
    haystack_seed = cell_seed(seed, family, length, depth, replicate, "haystack")
    needle = render_needle(family, needle_seed)
    placed = place_needle(tokenizer, needle, source.sentences(haystack_seed), length, depth, tolerance=tolerance)
    return Probe(
        id=probe_id(family, length, depth, seed, replicate),
        family=family,
        length=length,
        depth=depth,
        seed=seed,
        question=needle.question,
        answer=needle.answer,
        input_ids=placed.input_ids,
        spans=placed.spans,
        context_end=placed.context_end,
        meta={
            "haystack": source.name,
            "replicate": replicate,
            "needle_seed": needle_seed,
            "haystack_seed": haystack_seed,
            "needle_start": placed.needle_start,
            "needle_end": placed.needle_end,
            "context_start": placed.context_start_token,
            "depth_actual": placed.depth_actual,
            "slots": needle.slots,
        },
    )


def generate_probes(spec: ProbeSpec | str, tokenizer, *, progress: bool = False) -> Iterator[Probe]:
    """Probes of ``spec`` (a :class:`ProbeSpec` or a preset name), one at a time, in grid order.

    ``tokenizer``: the target model's tokenizer (a transformers tokenizer object; needles never
    loads one).  This is a generator (the ``paper`` grid holds tens of millions of token ids);
    ``list()`` it for small specs.  ``progress`` shows a tqdm bar on stderr.
    """
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown probe preset {spec!r}; known: {', '.join(PRESETS)}")
        spec = PRESETS[spec]
    _check_tokenizer(tokenizer)
    source = make_haystack(spec.haystack, text_column=spec.text_column, split=spec.split)
    cells: Iterable = spec.cells()
    if progress:
        from tqdm import tqdm

        cells = tqdm(cells, total=spec.size, desc="probes", unit="probe")
    for family, length, depth, replicate in cells:
        yield make_probe(
            tokenizer,
            family,
            length,
            depth,
            seed=spec.seed,
            replicate=replicate,
            haystack=source,
            tolerance=spec.tolerance,
        )


def write_probes(probes: Iterable[Probe], path: str | Path) -> int:
    """Write one :meth:`Probe.to_json` line per probe; returns how many were written.

    The file appears complete or not at all (written beside it, then renamed into place).
    """
    written = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for probe in probes:
            fh.write(probe.to_json())
            fh.write("\n")
            written += 1
    return written


def load_probes(path: str | Path) -> list[Probe]:
    """Read a JSON-lines probe file (as written by ``generate-probes`` / :func:`write_probes`)."""
    path = Path(path)
    probes = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                probes.append(Probe.from_json(line))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a probe record ({exc})") from exc
    return probes
