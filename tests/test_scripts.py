"""Every script in scripts/ runs after `make install` alone: it imports only
the standard library, fleet, and packages that pyproject.toml's main
dependencies install (no test or optional extra), and answers --help."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((CHECKOUT / "scripts").glob("*.py"))


def top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def install_closure() -> set[str]:
    """Distributions that installing the main dependencies brings, transitively."""
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    pending = [re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0] for spec in project["dependencies"]]
    seen: set[str] = set()
    while pending:
        name = normalized(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        pending += [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    return seen


def test_there_are_scripts():
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_only_what_make_install_installs(script):
    providers = importlib.metadata.packages_distributions()
    allowed = install_closure()
    missing = {}
    for module in top_level_imports(script) - set(sys.stdlib_module_names) - {"fleet", "__future__"}:
        distributions = {normalized(d) for d in providers.get(module, [module])}
        if not distributions & allowed:
            missing[module] = sorted(distributions)
    assert not missing, f"{script.name} imports modules that `make install` does not install: {missing}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script):
    done = subprocess.run([sys.executable, "-P", str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_gpu_smoke_says_plainly_it_did_not_run_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: scripts/gpu_smoke.py is run by hand there")
    script = next(s for s in SCRIPTS if s.name == "gpu_smoke.py")
    done = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout.startswith("NOT RUN: no CUDA device"), done.stdout + done.stderr
