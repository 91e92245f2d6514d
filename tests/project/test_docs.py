"""The docs keep up with the code: every configuration option is in docs/configuration.md's table,
every problem type in docs/guarantees.md's, every module in docs/architecture.md's map; the
tutorial's install line installs what every demo it names imports; the README's two commands are
the ones CI runs; the version is one everywhere, and the CHANGELOG's newest release."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import idemproxy_client
from packaging.requirements import Requirement

import idemproxy.proxy as proxy_package
from idemproxy.proxy.config_view import markdown_table, options
from idemproxy.proxy.problems import PROBLEMS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()


def test_every_option_is_in_the_configuration_table():
    block = (DOCS / "configuration.md").read_text().split("<!-- options:begin -->\n", 1)[1]
    block = block.split("<!-- options:end -->", 1)[0]
    for option, _, env in options():
        assert f"`{option}`" in block and f"`{env}`" in block, f"{option} missing from docs/configuration.md"
    assert block == markdown_table(), \
        "docs/configuration.md's table is stale: paste python -m idemproxy.proxy.config_view --markdown"


def installed_by(line: str) -> set[str]:
    """Distributions (normalised names) that `pip install -e '.[x]' -e 'clients/python[y]'` brings."""
    roots = {"idemproxy": re.search(r"'\.\[([^\]]*)\]'", line).group(1),
             "idemproxy-client": re.search(r"'clients/python\[([^\]]*)\]'", line).group(1)}
    todo = [(name, set(extras.split(","))) for name, extras in roots.items()]
    seen: set[str] = set()
    while todo:
        name, extras = todo.pop()
        key = (name.lower().replace("_", "-"))
        for requirement in metadata.requires(name) or []:
            req = Requirement(requirement)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                continue
            dep = req.name.lower().replace("_", "-")
            if dep == key:  # idemproxy[all] names idemproxy[postgres,...]
                todo.append((name, set(req.extras)))
            elif dep not in seen:
                seen.add(dep)
                todo.append((req.name, set(req.extras)))
        seen.add(key)
    return seen


def test_the_tutorials_install_line_runs_every_demo():
    tutorial = (DOCS / "getting-started.md").read_text().split("\n## ", 1)[0]
    line = next(line for line in tutorial.splitlines() if "pip install" in line)
    brought = installed_by(line)
    local = {p.stem for p in (ROOT / "examples").glob("*.py")} | {p.stem for p in (ROOT / "tests").rglob("*.py")}
    owners = metadata.packages_distributions()
    for demo in (ROOT / "examples").glob("*.py"):
        for node in ast.walk(ast.parse(demo.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for top in {n.split(".")[0] for n in names}:
                if top in sys.stdlib_module_names or top in local:
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [])}
                assert dists & brought, f"{demo.name} imports {top}, which {line.strip()!r} does not install"


def test_every_problem_type_is_in_the_guarantees_table():
    section = (DOCS / "guarantees.md").read_text().split("### Problem types", 1)[1].split("\n#", 1)[0]
    documented = {m[1]: (int(m[2]), m[3].strip()) for m in re.finditer(r"^\| `([a-z-]+)` \| (\d+) \| (.+?) \|$",
                                                                       section, re.M)}
    expected = {slug: (kind.status, kind.title) for slug, kind in PROBLEMS.items()}
    assert documented == expected, "docs/guarantees.md's problem types differ from proxy/problems.py's"


def test_the_architecture_map_names_every_module():
    """Each module of proxy/, supervisor/ and proxy/store/, and each package, by its name."""
    page = (DOCS / "architecture.md").read_text()
    for folder in ("proxy", "supervisor", "proxy/store"):
        for path in sorted((ROOT / folder).iterdir()):
            if path.is_dir() and (path / "__init__.py").exists():
                name = f"{path.name}/"
            elif path.suffix == ".py" and path.name != "__init__.py":
                name = path.name
            else:
                continue
            assert name in page, f"docs/architecture.md's map does not name {folder}/{name}"


def test_the_readme_is_short_and_its_commands_are_what_ci_runs():
    assert len(README.splitlines()) <= 250, "README.md grew past 250 lines: move the detail into docs/"
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    serve = next(b for b in blocks if "idemproxy serve" in b).strip()
    assert serve == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/idemproxy serve"
    assert "scripts/test" in [b.strip() for b in blocks], "the README's test command is scripts/test"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "scripts/test" in ci, ".ci/run must run the README's test command as it is"
    script = (ROOT / "scripts" / "test").read_text()
    assert "pytest" in script and "apt-get install" in script


def test_one_version_everywhere_and_it_is_the_newest_release():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    client = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())["project"]["version"]
    assert version == client == proxy_package.__version__ == idemproxy_client.__version__
    releases = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[:2] == ["Unreleased", version], "CHANGELOG.md: Unreleased on top, then this version"
    for manifest in ("config/compose.yaml", "config/kubernetes/deployment.yaml", "config/kubernetes/supervisor.yaml"):
        tags = re.findall(r"image: idemproxy:(\S+)", (ROOT / manifest).read_text())
        assert tags and set(tags) == {version}, f"{manifest} runs idemproxy:{tags}, not {version}"
