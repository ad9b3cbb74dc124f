"""config/env.py is the one place fleet reads (or sets) environment variables."""
from __future__ import annotations

import ast
from pathlib import Path

import fleet
from fleet.config import env

PACKAGE = Path(fleet.__file__).parent
PRODUCT_FOLDERS = ("config", "core", "frontend", "kernels", "parallel", "workers")


def environment_reads(path: Path) -> list[int]:
    """Lines of `path` that touch os.environ or call os.getenv."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
    return lines


def test_only_config_env_reads_the_environment():
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for folder in PRODUCT_FOLDERS
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        if path != PACKAGE / "config" / "env.py" and (lines := environment_reads(path))
    }
    assert offenders == {}, f"read the environment through fleet.config.env instead: {offenders}"


def test_defaults_and_settings(monkeypatch, tmp_path):
    for name in ("FLEET_IPC_DIR", "RAY_ADDRESS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # set, so that the change below is undone (empty means unset)
    assert env.ray_address() is None and env.gloo_interface() is None and not env.cuda_hidden()
    monkeypatch.setenv("FLEET_IPC_DIR", str(tmp_path))
    assert env.ipc_dir() == str(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert env.ray_address() == "10.0.0.1:6379"
    for hidden in ("", "-1", " -1 "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert env.cuda_hidden()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert not env.cuda_hidden()
    env.set_gloo_interface("eth7")
    assert env.gloo_interface() == "eth7"
