"""Terminal rendering of probes with their R/B/D spans highlighted (ANSI colours).

R (retrieval-reasoning) is bold green, B (bias) yellow, D (distraction) red; W text is plain.
Colour is used only on a terminal and without ``NO_COLOR`` (https://no-color.org): see
:func:`use_colour`.
Only the needle with a little haystack around it and the question part are shown; the elided
haystack is summarised as ``[... N tokens ...]``.
"""

from __future__ import annotations

import os

from needles.probe import LABELS, Probe

COLOURS = {"R": "\033[1;32m", "B": "\033[33m", "D": "\033[31m"}
RESET = "\033[0m"
DIM = "\033[2m"


def use_colour(stream, no_colour: bool = False) -> bool:
    """Whether text written to ``stream`` gets colour codes: not when asked for none, not into a file
    or a pipe, and not when the ``NO_COLOR`` environment variable is set to anything but empty."""
    isatty = getattr(stream, "isatty", None)
    return not no_colour and not os.environ.get("NO_COLOR") and callable(isatty) and bool(isatty())


def _segments(probe: Probe, start: int, end: int):
    """Runs of equal label in ``[start, end)``: (label, first token, last token + 1)."""
    labels = probe.labels()
    run_start = start
    for index in range(start + 1, end + 1):
        if index == end or labels[index] != labels[run_start]:
            yield LABELS[labels[run_start]], run_start, index
            run_start = index


def render_probe(probe: Probe, tokenizer, *, margin: int = 24, colour: bool = True) -> str:
    """A human-readable view of ``probe`` (header, needle neighbourhood, question part)."""
    ids = probe.input_ids
    first = min((s.start for s in probe.spans), default=0)
    last = max((s.end for s in probe.spans), default=0)
    first = max(0, probe.meta.get("needle_start", first) - margin)
    last = min(probe.context_end, probe.meta.get("needle_end", last) + margin)

    def paint(label: str, text: str) -> str:
        if not colour or label == "W":
            return text
        return f"{COLOURS[label]}{text}{RESET}"

    def elided(count: int) -> str:
        text = f"[... {count} tokens ...]"
        return f"{DIM}{text}{RESET}" if colour else text

    header = (
        f"{probe.id}  family={probe.family} length={probe.length} ({len(ids)} tokens) "
        f"depth={probe.depth:g}% seed={probe.seed}\n"
        f"question: {probe.question}\nanswer:   {probe.answer}\n"
        f"spans:    " + ", ".join(f"{s.label}[{s.start}:{s.end}]" for s in probe.spans)
    )
    legend = " ".join(paint(label, label) for label in ("R", "B", "D")) + " W"
    body = []
    if first > 0:
        body.append(elided(first))
    for label, start, end in _segments(probe, first, last):
        body.append(paint(label, tokenizer.decode(ids[start:end])))
    if last < probe.context_end:
        body.append(elided(probe.context_end - last))
    body.append(tokenizer.decode(ids[probe.context_end :]))
    return f"{header}\nlegend:   {legend}\n" + "".join(body)
