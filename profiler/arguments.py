"""``--attn-implementation`` checked before the model loads, for the profiler's two commands
(``profile-model``, ``evaluate-artifact``).  The argument types every command shares (the parser,
bounded integers, intervals, lists, choices) are :mod:`common.command_line`'s.
"""

from __future__ import annotations

from common.command_line import did_you_mean


def check_attention_implementation(name: str) -> None:
    """``--attn-implementation`` checked before the model loads (``ValueError``, with the closest
    known name): auto, eager, one that transformers registers (sdpa, flash_attention_2, ...), or a
    hub kernel (``org/repo``); one that cannot run here is refused naming what is missing (flash
    attention without its package or a CUDA device, a hub kernel without the ``kernels`` package:
    transformers raised ImportError once loading had begun).  Imports transformers: call it after
    parsing, not in the parser."""
    if name in ("auto", "eager"):
        return
    from transformers.utils import import_utils

    kernels = getattr(import_utils, "is_kernels_available", lambda: True)()
    if "/" in name:
        if not kernels:
            raise ValueError(
                f"--attn-implementation {name} is a hub kernel, which needs the kernels package (pip install "
                "kernels); it is not installed (or not a version transformers supports)"
            )
        return
    from transformers import AttentionInterface

    known = ["auto", "eager", *sorted(AttentionInterface._global_mapping)]
    base = name.removeprefix("paged|")
    if base not in known:
        raise ValueError(
            f"unknown attention implementation {name!r}{did_you_mean(name, known)} (--attn-implementation); "
            f"choose from {', '.join(known)}, or a hub kernel org/repo"
        )
    version = base.removeprefix("flash_attention_")
    available = getattr(import_utils, f"is_flash_attn_{version}_available", None) if version != base else None
    if available is not None and not available() and not kernels:
        raise ValueError(
            f"--attn-implementation {name} cannot run here: it needs the flash-attn {version} package and a CUDA "
            "device (transformers' is_flash_attn_"
            f"{version}_available() is False), or the kernels package for its hub kernel; use sdpa or eager"
        )
