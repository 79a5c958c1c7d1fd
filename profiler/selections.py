"""The token selections the moments stage can measure under, by name (imports nothing).

``profile-model --moments-selection`` offers them without importing torch, and
:func:`profiler.moments.selection_scorer` builds the ``runtime.scorers`` scorer behind each.
The runtime keeps its own copy (``runtime.calibration.MOMENT_SELECTIONS``: the runtime does not
import the profiler); ``tests/test_cli_conventions.py`` checks the two agree.
"""

MOMENTS_SELECTIONS = ("snapkv", "keydiff", "learned")
