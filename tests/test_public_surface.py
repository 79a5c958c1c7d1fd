"""The public surface of ``runtime`` is what README.md documents (issue 42): every name the package
exports is a row of the README's "API" table, every name the README tells a user to import or call
(``from runtime import ...`` in its code, ```runtime.<Name>``` in its text) is exported or defined in
the module it names, the serving section opens with six lines of usage and a table of policies that
parse, and no table cell of the README is a wall of text."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

import runtime
from common.names import NAMED_POLICIES

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# the documents whose ``runtime.<name>`` mentions must resolve (the README and the notes it links)
DOCUMENTS = [README, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_PACKAGES = ("common", "artifacts", "runtime", "needles", "profiler", "prompt_format")
LONGEST_CELL = 400  # characters; issue 42 found a cell of 2,610


def section(text: str, heading: str) -> str:
    """From ``heading`` (a whole line) to the next heading of the same or a higher level."""
    start = text.index(f"\n{heading}\n") + 1
    body = start + len(heading) + 1
    depth = len(heading.split(" ", 1)[0])
    following = re.search(rf"^#{{1,{depth}}} ", text[body:], re.M)
    return text[start : body + following.start()] if following else text[start:]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text``: its rows (header and separator included), each a list of cells."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
        elif current:
            found.append(current)
            current = []
    return found


def table_after(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first table in ``heading``'s section."""
    rows = tables(section(text, heading))[0]
    return rows[2:]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def first_code_name(cell: str) -> str:
    """``load_calibration`` of "`load_calibration(model, ...)`"."""
    match = re.match(r"`([A-Za-z_]\w*)", cell)
    assert match, f"the API table's first cell names no code: {cell!r}"
    return match.group(1)


@cache
def module_path(name: str) -> Path | None:
    """The source of the repository's module ``name`` (``runtime.scorers`` -> its ``__init__.py``)."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def defined_names(name: str) -> frozenset[str]:
    """What the module ``name`` defines or imports at its top level (read from its source, unimported)."""
    names = set()
    for node in ast.parse(module_path(name).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """``runtime.X[.Y...]`` names an export, or a module of the repository and then a name it defines."""
    parts = dotted.split(".")
    if len(parts) == 2 and parts[1] in runtime.__all__:
        return True
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        if module_path(module):
            rest = parts[cut:]
            return not rest or rest[0] in defined_names(module)
    return False


def test_every_export_is_in_the_readmes_api_table_and_every_row_is_an_export():
    rows = table_after(README.read_text(), "### API")
    documented = [first_code_name(row[0]) for row in rows]
    assert len(documented) == len(set(documented)), f"a name is documented twice: {documented}"
    assert set(runtime.__all__) - set(documented) == set(), "exported but not in README's API table"
    assert set(documented) - set(runtime.__all__) == set(), "in README's API table but not exported"
    assert all(len(row) == 3 and row[1] and row[2] for row in rows), (
        "each API row says what it is and where to read more"
    )


def test_every_export_resolves():
    assert runtime.__all__ == sorted(runtime._EXPORTS)
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None
        assert name in defined_names(f"runtime.{runtime._EXPORTS[name]}")
    with pytest.raises(AttributeError):
        runtime.prefill  # noqa: B018  (a deep name: runtime.compression.prefill.prefill)


def test_every_import_in_the_readmes_code_resolves():
    """``from runtime import X`` imports an export; ``from runtime.m import X`` (and the other
    packages of the repository) a name the module defines."""
    checked = 0
    for block in code_blocks(README.read_text()):
        for node in ast.walk(ast.parse(block)):
            if not isinstance(node, ast.ImportFrom) or node.module.split(".")[0] not in REPO_PACKAGES:
                continue
            for alias in node.names:
                checked += 1
                if node.module == "runtime":
                    assert alias.name in runtime.__all__, f"README imports runtime.{alias.name}, not exported"
                else:
                    assert module_path(node.module), f"README imports from {node.module}, no such module"
                    assert alias.name in defined_names(node.module), f"{node.module} defines no {alias.name}"
    assert checked >= 5


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_runtime_name_the_documents_mention_exists(document):
    """```runtime.answer()```, ```runtime.plan.policy_spec.FLAGSHIP```, ```runtime.kvpress_press```: an
    export, or a module and a name it defines (not ``kvcal.runtime``, the logger)."""
    text = document.read_text()
    mentions = set(re.findall(r"(?<![\w./-])runtime(?:\.[A-Za-z_]\w*)+", text))
    unresolved = sorted(mention for mention in mentions if not resolves(mention))
    assert not unresolved, f"{document.name} names what runtime neither exports nor defines: {unresolved}"


def test_the_serving_section_opens_with_six_lines_of_usage_and_the_policies():
    text = section(README.read_text(), "## Serving with an artifact")
    body = text.split("\n", 1)[1].lstrip("\n")
    assert body.startswith("```python\n"), "the serving section does not open with its usage"
    usage = code_blocks(body)[0]
    compile(usage, "README usage", "exec")
    assert len([line for line in usage.splitlines() if line.strip()]) == 6, usage
    policies = tables(body)[0]
    assert policies[0][0] == "policy", policies[0]
    first = policies[2][0]
    assert first == f"`flagship` = `{NAMED_POLICIES['flagship']}`", first


def _named_policies(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell.replace("`flagship` = ", ""))


def test_the_policy_table_parses_and_says_what_each_policy_reads():
    """Each policy of the serving section's table parses, and its last column names exactly the
    artifact sections it reads (``behaviour`` being the alternative to ``budgets``)."""
    from runtime.plan.policy import REQUIREMENTS

    sections = {requirement.section for requirement in REQUIREMENTS}
    text = section(README.read_text(), "## Serving with an artifact")
    rows = tables(text)[0][2:]
    assert len(rows) >= 4
    for row in rows:
        needed = set()
        for name in _named_policies(row[0]):
            policy = runtime.parse_policy(name).policy(0.75)
            needed |= {requirement.section for requirement in policy.requirements()}
        named = {word for word in re.findall(r"`(\w+)`", row[2]) if word in sections}
        assert named == needed, f"{row[0]}: README says it reads {sorted(named)}, it reads {sorted(needed)}"


def test_no_readme_table_cell_is_a_wall_of_text():
    longest = max((cell for table in tables(README.read_text()) for row in table for cell in row), key=len)
    assert len(longest) <= LONGEST_CELL, f"a README table cell of {len(longest)} characters: {longest[:120]}..."
