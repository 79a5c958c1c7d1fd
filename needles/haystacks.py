"""Haystacks: the filler text a needle is hidden in, as a stream of sentences.

A haystack yields sentence *units* for a seed (:meth:`Haystack.sentences`), deterministically.
The probe builder takes as many as the asked length needs and inserts the needle between two
units, i.e. at a sentence boundary.  Units are joined with one space, or with nothing after a
unit that ends in a newline (a paragraph break).

Sources (:func:`make_haystack` parses the names):

* ``simple`` - :class:`SimpleHaystack`, procedural short sentences ("The lamp is quiet.").  The
  embedded 135M model retrieves reliably only from such text (docs/design.md section 7).
* ``prose`` - :class:`ProseHaystack`, varied paragraph-like text from our own grammar
  (``needles/data/prose_grammar.json``), for larger models and calibration text.
* ``files:PATH`` - :class:`TextFilesHaystack`, a local text file or a directory of them.
* ``dataset:NAME_OR_PATH`` - :class:`DatasetHaystack`, a HuggingFace ``datasets`` text dataset:
  a hub name (needs the hub cache when offline), a directory saved with ``save_to_disk``, or a
  local ``.json``/``.jsonl``/``.csv``/``.parquet``/``.txt`` file; ``text_column`` names the column.

File and dataset text starts at a seed-dependent sentence and wraps around at the end.
"""

from __future__ import annotations

import itertools
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from needles.families import data_json, data_lines

SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z0-9])")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


class HaystackError(ValueError):
    """A haystack source is missing, empty or malformed."""


class Haystack(ABC):
    """A deterministic stream of sentence units."""

    name: str  # how a ProbeSpec names this source (recorded in probe metadata)

    @abstractmethod
    def sentences(self, seed: int) -> Iterator[str]:
        """An endless iterator of sentence units, the same for the same seed."""


