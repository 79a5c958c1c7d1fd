"""The profiler's command-line argument types: those of every command (the parser, bounded
integers, intervals, lists, choices, the renamed-option action: :mod:`artifacts.command_line`, re-exported
here) and the attention implementation's check.

Every value is checked where it is parsed, so a bad option is a usage error (exit 2, one line on
stderr: :class:`CommandParser`) before any import of torch or any model work: a count lies in
its bounds (at least 1: 0 used to mean "the preset's", silently; at most a declared maximum, so
that a mistyped 100000000 is refused instead of running for hours), a fraction lies in its
interval, a number is finite, a list is not empty, a name close to a known one is suggested.
"""

from __future__ import annotations

from artifacts.command_line import MAX_COUNT as MAX_COUNT
from artifacts.command_line import MAX_SEED as MAX_SEED
from artifacts.command_line import MAX_TOKENS as MAX_TOKENS

# the parser of every command, re-exported for the profiler's commands
from artifacts.command_line import CommandParser as CommandParser
from artifacts.command_line import RenamedOption as RenamedOption
from artifacts.command_line import choice_of as choice_of
from artifacts.command_line import comma_separated as comma_separated
from artifacts.command_line import did_you_mean as did_you_mean
from artifacts.command_line import fail as fail
from artifacts.command_line import int_at_least as int_at_least
from artifacts.command_line import number_in as number_in


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
