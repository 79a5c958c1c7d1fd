"""The stage lists of the README and the design notes follow ``profiler.stages.STAGES``: every
stage, in the order a job runs them."""

from __future__ import annotations

import re
from pathlib import Path

from profiler.stages import STAGE_NAMES

REPO = Path(__file__).resolve().parent.parent


def listed_stages(text: str, start: str, end: str) -> list[str]:
    """The stage names quoted (in backticks) between ``start`` and the next ``end``, in order."""
    begin = text.index(start)
    passage = text[begin : text.index(end, begin + len(start))]
    return [name for name in re.findall(r"`([a-z-]+)`", passage) if name in STAGE_NAMES]


def test_design_notes_list_every_stage_in_order():
    text = (REPO / "docs" / "design.md").read_text()
    assert listed_stages(text, "The profiler's stages, in the order a job runs them", "\n\n") == list(STAGE_NAMES)


def test_readme_lists_every_stage_in_order():
    text = (REPO / "README.md").read_text()
    assert listed_stages(text, "the calibration job: stages, in the order they run,", "\n\n") == list(STAGE_NAMES)
