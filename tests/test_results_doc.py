"""docs/results.md: every cited result id exists, every entry says where its numbers come from,
and every accuracy cell agrees with its count and its 95% Wilson interval."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.formulas import wilson_interval

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results.md"
# an id: "R-", lowercase words joined by hyphens, then the entry's date
RESULT_ID = re.compile(r"(?<![A-Za-z0-9_-])R-[a-z0-9]+(?:-[a-z0-9]+)*?-\d{4}-\d{2}-\d{2}(?![0-9])")
ANCHOR = re.compile(r'^<a id="([^"]+)"></a>$', re.MULTILINE)
FIELDS = ("commit", "date", "n", "command")
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules", "out"}
# "0.94 (51/54) [0.85, 0.98]": accuracy, correct/n, Wilson interval
CELL = re.compile(r"(\d\.\d\d) \((\d+)/(\d+)\) \[(\d\.\d\d), (\d\.\d\d)\]")


def entries() -> dict[str, str]:
    """Result id -> the text of its entry (from its anchor to the next anchor or heading of a group)."""
    text = RESULTS.read_text()
    anchors = list(ANCHOR.finditer(text))
    found = {}
    for i, anchor in enumerate(anchors):
        end = anchors[i + 1].start() if i + 1 < len(anchors) else len(text)
        body = text[anchor.end() : end].split("\n## ", 1)[0]
        assert anchor.group(1) not in found, f"{anchor.group(1)} is defined twice"
        found[anchor.group(1)] = body
    return found


def field(body: str, name: str) -> str | None:
    match = re.search(rf"^\* \*\*{name}:\*\* (.+(?:\n  .+)*)", body, re.MULTILINE)
    return " ".join(match.group(1).split()) if match else None


def repository_files():
    for path in REPO.rglob("*"):
        relative = path.relative_to(REPO).parts
        if any(part.startswith(".") or part in SKIPPED_DIRS or part.endswith(".egg-info") for part in relative[:-1]):
            continue
        if path.suffix in (".py", ".md") and path.is_file():
            yield path


def test_every_cited_result_id_is_an_entry():
    defined = set(entries())
    assert defined, "docs/results.md has no entries"
    cited = {}
    for path in repository_files():
        for match in RESULT_ID.finditer(path.read_text(errors="replace")):
            cited.setdefault(match.group(0), []).append(str(path.relative_to(REPO)))
    missing = {name: where for name, where in cited.items() if name not in defined}
    assert not missing, f"cited but not in docs/results.md: {missing}"


def test_result_ids_are_well_formed_and_headed():
    for name, body in entries().items():
        assert RESULT_ID.fullmatch(name), name
        assert body.lstrip().startswith(f"### {name}: "), f"{name}: the anchor must be followed by its heading"


@pytest.mark.parametrize("name", sorted(entries()))
def test_every_entry_has_commit_date_n_and_command(name):
    body = entries()[name]
    values = {key: field(body, key) for key in FIELDS}
    assert all(values.values()), f"{name} lacks {[key for key, value in values.items() if not value]}"
    assert re.match(r"`[0-9a-f]{7,40}`", values["commit"]), f"{name}: commit {values['commit']!r}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", values["date"]), f"{name}: date {values['date']!r}"
    assert name.endswith(values["date"]), f"{name}: the id ends with the entry's date"
    command = values["command"]
    if command != "command not recorded":
        invocation = re.match(r"`([^`]+)`", command)
        assert invocation, f"{name}: the command is a `command line` or 'command not recorded'"
        words = invocation.group(1).split()
        if words[0] == "python":
            assert (REPO / words[1]).is_file(), f"{name}: no script {words[1]}"
        else:
            # lm_eval: lm-evaluation-harness's own command (the lm-eval extra), with kvcal as its model
            assert words[0] in ("evaluate-artifact", "profile-model", "make", "lm_eval"), f"{name}: {words[0]}"


def test_accuracy_cells_agree_with_their_counts_and_wilson_intervals():
    cells = CELL.findall(RESULTS.read_text())
    assert len(cells) > 100
    for accuracy, correct, total, low, high in cells:
        k, n = int(correct), int(total)
        assert 0 <= k <= n and f"{k / n:.2f}" == accuracy, (accuracy, correct, total)
        lo, hi = wilson_interval(k, n)
        assert (f"{lo:.2f}", f"{hi:.2f}") == (low, high), (accuracy, correct, total, low, high)


# The navigation at the top of docs/results.md (issue 42): an index of every entry by section, and a table of
# the current figures, each linking the entry it is copied from.
LINK = re.compile(r"\[(R-[^\]]+)\]\(#(R-[^)]+)\)")
INDEX_NOTE = 'Every entry, by section, in the order of this document; "superseded" marks one a later entry replaced.'


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section of ``text``, up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n") + len(f"\n## {heading}\n")
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def expected_index() -> str:
    """The Index section as docs/results.md should hold it: every ``## `` section that holds entries, then
    one line per entry, its id linked and its title, in the document's order."""
    text = RESULTS.read_text()
    found = entries()
    lines = [INDEX_NOTE]
    for match in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL):
        names = ANCHOR.findall(match.group(2))
        if not names:
            continue
        lines += ["", f"**[{match.group(1)}](#{slug(match.group(1))})**", ""]
        for name in names:
            title = found[name].lstrip().split("\n", 1)[0].removeprefix(f"### {name}: ")
            superseded = " (superseded)" if field(found[name], "superseded by") else ""
            lines.append(f"* [{name}](#{name}): {title}{superseded}")
    return "\n".join(lines)


