"""The declared dependency ranges are the tested ranges.

`make test` installs the newest versions pyproject.toml allows and `make test-lowest` the pins of
.ci/lowest-versions.txt: these tests keep the pins equal to the declared lower bounds, every
range closed above, the Makefile's torch the newest the range allows, the README's "Tested
versions" table equal to both ends, and the README's install into an existing CUDA environment the
command `make test-keep-torch` (CI) runs.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"] + project["optional-dependencies"]["test"]]
    return {req.name.lower(): req for req in requirements}


def lowest_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "lowest-versions.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = Version(version.strip())
    return pins


def bounds(req: Requirement) -> tuple[Version | None, Version | None]:
    lower = upper = None
    for spec in req.specifier:
        if spec.operator in (">=", "=="):
            lower = Version(spec.version)
        if spec.operator in ("<", "=="):
            upper = Version(spec.version)
    return lower, upper


def test_every_dependency_has_a_lower_and_an_upper_bound():
    for req in declared().values():
        lower, upper = bounds(req)
        assert lower is not None and upper is not None, f"{req}: a range CI tests needs both ends"


def test_lowest_pins_are_the_declared_lower_bounds():
    pins = lowest_pins()
    for name, req in declared().items():
        lower, upper = bounds(req)
        if lower == upper:  # an exact pin (ruff) has one version only
            continue
        assert name in pins, f"{name} has no pin in .ci/lowest-versions.txt"
        assert pins[name] == lower, f"{name}: pinned {pins[name]}, declared lower bound {lower}"
    assert set(pins) <= set(declared()), f"pins for undeclared packages: {set(pins) - set(declared())}"


def test_makefile_torch_is_the_newest_allowed_minor():
    torch_pin = Version(re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1))
    req = declared()["torch"]
    _, upper = bounds(req)
    assert torch_pin in req.specifier, f"Makefile installs torch {torch_pin}, outside {req.specifier}"
    assert (torch_pin.major, torch_pin.minor + 1) == (upper.major, upper.minor), (
        f"torch {torch_pin} is not the newest minor below {upper}: the newest end of the range would go untested"
    )


def test_installed_versions_are_inside_the_declared_ranges():
    from importlib.metadata import version

    for name, req in declared().items():
        installed = Version(version(name))
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} outside {req.specifier}"


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(line) for line in lines] for name, lines in project["optional-dependencies"].items()}


def test_optional_integrations_are_ranges_their_own_job_tests():
    """An extra outside ``test`` (kvpress, lm-eval) is installed only by its own make target (``make
    test-kvpress``, ``make test-lm-eval``, which run its newest versions): each is bounded on both
    sides, and its lower bound is the newest release inside the range, so that one job tests both ends."""
    optional = {name: reqs for name, reqs in extras().items() if name != "test"}
    assert set(optional) == {"kvpress", "lm-eval"}, f"an extra without a make target that installs it: {set(optional)}"
    makefile = (ROOT / "Makefile").read_text()
    for name, reqs in optional.items():
        assert f"EXTRAS=test,{name}" in makefile, f"no make target installs the {name} extra"
        for req in reqs:
            lower, upper = bounds(req)
            assert lower is not None and upper is not None, f"{req}: a range CI tests needs both ends"
    (kvpress,) = optional["kvpress"]
    assert bounds(kvpress)[0] == Version("0.5.5"), "kvpress 0.5.5 is the newest release: the lower bound is it"
    lm_eval = next(req for req in optional["lm-eval"] if req.name == "lm-eval")
    assert bounds(lm_eval) == (Version("0.4.13"), Version("0.4.14")), "lm-eval 0.4.13, the newest release, alone"


def test_installed_optional_integrations_are_inside_their_ranges():
    from importlib.metadata import PackageNotFoundError, version

    for reqs in extras().values():
        for req in reqs:
            try:
                installed = Version(version(req.name))
            except PackageNotFoundError:  # an extra this environment did not install
                continue
            inside = req.specifier.contains(installed, prereleases=True)
            assert inside, f"{req.name} {installed} outside {req.specifier}"


def readme_table() -> dict[str, dict[str, str]]:
    """README's "Tested versions" table: row label (``newest``, ``lowest``) -> package -> cell."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    header = next(line for line in lines if line.startswith("| | Python | torch |"))
    names = [cell.strip().lower() for cell in header.strip("|").split("|")[1:]]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        label = cells[0].split(" ", 1)[0]
        if label in ("newest", "lowest"):
            rows[label] = dict(zip(names, cells[1:], strict=True))
    assert set(rows) == {"newest", "lowest"}, f"README's table rows: {set(rows)}"
    return rows


