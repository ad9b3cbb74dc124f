"""The package's folders import only down the layers of docs/architecture.md,
and no folders import each other in a cycle (scripts/import_graph.py prints both)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
SCRIPT = CHECKOUT / "scripts" / "import_graph.py"


def import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_runs_up_the_layers_or_closes_a_cycle():
    done = subprocess.run([sys.executable, "-P", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "upward imports: 0" in done.stdout and "cycles between folders: 0" in done.stdout


def test_every_folder_of_the_package_has_a_layer():
    graph = import_graph()
    folders = {os.path.dirname(str(path.relative_to(CHECKOUT))) for path in graph.module_files().values()}
    unlayered = {folder for folder in folders if folder and graph.layer_of(folder) not in graph.LAYERS}
    assert not unlayered, f"folders without a layer in scripts/import_graph.py LAYERS: {unlayered}"


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_an_upward_import_a_deferred_one_and_a_cycle(tmp_path):
    graph = import_graph()
    write_package(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/model.py": "def f():\n    from fleet.frontend import serving  # deferred: still an edge\n",
        "core/__init__.py": "",
        "core/messages.py": "import fleet.config.model\n",
        "workers/__init__.py": "",
        "workers/models/__init__.py": "",
        "workers/models/llama.py": "from fleet.core.messages import x\nfrom fleet.workers import worker\n",
        "workers/worker.py": "from fleet.workers.models import llama\n",
        "frontend/__init__.py": "",
        "frontend/serving.py": "from fleet.core import messages\n",
        "tests/test_x.py": "from fleet.frontend import serving\n",
    })
    edges = graph.folder_edges(tmp_path)
    assert edges["config", "frontend"] == ["config.model -> frontend.serving"]
    assert ("tests", "frontend") not in edges
    assert graph.upward_imports(edges) == ["config -> frontend: config.model -> frontend.serving"]
    assert graph.folder_cycles(edges) == [["config", "core", "frontend"]]
    # workers/models and workers import each other: one layer, no cycle between layers
    assert ("workers/models", "workers") in edges and ("workers", "workers/models") in edges
