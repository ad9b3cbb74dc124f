"""Every environment variable fleet reads or sets, in one place: its other
modules ask here instead of reading os.environ themselves."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


def api_key() -> str | None:
    """FLEET_API_KEY: the default of --api-key."""
    return os.environ.get("FLEET_API_KEY") or None


def cache_dir() -> str:
    """FLEET_CACHE_DIR: where fleet keeps what it derives from model files
    (GGUF metadata, converted tokenizers). Default: ~/.cache/fleet."""
    return os.environ.get("FLEET_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fleet")


def ipc_dir() -> str:
    """FLEET_IPC_DIR: the directory of the ipc:// socket files. Default: the system's temporary directory."""
    return os.environ.get("FLEET_IPC_DIR") or tempfile.gettempdir()


@contextmanager
def ipc_dir_set_to(path: str) -> Iterator[None]:
    """FLEET_IPC_DIR is `path` in this process, and in the children it starts, until the block ends."""
    previous = os.environ.get("FLEET_IPC_DIR")
    os.environ["FLEET_IPC_DIR"] = path
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("FLEET_IPC_DIR", None)
        else:
            os.environ["FLEET_IPC_DIR"] = previous


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster to join when --ray-address is not given (None: start a local one)."""
    return os.environ.get("RAY_ADDRESS") or None


def cuda_hidden() -> bool:
    """Whether CUDA_VISIBLE_DEVICES hides every GPU ("" or "-1")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1")


def gloo_interface() -> str | None:
    """GLOO_SOCKET_IFNAME: the network interface gloo uses (None: fleet picks the one that routes to node 0)."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or None


def set_gloo_interface(interface: str) -> None:
    """Tell gloo, which reads only its environment variable, which interface to use."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface


def malloc_mmap_threshold_set() -> bool:
    """Whether the user tuned glibc's MALLOC_MMAP_THRESHOLD_ (their setting wins over fleet's)."""
    return "MALLOC_MMAP_THRESHOLD_" in os.environ


def cpu_isa() -> str | None:
    """FLEET_CPU_ISA: run fleet as on a CPU of a lower class (config/cpu_class.py:
    baseline, avx2, avx512, avx512_bf16, amx). Unset: the machine's own class."""
    return os.environ.get("FLEET_CPU_ISA") or None


def hold_torch_to(settings: dict[str, str]) -> None:
    """Set torch's, oneDNN's and MKL's own variables (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) for this process and its
    children; they take effect only if torch has not loaded yet."""
    os.environ.update(settings)