def cell_version(cell: str) -> Version:
    return Version(re.match(r"\d+(\.\d+)*", cell).group(0))


# Declared ranges whose newest minor is not installable on the Python versions the project supports,
# so that `make test` tests an older one: numpy 2.5 requires Python >= 3.12.
NEWEST_INSTALLABLE = {"numpy": (Version("2.4"), "3.12", "the newest on Python 3.11")}


def test_readmes_table_is_the_tested_versions():
    """The README's "Tested versions" table: the lowest row is .ci/lowest-versions.txt, the newest row
    the Makefile's torch and, for every other package, the newest minor version below the upper
    bound, except where ``NEWEST_INSTALLABLE`` says why not; that exception holds only while the
    project's Python range excludes the Python the newer release needs, and the README says so."""
    table = readme_table()
    pins = lowest_pins()
    for name, cell in table["lowest"].items():
        if name != "python":
            assert cell_version(cell) == pins[name], f"README's lowest {name} {cell}, pinned {pins[name]}"
    makefile_torch = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert cell_version(table["newest"]["torch"]) == Version(makefile_torch)
    requires_python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    for name, cell in table["newest"].items():
        if name in ("python", "torch"):
            continue
        tested = cell_version(cell)
        _, upper = bounds(declared()[name])
        newest_allowed = Version(f"{upper.major}.{upper.minor - 1}")
        if name in NEWEST_INSTALLABLE:
            newest, needs_python, says = NEWEST_INSTALLABLE[name]
            assert Version(needs_python) not in SpecifierSet(requires_python), (
                f"{name}: the project now allows Python {needs_python}; test {newest_allowed} and drop the exception"
            )
            assert says in cell, f"README's newest {name} ({cell}) does not say why it is not {newest_allowed}"
            newest_allowed = newest
        assert (tested.major, tested.minor) == (newest_allowed.major, newest_allowed.minor), (
            f"README's newest {name} is {cell}, the newest installable minor is {newest_allowed}"
        )


def readme_keep_torch_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Installing into an existing CUDA environment", 1)[1]
    return next(line for line in section.splitlines() if line.startswith("pip install -e . "))


def test_ci_runs_the_readmes_install_into_an_existing_environment():
    """`make test-keep-torch` (which .ci/run runs) installs kvcal by the README's command word for
    word, the one that keeps an environment's torch."""
    command = readme_keep_torch_command()
    assert "torch==$(" in command, command
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-keep-torch:", 1)[1].split("\n\n", 1)[0].replace("$$", "$")
    assert command in recipe, f"the README's\n  {command}\nis not what `make test-keep-torch` runs:\n{recipe}"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test-keep-torch" in ci, ".ci/run does not run make test-keep-torch"


def test_ci_holds_one_environment_at_a_time():
    """Each of CI's environments holds a CUDA build of torch (about 6 GB); a CI machine's disk did
    not hold four of them and pip's cache (2026-11-27: "No space left on device" installing
    .venv-lowest). `.ci/run` keeps no pip cache and removes each job's environment before the next
    job installs its own."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "export PIP_NO_CACHE_DIR=1" in ci, ".ci/run lets pip cache gigabytes of wheels"
    makefile = (ROOT / "Makefile").read_text()
    environment_of = {
        "test": ".venv",
        "test-keep-torch": re.search(r"^KEEP\s*:=\s*(\S+)", makefile, re.M).group(1),
        "test-lowest": re.search(r"^test-lowest:\n\t.*VENV=(\S+)", makefile, re.M).group(1),
        "test-kvpress": re.search(r"^test-kvpress:\n\t.*VENV=(\S+)", makefile, re.M).group(1),
        "test-lm-eval": re.search(r"^test-lm-eval:\n\t.*VENV=(\S+)", makefile, re.M).group(1),
    }
    jobs = [line.split()[1] for line in ci if line.startswith("make ")]
    assert jobs == list(environment_of), jobs
    for job, following in zip(jobs, jobs[1:] + [None], strict=True):
        start = ci.index(f"make {job}")
        end = ci.index(f"make {following}") if following else len(ci)
        assert f"rm -rf {environment_of[job]}" in ci[start + 1 : end], (
            f".ci/run keeps {environment_of[job]} (make {job}) on disk while the next job installs"
        )


def test_the_suite_keeps_the_temporary_directories_of_failed_tests_only():
    """CI runs the suite twice on one disk (make test, then make test-lowest); with pytest's default
    retention every test's temporary directory stays until three sessions later: the first run's
    model and artifact copies (more than 20 GB on 2026-11-27, mostly the CLI campaign's workspaces)
    were still on disk while the second installed and ran."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options.get("tmp_path_retention_policy") == "failed", options
