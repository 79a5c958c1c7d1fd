"""Count the command-line campaign (tests/test_cli_campaign.py): cases tried, and what the
mishandled ones did, for this checkout or for another commit's code.

    python benchmarks/cli_campaign.py                 # this checkout
    python benchmarks/cli_campaign.py --commit main   # another commit's code, with this campaign

With ``--commit`` the commit's tree is extracted (``git archive``) into a temporary directory,
this checkout's ``tests/test_cli_campaign.py`` and ``tests/conftest.py`` copied in, and the
campaign run there: the "before" of docs/results.md R-cli-campaign-2026-11-27.  The cases are
listed by this checkout (many are generated from the commands' option declarations, which an
older commit may lack) and handed to the run as a JSON file (``KVCAL_CAMPAIGN_CASES``).  Prints one line
per mishandled case, then the counts by command and by what went wrong (a case counts once, under
the first of: a file changed, a model began loading, accepted, a traceback, more than one line).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = (
    ("changed", "file changed"),
    ("began loading", "model began loading first"),
    ("exit status", "accepted"),
    ("raised", "traceback"),
    ("lines on stderr", "refused, more than one line"),
)


def list_cases(path: Path) -> None:
    """Write this checkout's cases as JSON ``[[command, args, needs], ...]`` to ``path``."""
    code = (
        "import json, sys, test_cli_campaign as c; "
        "json.dump([[k.command, list(k.args), k.needs] for k in c.all_cases()], open(sys.argv[1], 'w'))"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, env=env, check=True)


def run_campaign(source: Path, log: Path, cases: Path | None = None) -> None:
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", "KVCAL_CAMPAIGN_LOG": str(log)}
    if cases is not None:
        env["KVCAL_CAMPAIGN_CASES"] = str(cases)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cli_campaign.py"]
    subprocess.run(command, cwd=source, env=env, stdout=subprocess.DEVNULL, check=False)


def extract(commit: str, directory: Path) -> Path:
    archive = directory / "tree.tar"
    with open(archive, "wb") as fh:
        subprocess.run(["git", "-C", str(REPO), "archive", commit], stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(directory / "tree", filter="data")
    for name in ("test_cli_campaign.py", "conftest.py"):
        shutil.copy(REPO / "tests" / name, directory / "tree" / "tests" / name)
    return directory / "tree"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", help="run the campaign on this commit's code (default: this checkout)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        source, cases = REPO, None
        if args.commit:
            source, cases = extract(args.commit, scratch), scratch / "cases.json"
            list_cases(cases)
        log = scratch / "campaign.tsv"
        run_campaign(source, log, cases)
        rows = [line.rstrip("\n").split("\t", 1) for line in log.read_text().splitlines()]
    tried, bad, kinds = collections.Counter(), collections.Counter(), collections.Counter()
    for case, outcome in rows:
        command = case.split()[0]
        tried[command] += 1
        if outcome == "handled":
            continue
        bad[command] += 1
        kind = next((label for key, label in KINDS if key in outcome), outcome)
        kinds[kind] += 1
        print(f"{case}\t{outcome[:160]}")
    print(f"\n{sum(tried.values())} cases, {sum(bad.values())} mishandled")
    for command in tried:
        print(f"  {command}: {tried[command]} cases, {bad[command]} mishandled")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
