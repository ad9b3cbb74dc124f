"""What the parallel tests share: concurrent greedy requests checked
against transformers, metrics gathered from every API server, and launches
that form one job (ports, starting and stopping them together)."""
from __future__ import annotations

import random
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fleet.tests.engine.helpers import random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import Server

MAX_TOKENS = 6


def expected_texts(server: Server, model_dir: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[str]:
    """The oracle's tokens as the server's text. Text round trips are not
    always token-exact, so texts are compared; a streamed text holds back an
    incomplete UTF-8 character at its end, which /detokenize shows as U+FFFD."""
    oracle = hf_model(model_dir)
    tokens = [greedy(oracle, prompt, max_tokens) for prompt in prompts]
    texts = [server.post("/detokenize", json={"tokens": t}).json()["prompt"] for t in tokens]
    return [text.rstrip("\ufffd") for text in texts]


def complete_concurrently(server: Server, prompts: list[list[int]], base_url: str | None = None) -> list[dict]:
    """POST every prompt at once (greedy, exactly MAX_TOKENS tokens); the
    JSON bodies, with the answering API server's index under "api_server"."""

    def one(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0,
                "skip_special_tokens": False}  # as /detokenize does
        response = server.post("/v1/completions", json=body) if base_url is None else _post(base_url, body)
        assert response.status_code == 200, response.text
        return {**response.json(), "api_server": response.headers["fleet-api-server"]}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _post(base_url: str, body: dict):
    import httpx

    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def assert_greedy_over_http(server: Server, model_dir: str, count: int, seed: int,
                            base_url: str | None = None) -> list[dict]:
    prompts = random_prompts(count, 512, seed=seed, max_len=40)
    bodies = complete_concurrently(server, prompts, base_url)
    assert [b["choices"][0]["text"] for b in bodies] == expected_texts(server, model_dir, prompts)
    return bodies


def metrics_of_every_api_server(server: Server, count: int, attempts: int = 200) -> dict[str, str]:
    """/metrics of each of `count` API servers sharing the port (the kernel
    hands each new connection to one of them)."""
    pages: dict[str, str] = {}
    for _ in range(attempts):
        response = server.get("/metrics")
        pages[response.headers["fleet-api-server"]] = response.text
        if len(pages) == count:
            return pages
    raise AssertionError(f"only API servers {sorted(pages)} answered /metrics")


def per_engine(pages: dict[str, str], metric: str) -> dict[str, float]:
    """A metric summed over API servers and label sets, by its engine label."""
    totals: dict[str, float] = {}
    for text in pages.values():
        for line in text.splitlines():
            match = re.match(rf'{re.escape(metric)}{{(.*)}} (\S+)$', line)
            if match:
                engine = re.search(r'engine="(\d+)"', match.group(1)).group(1)
                totals[engine] = totals.get(engine, 0.0) + float(match.group(2))
    return totals


def free_port_pair(span: int = 4) -> int:
    """A port p with p .. p + span - 1 free (--data-parallel-rpc-port uses
    p and p + 1, node 0's API server p + 2 and p + 3). Drawn below the
    kernel's ephemeral range: a fixed port in that range can be taken at any
    moment by a socket bound to port 0 (a store, a gloo pair) of another
    process of the same job."""
    low = _ephemeral_range()[0]
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(low - 12000, 1024), low - span)
        if all(_is_free(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} free ports in a row")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except OSError:
        return 32768, 60999


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_together(*launches: tuple[str, ...]) -> list[Server]:
    """Start launches of one job at once: none is ready before all joined."""
    servers: list[Server | Exception] = [RuntimeError("not started")] * len(launches)

    def start(index: int) -> None:
        try:
            servers[index] = Server(*launches[index], startup_timeout=300)
        except Exception as error:  # noqa: BLE001 - reported below
            servers[index] = error

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(launches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [s for s in servers if isinstance(s, Exception)]
    if failed:
        for server in servers:
            if isinstance(server, Server):
                server.kill()
        raise failed[0]
    return servers  # type: ignore[return-value]


def stop_servers(servers: list[Server]) -> None:
    """SIGTERM every launch of a job at once, then check that nothing of any is left."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in servers:
        server.proc.wait(60)
        server.assert_nothing_left()


def launched_names(server: Server) -> list[str]:
    """The --name of every process the launch started (each says it on its command line)."""
    command_lines = [p.cmdline() for p in server.descendants]
    return sorted(line[line.index("--name") + 1] for line in command_lines if "--name" in line)


def launched_tcp_ports(server: Server) -> dict[str, set[int]]:
    """The TCP ports each process of the launch listens on, by its --name
    (the launcher under plan_json.LAUNCHER)."""
    from fleet.tests.config.plan_json import LAUNCHER

    ports = {LAUNCHER: listening_tcp_ports(server.proc.pid)}
    for process in server.descendants:
        line = process.cmdline()
        if "--name" in line:
            ports[line[line.index("--name") + 1]] = listening_tcp_ports(process.pid)
    return ports


def listening_tcp_ports(pid: int) -> set[int]:
    """The ports of the TCP sockets `pid` listens on, read through its own
    /proc entries so that it works for a process in another network
    namespace (psutil reads the caller's /proc/net)."""
    proc = Path(f"/proc/{pid}")
    inodes = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for row in (proc / "net" / table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports
