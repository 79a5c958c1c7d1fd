"""What the commands check of a model before its weights load: its config (``config.json``).

``profile-model`` and ``evaluate-artifact`` read it to refuse, before any model work, calibration
windows beyond the model's positions and an artifact of another architecture (issue 30).
"""

from __future__ import annotations


def model_config(model_path: str):
    """The model's transformers config, read before the weights load; None when it cannot be read
    (the model's own load then reports why)."""
    from common.models import load_config

    try:
        return load_config(model_path)
    except Exception:  # noqa: BLE001 - the model's own load reports what is wrong with it
        return None


def model_positions(config) -> int | None:
    """``max_position_embeddings`` of ``config`` (the text model's for a multimodal one), or its attention
    chunk where that is shorter (Llama 4: kvcal profiles it inside its first chunk, where its capture computes what
    the model computes; the runtime serves every chunk), else None."""
    from artifacts.fingerprint import attention_chunk

    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(config, "max_position_embeddings", None)
    positions = positions if isinstance(positions, int) and positions > 0 else None
    chunk = attention_chunk(config)
    return chunk if chunk is not None and (positions is None or chunk < positions) else positions


def other_architecture(config, stored_fingerprint: str) -> bool:
    """Whether an artifact with ``stored_fingerprint`` is certainly of another architecture than
    ``config`` (with or without query norms: that needs the loaded model), before the model loads."""
    from artifacts.fingerprint import architecture_fingerprint, architecture_numbers

    try:
        numbers = architecture_numbers(config)
    except (ValueError, TypeError, AttributeError):
        return False
    return stored_fingerprint not in {architecture_fingerprint(numbers, norm) for norm in (False, True)}
