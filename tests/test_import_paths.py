"""fleet's top-level folders share names with packages on the index (HF's
`kernels` above all): nothing fleet starts may resolve those names to the
checkout, even when started in the checkout root."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from fleet.core.launch import processes

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = "fleet.tests.import_probe"


def probe(command: list[str]) -> dict:
    """Run `command` in the checkout root; the probe's JSON report."""
    done = subprocess.run(command, cwd=CHECKOUT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_nothing_from_checkout(report: dict) -> None:
    shadowed = {name: paths for name, paths in report["locations"].items()
                if any(os.path.abspath(p).startswith(CHECKOUT + os.sep) for p in paths)}
    assert not shadowed, f"top-level names resolved to the checkout: {shadowed}"


def test_children_fleet_spawns_run_with_a_safe_path():
    report = probe(processes.python_command(PROBE))
    assert report["safe_path"]
    assert_nothing_from_checkout(report)


def test_python_started_in_the_checkout_root_imports_installed_packages():
    """`python -m fleet...` or a REPL in the checkout: importing fleet first takes the root off sys.path."""
    report = probe([sys.executable, "-c", f"import fleet, runpy; runpy.run_module({PROBE!r}, run_name='__main__')"])
    assert not report["safe_path"]
    assert_nothing_from_checkout(report)


def test_the_checkout_root_on_sys_path_would_shadow_kernels():
    """Without fleet's guard the hazard is real: the probe would find our `kernels/`."""
    done = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('kernels').origin)"],
        cwd=CHECKOUT, capture_output=True, text=True, timeout=60,
    )
    assert done.stdout.strip() == os.path.join(CHECKOUT, "kernels", "__init__.py")