def join_units(units: list[str]) -> str:
    """Join sentence units: a space between them, nothing after a paragraph break."""
    parts: list[str] = []
    for unit in units:
        if parts and not parts[-1].endswith("\n"):
            parts.append(" ")
        parts.append(unit)
    return "".join(parts)


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences (whitespace inside a sentence collapses to spaces)."""
    text = " ".join(text.split())
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()] if text else []


class SimpleHaystack(Haystack):
    """Short procedural sentences: "The {noun} is {adjective}." and a few close variants."""

    name = "simple"

    def sentences(self, seed: int) -> Iterator[str]:
        rng = random.Random(seed)
        nouns = data_lines("simple_nouns.txt")
        adjectives = data_lines("simple_adjectives.txt")
        while True:
            noun, other = rng.sample(nouns, 2)
            adjective = rng.choice(adjectives)
            pattern = rng.random()
            if pattern < 0.7:
                yield f"The {noun} is {adjective}."
            elif pattern < 0.85:
                yield f"The {noun} and the {other} are {adjective}."
            else:
                yield f"The {noun} is next to the {other}."


class ProseHaystack(Haystack):
    """Paragraphs of varied sentences from the grammar in ``data/prose_grammar.json``."""

    name = "prose"

    def __init__(self):
        self.grammar = data_json("prose_grammar.json")
        self.slot = re.compile(r"\{([a-z_]+)\}")

    def _sentence(self, rng: random.Random) -> str:
        pattern = rng.choice(self.grammar["patterns"])
        return self.slot.sub(lambda m: rng.choice(self.grammar[m.group(1)]), pattern)

    def sentences(self, seed: int) -> Iterator[str]:
        rng = random.Random(seed)
        low, high = self.grammar["paragraph_sentences"]
        while True:
            size = rng.randint(low, high)
            for index in range(size):
                sentence = self._sentence(rng)
                yield sentence + "\n\n" if index == size - 1 else sentence


class _CorpusHaystack(Haystack):
    """A finite list of sentences, read from a seed-dependent start and wrapped around."""

    def __init__(self):
        self._corpus: list[str] | None = None

    @abstractmethod
    def _load(self) -> list[str]:
        """All sentences of the source, in order."""

    def corpus(self) -> list[str]:
        if self._corpus is None:
            corpus = self._load()
            if not corpus:
                raise HaystackError(f"haystack {self.name!r} has no text")
            self._corpus = corpus
        return self._corpus

    def sentences(self, seed: int) -> Iterator[str]:
        corpus = self.corpus()
        start = random.Random(seed).randrange(len(corpus))
        return itertools.cycle(corpus[start:] + corpus[:start])


class TextFilesHaystack(_CorpusHaystack):
    """Text of a local file, or of every text file under a directory (sorted by path)."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path).expanduser()
        self.name = f"files:{path}"
        if not self.path.exists():
            raise HaystackError(f"haystack path {self.path} does not exist")

    def files(self) -> list[Path]:
        if self.path.is_file():
            return [self.path]
        files = sorted(p for p in self.path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise HaystackError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {self.path}")
        return files

    def _load(self) -> list[str]:
        sentences: list[str] = []
        for file in self.files():
            sentences.extend(split_sentences(file.read_text(encoding="utf-8", errors="replace")))
        return sentences


DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class DatasetHaystack(_CorpusHaystack):
    """Sentences from a text column of a HuggingFace ``datasets`` dataset."""

    def __init__(
        self,
        name_or_path: str,
        text_column: str = "text",
        split: str = "train",
        config: str | None = None,
        max_rows: int = 20_000,
    ):
        super().__init__()
        self.source, self.text_column, self.split, self.config = name_or_path, text_column, split, config
        self.max_rows = max_rows  # rows read at most (enough text for any probe length)
        self.name = f"dataset:{name_or_path}"

    def load_dataset(self):
        import datasets

        path = Path(self.source).expanduser()
        try:
            if path.is_dir() and (
                (path / "dataset_info.json").exists()
                or (path / "dataset_dict.json").exists()
                or (path / "state.json").exists()
            ):
                loaded = datasets.load_from_disk(str(path))
            elif path.is_file():
                builder = DATASET_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise HaystackError(f"cannot tell the format of {path}; use one of {', '.join(DATASET_BUILDERS)}")
                loaded = datasets.load_dataset(builder, data_files=str(path), split=self.split)
            else:
                loaded = datasets.load_dataset(
                    str(path) if path.is_dir() else self.source, self.config, split=self.split
                )
        except HaystackError:
            raise
        except Exception as exc:  # datasets raises many types (offline, missing split, bad files)
            raise HaystackError(f"cannot load dataset {self.source!r} (split {self.split!r}): {exc}") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if self.split not in loaded:
                raise HaystackError(
                    f"dataset {self.source!r} has no split {self.split!r} (splits: {', '.join(loaded)})"
                )
            loaded = loaded[self.split]
        if self.text_column not in loaded.column_names:
            raise HaystackError(
                f"dataset {self.source!r} has no column {self.text_column!r} "
                f"(columns: {', '.join(loaded.column_names)}); pass text_column"
            )
        return loaded

    def _load(self) -> list[str]:
        dataset = self.load_dataset()
        sentences: list[str] = []
        texts = dataset.select(range(min(len(dataset), self.max_rows)))[self.text_column]  # one column read
        for value in texts:
            if value is not None:
                sentences.extend(split_sentences(str(value)))
        return sentences


def make_haystack(source: str | Haystack, *, text_column: str = "text", split: str = "train") -> Haystack:
    """A haystack from its name: ``simple``, ``prose``, ``files:PATH`` or ``dataset:NAME_OR_PATH``."""
    if isinstance(source, Haystack):
        return source
    if source == "simple":
        return SimpleHaystack()
    if source == "prose":
        return ProseHaystack()
    kind, _, rest = source.partition(":")
    if kind in ("files", "file") and rest:
        return TextFilesHaystack(rest)
    if kind == "dataset" and rest:
        return DatasetHaystack(rest, text_column=text_column, split=split)
    raise HaystackError(f"unknown haystack {source!r}; use simple, prose, files:PATH or dataset:NAME_OR_PATH")


def prose_haystack(tokenizer, num_tokens: int, seed: int = 0) -> str:
    """At least ``num_tokens`` tokens (of ``tokenizer``) of built-in prose, deterministic per seed."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    units: list[str] = []
    total = 0
    stream = ProseHaystack().sentences(seed)
    while total < num_tokens:
        batch = list(itertools.islice(stream, 64))
        units.extend(batch)
        # A sentence's tokens in running text ~ its tokens with a leading space.
        total += sum(len(ids) for ids in tokenizer([" " + u for u in batch], add_special_tokens=False)["input_ids"])
    text = join_units(units).rstrip()
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < num_tokens:
        units.extend(itertools.islice(stream, 64))
        text = join_units(units).rstrip()
    return text
