"""The shared base every kvcal package builds on, and which imports none of them.

* the policy vocabulary, torch-free: :mod:`common.names` (allocations, scorers, corrections,
  named policies) and :mod:`common.policy_grammar` (how a policy is spelled, what it reads from an
  artifact, whether an artifact can serve it), for the runtime, the artifact reader and the
  command lines alike;
* the command-line kit every command shares: :mod:`common.command_line` (the parser and the
  argument types), :mod:`common.options` (each option declared once), :mod:`common.log` (messages
  and ``-q`` / ``-v``), :mod:`common.version` (``--version``), :mod:`common.atomic` (every file a
  tool writes appears complete or not at all);
* model loading: :mod:`common.models` (a local directory, a hub id, or the embedded model).

Layering (tests/test_layering.py): ``common`` and ``prompt_format`` at the bottom; ``artifacts``
and ``needles`` above them; ``runtime`` above ``artifacts``; ``profiler`` on top.  No package
imports one above it, and no module imports itself in a circle.
"""
