"""Calibration text for the query-statistics stage, cut into fixed-length token windows.

Sources (``--calib-dataset``):

* nothing: the built-in prose haystack generator of :mod:`needles` (deterministic per seed);
* local files: a ``.txt`` file (the whole file is one document), a ``.jsonl`` / ``.json``
  file (one document per record, field ``text``), or a directory of such files (sorted), or
  several of these separated by commas;
* anything else: a Hugging Face ``datasets`` name, optionally ``name:config``, or a local
  dataset directory in another format (parquet, csv...), streamed (``--calib-split``, field
  ``--calib-field``).

Documents are tokenised without special tokens, joined with the EOS token in between, and cut
into ``num_samples`` windows of ``sample_tokens`` tokens.  Too little text is an error that
says how much was found.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".jsonl", ".json")


def _documents_from_file(path: Path, field: str) -> list[str]:
    if path.suffix in TEXT_SUFFIXES:
        return [path.read_text(encoding="utf-8")]
    if path.suffix in RECORD_SUFFIXES:
        text = path.read_text(encoding="utf-8")
        records = (
            [json.loads(line) for line in text.splitlines() if line.strip()]
            if path.suffix == ".jsonl"
            else json.loads(text)
        )
        if isinstance(records, dict):
            records = [records]
        try:
            return [str(record[field]) for record in records]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: every record needs a {field!r} field") from exc
    raise ValueError(f"{path}: unsupported calibration file type (use .txt, .md, .jsonl or .json)")


def local_documents(spec: str, field: str = "text") -> list[str] | None:
    """Documents from local files named by ``spec`` (comma-separated), or None if it names none."""
    paths = [Path(part).expanduser() for part in spec.split(",") if part.strip()]
    if not paths or not all(p.exists() for p in paths):
        return None
    documents: list[str] = []
    for path in paths:
        files = (
            sorted(f for f in path.rglob("*") if f.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES)
            if path.is_dir()
            else [path]
        )
        if not files:
            if len(paths) == 1:
                return None  # a directory of another format (parquet, csv...): a local `datasets` dataset
            raise ValueError(f"{path}: no .txt/.md/.jsonl/.json files in this directory")
        for file in files:
            documents.extend(_documents_from_file(file, field))
    return documents


def dataset_documents(name: str, split: str, field: str, max_chars: int) -> list[str]:
    """Documents from a ``datasets`` dataset (``name`` or ``name:config``), up to ``max_chars``."""
    from datasets import load_dataset

    dataset_name, _, config = name.partition(":")
    try:
        dataset = load_dataset(dataset_name, config or None, split=split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; the message matters
        raise ValueError(f"cannot load calibration dataset {name!r} (split {split!r}): {exc}") from exc
    documents, chars = [], 0
    for record in dataset:
        if field not in record:
            raise ValueError(f"dataset {name!r} has no {field!r} field (fields: {sorted(record)}); use --calib-field")
        documents.append(str(record[field]))
        chars += len(documents[-1])
        if chars >= max_chars:
            break
    return documents


def haystack_documents(tokenizer, num_tokens: int, seed: int) -> list[str]:
    """Prose from needles' built-in haystack generator, at least ``num_tokens`` tokens."""
    from needles import prose_haystack

    return [prose_haystack(tokenizer, num_tokens, seed=seed)]


def calibration_windows(
    tokenizer,
    source: str | None,
    num_samples: int,
    sample_tokens: int,
    *,
    seed: int = 0,
    split: str = "train",
    field: str = "text",
) -> torch.Tensor:
    """``[num_samples, sample_tokens]`` token windows (int64) cut from the calibration text."""
    if num_samples < 1 or sample_tokens < 1:
        raise ValueError(f"need positive num_samples and sample_tokens, got {num_samples}, {sample_tokens}")
    needed = num_samples * sample_tokens
    if source is None:
        documents = haystack_documents(tokenizer, needed + 16, seed)
    else:
        documents = local_documents(source, field)
        if documents is None:
            documents = dataset_documents(source, split, field, max_chars=needed * 12)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for document in documents:
        stream.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        stream.extend(separator)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise ValueError(
            f"calibration text too short: {len(stream)} tokens, {num_samples} samples x "
            f"{sample_tokens} tokens need {needed}"
        )
    return torch.tensor(stream[:needed], dtype=torch.long).reshape(num_samples, sample_tokens)
