"""Real shaped links for `[transport] link = "netns"`: one network namespace per replica.

    with ReplicaLinks(replicas=2, mbps=100, latency_ms=5) as links:
        links.init_method(port)      # tcp://<replica 0's address>:port
        links.enter(replica)         # in a rank process, before torch.distributed starts

Each replica r gets a namespace `dlx<tag>r<r>` holding one end of a veth pair (`eth0`,
10.<net>.0.<r+1>/24, and `lo`); the other ends hang on a bridge in the root namespace.
`tc` shapes both directions of every replica's link: a token bucket (`tbf`) at the
bandwidth, under a `netem` delay when a latency is set (that needs the kernel's sch_netem,
absent on some machines: the error then names `transport.link`). Ranks of one replica share its
namespace, so pipeline traffic stays on loopback (unshaped) while everything between
replicas crosses two shaped veths. gloo is pointed at `eth0` (GLOO_SOCKET_IFNAME).

Needs root (CAP_NET_ADMIN) and `ip`/`tc`; anything less is a ConfigError naming
`transport.link`. Everything created is deleted on exit, also after a failure.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid

from trainer.errors import ConfigError

__all__ = ["ReplicaLinks", "enter_netns"]

CLONE_NEWNET = 0x40000000


def _run(*args: str) -> None:
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(
            f"transport.link: netns setup failed: {' '.join(args)}: {res.stderr.strip()}"
        )


def enter_netns(name: str) -> None:
    """Move the calling process into network namespace `name` (/var/run/netns/<name>)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"


class ReplicaLinks:
    """Create (on enter) and delete (on exit) R namespaces joined by tc-shaped veth links."""

    def __init__(self, replicas: int, mbps: float, latency_ms: float = 0.0):
        if os.geteuid() != 0:
            raise ConfigError("transport.link: 'netns' needs root (network namespaces, tc)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise ConfigError(f"transport.link: 'netns' needs the `{tool}` command")
        self.R, self.mbps, self.latency_ms = replicas, mbps, latency_ms
        tag = uuid.uuid4().hex[:6]
        self.net = 64 + int(tag, 16) % 128  # 10.<net>.0.0/24
        self.bridge = f"dlxb{tag}"
        self.names = [f"dlx{tag}r{r}" for r in range(replicas)]
        self._host_ends = [f"dlx{tag}h{r}" for r in range(replicas)]
        self._created: list[tuple[str, str]] = []

    def address(self, replica: int) -> str:
        return f"10.{self.net}.0.{replica + 1}"

    def init_method(self, port: int) -> str:
        return f"tcp://{self.address(0)}:{port}"

    def __enter__(self) -> ReplicaLinks:
        try:
            self._setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _shape(self, prefix: tuple[str, ...], dev: str) -> None:
        rate = f"{self.mbps:g}mbit"
        burst = max(32_000, int(self.mbps * 1e6 / 8 / 100))  # ~10 ms of traffic, >= 32 KB
        parent: tuple[str, ...] = ("root",)
        if self.latency_ms > 0:  # netem (sch_netem) for the delay, the bucket under it
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", f"{self.latency_ms:g}ms", "limit", "100000")
            parent = ("parent", "1:1")
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
             "rate", rate, "burst", str(burst), "latency", "1s")

    def _setup(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        for r, (ns, host) in enumerate(zip(self.names, self._host_ends, strict=True)):
            _run("ip", "netns", "add", ns)
            self._created.append(("netns", ns))
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._created.append(("link", host))
            _run("ip", "link", "set", host, "master", self.bridge)
            _run("ip", "link", "set", host, "up")
            inside = ("ip", "netns", "exec", ns)
            _run(*inside, "ip", "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            self._shape(inside, "eth0")  # replica -> bridge
            self._shape((), host)  # bridge -> replica

    def __exit__(self, *exc: object) -> None:
        for kind, name in reversed(self._created):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._created.clear()