def test_the_index_lists_every_entry():
    listed = [target for text, target in LINK.findall(section(RESULTS.read_text(), "Index"))]
    missing = [name for name in entries() if name not in listed]
    unknown = [name for name in listed if name not in entries()]
    assert not missing, f"entries missing from the Index of docs/results.md: {missing}"
    assert not unknown, f"the Index of docs/results.md links no entry: {unknown}"


def test_the_index_reads_as_generated():
    index = section(RESULTS.read_text(), "Index").strip()
    assert index == expected_index(), "the Index of docs/results.md should read:\n\n" + expected_index()


def test_current_figures_cite_existing_entries():
    table = [line for line in section(RESULTS.read_text(), "Current figures").splitlines() if line.startswith("|")]
    rows = table[2:]  # past the header and its rule
    assert len(rows) >= 10, "the Current figures table lost its rows"
    found = entries()
    for row in rows:
        links = LINK.findall(row)
        assert links, f"a current figure without its entry: {row}"
        for text, target in links:
            assert text == target and target in found, f"{text} -> #{target}: not an entry ({row})"


def test_superseded_by_links_a_later_entry():
    found = entries()
    for name, body in found.items():
        value = field(body, "superseded by")
        if value is None:
            continue
        links = LINK.findall(value)
        assert links, f"{name}: superseded by what? {value!r}"
        for text, target in links:
            assert text == target and target in found and target != name, f"{name}: superseded by {target}"
            assert target[-10:] >= name[-10:], f"{name} is superseded by an earlier entry, {target}"


def test_every_benchmark_is_in_the_benchmarks_readme():
    readme = (REPO / "benchmarks" / "README.md").read_text()
    scripts = sorted(path.name for path in (REPO / "benchmarks").glob("*.py"))
    assert len(scripts) > 20, "the benchmarks moved?"
    missing = [name for name in scripts if f"### `{name}`" not in readme]
    assert not missing, f"benchmarks/README.md has no section for {missing}"
    stale = [name for name in re.findall(r"^### `([^`]+)`", readme, re.MULTILINE) if name not in scripts]
    assert not stale, f"benchmarks/README.md describes scripts that are gone: {stale}"
