"""The README keeps up with the code (issue 11 item 7): every configuration option is in its
table, and the tutorial's install line installs what every demo it names imports."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from idemproxy.proxy.config_view import markdown_table, options

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_option_is_in_the_readme_table():
    block = README.split("<!-- options:begin -->\n", 1)[1].split("<!-- options:end -->", 1)[0]
    for option, _, env in options():
        assert f"`{option}`" in block and f"`{env}`" in block, f"{option} missing from README.md"
    assert block == markdown_table(), "README.md's table is stale: paste python -m idemproxy.proxy.config_view --markdown"


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
    tutorial = README.split("## Five-minute tutorial", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in tutorial.splitlines() if "pip install" in line)
    brought = installed_by(line)
    local = {p.stem for p in (ROOT / "examples").glob("*.py")} | {p.stem for p in (ROOT / "tests").glob("*.py")}
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
