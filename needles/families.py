"""Needle families: Jinja2 templates (``needles/templates/<family>.jinja``) plus slot samplers.

A family template defines three top-level variables with ``{% set %}...{% endset %}``:
``needle`` (the passage inserted in the haystack), ``question`` and ``answer``.  Inside the
needle, pieces carrying a behaviour label are marked ``[[R:...]]`` (retrieval-reasoning: the
answer), ``[[B:...]]`` (bias: question-related facts that are not the answer) or ``[[D:...]]``
(distraction: same-shaped statements with another answer); everything else is ``W``.  Markers do
not nest.  Whitespace runs in the rendered needle collapse to one space, so templates may be
laid out on several lines.

The slot values (entities, numbers, attributes) come from a per-family sampler drawing from
the pools in ``needles/data/``; a sampler is a pure function of a :class:`random.Random`, so a
seed fixes the needle.  :func:`render_needle` turns (family, seed) into a
:class:`RenderedNeedle` with character spans.

Families (REAL's Table 2 and appendix A.5, and HeadKV):

* ``retrieval`` - RULER magic number, one fact copied verbatim;
* ``multi_key`` - several magic numbers, the others are D;
* ``comparison`` - the cheaper/pricier device's operating system (prices are B);
* ``temporal`` - the room of the earlier/later meeting (start times are B);
* ``counting`` - how many items were bought (other numbers are B/D);
* ``located_attribute`` - the export of the city located on a continent (locations are B);
* ``reasoning`` - HeadKV-R2: the favourite thing of the younger/older person (ages are B).

Adding a family: write ``templates/<name>.jinja`` (setting ``needle``, ``question``,
``answer``; the answer must appear inside an R marker, which :func:`render_family` checks), a
sampler ``rng -> slots`` drawing from ``data/`` pools, and register a :class:`Family` in
:data:`FAMILIES`.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

import jinja2

MARKER = re.compile(r"\[\[([RBD]):(.*?)\]\]", re.DOTALL)


class TemplateError(ValueError):
    """A family template is malformed (bad markers, answer missing from its R spans...)."""


@dataclass(frozen=True)
class CharSpan:
    label: str  # "R" | "B" | "D"
    start: int  # first character (inclusive) in RenderedNeedle.text
    end: int  # last character + 1


@dataclass(frozen=True)
class RenderedNeedle:
    family: str
    text: str  # the needle passage, markers removed
    spans: tuple[CharSpan, ...]  # character spans into ``text``, in order
    question: str
    answer: str
    slots: dict = field(default_factory=dict)  # the sampled slot values (JSON-able)

    def span_text(self, span: CharSpan) -> str:
        return self.text[span.start : span.end]


# ---------------------------------------------------------------------------------------
# Data pools
# ---------------------------------------------------------------------------------------


@functools.cache
def data_lines(name: str) -> tuple[str, ...]:
    """Non-empty lines of ``needles/data/<name>`` (a slot pool)."""
    text = resources.files("needles").joinpath("data", name).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


@functools.cache
def data_json(name: str):
    return json.loads(resources.files("needles").joinpath("data", name).read_text(encoding="utf-8"))


def _distinct_numbers(rng: random.Random, count: int, low: int, high: int) -> list[int]:
    return rng.sample(range(low, high + 1), count)


def _clock(minutes: int) -> str:
    hour, minute = divmod(minutes, 60)
    suffix = "AM" if hour < 12 else "PM"
    return f"{(hour - 1) % 12 + 1}:{minute:02d} {suffix}"


# ---------------------------------------------------------------------------------------
# Slot samplers: rng -> dict of slot values
# ---------------------------------------------------------------------------------------


def _magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def sample_retrieval(rng: random.Random) -> dict:
    return {"key": rng.choice(data_lines("keys.txt")), "value": _magic_number(rng)}


def sample_multi_key(rng: random.Random) -> dict:
    count = rng.randint(3, 5)
    keys = rng.sample(data_lines("keys.txt"), count)
    values = [str(v) for v in _distinct_numbers(rng, count, 1_000_000, 9_999_999)]
    return {"keys": keys, "values": values, "target": rng.randrange(count)}


COMPARISON_INTROS = (
    "Reflecting the industry shift towards AI-integrated computing",
    "According to the latest store catalogue",
    "After a long season of price cuts",
    "As listed in the spring product brochure",
    "Following the annual technology fair",
    "In a recent consumer magazine review",
)
COMPARISON_ASIDES = (
    "targeting the essential productivity market",
    "built for students on a tight budget",
    "aimed at professional video editors",
    "designed for frequent travellers",
    "sold mostly to small offices",
    "marketed to families at home",
)


def sample_comparison(rng: random.Random) -> dict:
    colors = rng.sample(data_lines("colors.txt"), 3)
    devices = [rng.choice(data_lines("devices.txt")) for _ in range(3)]
    systems = rng.sample(data_lines("operating_systems.txt"), 3)
    prices = [p * 50 for p in _distinct_numbers(rng, 2, 4, 60)]  # $200 .. $3000, distinct
    entities = [{"name": f"{colors[i]} {devices[i]}", "os": systems[i]} for i in range(3)]
    entities[0]["price"], entities[1]["price"] = prices
    return {
        "a": entities[0],
        "b": entities[1],
        "c": entities[2],
        "ask": rng.choice(("cheaper", "more expensive")),
        "intro": rng.choice(COMPARISON_INTROS),
        "aside": rng.choice(COMPARISON_ASIDES),
        "distractor_first": rng.random() < 0.5,
    }


TEMPORAL_TOPICS = (
    "the third-quarter fiscal analysis",
    "the new onboarding checklist",
    "next year's hiring plan",
    "the supplier contracts",
    "the customer survey results",
    "the office move",
)
TEMPORAL_PURPOSES = (
    "fostering collaboration and trust among colleagues",
    "sharing progress across departments",
    "welcoming the newest employees",
    "planning the next product launch",
    "reviewing last month's incidents",
    "celebrating the team's milestones",
)


def sample_temporal(rng: random.Random) -> dict:
    names = rng.sample(data_lines("meetings.txt"), 3)
    rooms = rng.sample(data_lines("rooms.txt"), 3)
    # Start times on the quarter hour between 7:00 and 20:45, all distinct.
    minutes = [7 * 60 + 15 * q for q in _distinct_numbers(rng, 3, 0, 55)]
    events = [{"name": names[i], "room": rooms[i], "minutes": minutes[i], "time": _clock(minutes[i])} for i in range(3)]
    return {
        "a": events[0],
        "b": events[1],
        "c": events[2],
        "ask": rng.choice(("earlier", "later")),
        "topic": rng.choice(TEMPORAL_TOPICS),
        "purpose": rng.choice(TEMPORAL_PURPOSES),
    }


COUNTING_OCCASIONS = (
    "morning special",
    "village fair",
    "school picnic",
    "wedding lunch",
    "harvest dinner",
    "birthday party",
    "weekend market",
    "staff breakfast",
)


def sample_counting(rng: random.Random) -> dict:
    bought, grams, minutes, taken = _distinct_numbers(rng, 4, 3, 99)
    return {
        "actor": rng.choice(data_lines("actors.txt")),
        "item": rng.choice(data_lines("items.txt")),
        "bought": bought,
        "grams": grams,
        "minutes": minutes,
        "taken": taken,
        "occasion": rng.choice(COUNTING_OCCASIONS),
    }


def sample_located_attribute(rng: random.Random) -> dict:
    countries = [line.split("|") for line in data_lines("countries.txt")]
    first = rng.choice(countries)
    second = rng.choice([c for c in countries if c[1] != first[1]])
    cities = rng.sample(data_lines("cities.txt"), 3)
    exports = rng.sample(data_lines("exports.txt"), 3)

    def place(country, city, export):
        return {
            "country": country[0],
            "continent": country[1],
            "description": country[2],
            "city": city,
            "export": export,
        }

    return {
        "a": place(first, cities[0], exports[0]),
        "b": place(second, cities[1], exports[1]),
        "c": {"city": cities[2], "export": exports[2]},
    }


def sample_reasoning(rng: random.Random) -> dict:
    names = rng.sample(data_lines("names.txt"), 2)
    ages = _distinct_numbers(rng, 2, 8, 80)
    activities = rng.sample(data_lines("activities.txt"), 2)
    people = [{"name": names[i], "age": ages[i], "activity": activities[i]} for i in range(2)]
    return {
        "p": people[0],
        "q": people[1],
        "ask": rng.choice(("younger", "older")),
        "distractor_first": rng.random() < 0.5,
    }


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    sample_slots: Callable[[random.Random], dict]

    @property
    def template_name(self) -> str:
        return f"{self.name}.jinja"


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("retrieval", "one magic-number fact, the answer copied verbatim (RULER, HeadKV-R)", sample_retrieval),
        Family("multi_key", "several magic-number facts, the others are distractions", sample_multi_key),
        Family("comparison", "OS of the cheaper/pricier device (REAL laptop example)", sample_comparison),
        Family("temporal", "room of the earlier/later meeting (REAL meeting-room example)", sample_temporal),
        Family("counting", "how many items were bought (REAL eggs example)", sample_counting),
        Family(
            "located_attribute",
            "export of the city on a continent (REAL city-export example)",
            sample_located_attribute,
        ),
        Family("reasoning", "favourite thing of the younger/older person (HeadKV-R2)", sample_reasoning),
    )
}


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------


@functools.cache
def template_environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("needles", "templates"),
        autoescape=False,
        undefined=jinja2.StrictUndefined,  # a missing slot is an error, not an empty string
        keep_trailing_newline=False,
    )


def parse_markers(marked: str) -> tuple[str, tuple[CharSpan, ...]]:
    """Remove ``[[L:...]]`` markers from ``marked``; return the clean text and the spans.

    Span boundaries exclude surrounding whitespace; a marker with no visible text, a nested
    marker or a stray ``[[``/``]]`` raises :class:`TemplateError`.
    """
    pieces: list[str] = []
    spans: list[CharSpan] = []
    cursor = 0
    length = 0
    for match in MARKER.finditer(marked):
        before = marked[cursor : match.start()]
        pieces.append(before)
        length += len(before)
        label, content = match.group(1), match.group(2)
        if "[[" in content or "]]" in content:
            raise TemplateError(f"nested marker in {match.group(0)!r}")
        stripped = content.strip()
        if not stripped:
            raise TemplateError(f"empty {label} marker in {marked!r}")
        start = length + (len(content) - len(content.lstrip()))
        spans.append(CharSpan(label, start, start + len(stripped)))
        pieces.append(content)
        length += len(content)
        cursor = match.end()
    pieces.append(marked[cursor:])
    text = "".join(pieces)
    if "[[" in text or "]]" in text:
        raise TemplateError(f"unbalanced marker in {marked!r}")
    return text, tuple(spans)


def _collapse_whitespace(text: str) -> str:
    return " ".join(text.split())


def render_family(family: str, slots: dict) -> RenderedNeedle:
    """Render ``family``'s template with the given slot values."""
    if family not in FAMILIES:
        raise ValueError(f"unknown needle family {family!r}; known: {', '.join(FAMILIES)}")
    template = template_environment().get_template(FAMILIES[family].template_name)
    module = template.make_module(slots)
    try:
        marked, question, answer = (str(getattr(module, name)) for name in ("needle", "question", "answer"))
    except AttributeError as exc:
        raise TemplateError(f"template {family}.jinja must set needle, question and answer") from exc
    text, spans = parse_markers(_collapse_whitespace(marked))
    question, answer = _collapse_whitespace(question), _collapse_whitespace(answer)
    if not question or not answer:
        raise TemplateError(f"template {family}.jinja rendered an empty question or answer")
    needle = RenderedNeedle(family, text, spans, question, answer, slots)
    if not any(s.label == "R" and answer in needle.span_text(s) for s in spans):
        raise TemplateError(f"{family}: answer {answer!r} is not inside any R span of {text!r}")
    return needle


def render_needle(family: str, seed: int) -> RenderedNeedle:
    """Sample ``family``'s slots with ``random.Random(seed)`` and render its template."""
    if family not in FAMILIES:
        raise ValueError(f"unknown needle family {family!r}; known: {', '.join(FAMILIES)}")
    return render_family(family, FAMILIES[family].sample_slots(random.Random(seed)))
