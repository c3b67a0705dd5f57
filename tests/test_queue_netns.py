"""The job queue with its ranks on separate hosts: each worker node in a network namespace
of its own (its own address, a veth link to the host shaped with `tc`), Redis and anvil
listening on the host's bridge address. A submitted job runs to completion with its ranks
talking to each other across those links (rank 0 publishes its TCPStore on its namespace
address; gloo uses the namespace's interface).

Needs root and iproute2 (CI has both); skipped otherwise. Namespaces, links and every
process the test starts are removed by PID, also when it fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

DLX = str(Path(sys.executable).parent / "dlx")
MBPS = 50  # each veth direction's token-bucket rate
LATENCY_MS = 2  # netem delay on each veth, where the kernel has sch_netem

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and tc need root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]


def _links():
    """ReplicaLinks with a delay when the kernel can (sch_netem), else the rate alone."""
    from trainer.errors import ConfigError
    from trainer.netns import ReplicaLinks

    try:
        return ReplicaLinks(replicas=2, mbps=MBPS, latency_ms=LATENCY_MS).__enter__(), LATENCY_MS
    except ConfigError as exc:
        if "netem" not in str(exc) and "unknown" not in str(exc):
            raise
        return ReplicaLinks(replicas=2, mbps=MBPS).__enter__(), 0


def _counter(dev: str, what: str, netns: str | None = None) -> int:
    cmd = ["cat", f"/sys/class/net/{dev}/statistics/{what}"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def _tbf_sent(dev: str, netns: str | None = None) -> int:
    """Bytes the token bucket on `dev` has let through."""
    cmd = ["tc", "-s", "qdisc", "show", "dev", dev]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = re.search(r"qdisc tbf .*?Sent (\d+) bytes", out, re.S)
    assert m, out
    return int(m.group(1))


def test_a_job_runs_with_its_ranks_in_separate_network_namespaces(tmp_path, small_job):
    from lineage.chain.anvil import dev_accounts
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import ETHER, Stack, _stop_pids, down, start_worker, up

    links, latency = _links()
    stack_dir = tmp_path / "stack"
    pids: list[int] = []
    try:
        host = f"10.{links.net}.0.254"  # the host's own address on the namespaces' bridge
        subprocess.run(["ip", "addr", "add", f"{host}/24", "dev", links.bridge], check=True)
        stack = up(stack_dir, workers=0, slots=1, host=host)
        pids += [stack.redis_pid, stack.anvil_pid]
        ledger = Ledger(Chain(stack.rpc), stack.registry, stack.ledger)
        nodes = dev_accounts(3)[1:]
        for r, acct in enumerate(nodes):
            ledger.registry.ensure_staked(acct, ETHER)
            pids.append(start_worker(stack, acct.key.hex(), 1, f"ns-worker-{r}", address=links.address(r),
                                     prefix=("ip", "netns", "exec", links.names[r]),
                                     args=("--store-ports", "29500-29509")))
        stack.save()

        veths = subprocess.run(["ip", "-o", "link", "show", "master", links.bridge], capture_output=True,
                               text=True, check=True).stdout
        host_ends = re.findall(r"^\d+: ([^:@]+)", veths, re.M)
        assert len(host_ends) == 2, veths
        before = {d: _counter(d, "rx_bytes") for d in [*host_ends, links.bridge]}

        job_file = tmp_path / "netns.toml"
        job_file.write_text(small_job("q-netns", seed=4, steps=2, inner_steps=3, stages=1))
        res = subprocess.run([DLX, "submit", str(job_file), "--stack", str(stack_dir)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        job = res.stdout.strip()
        store = JobStore(connect(stack.redis_url))
        deadline = time.monotonic() + 300
        while (rec := store.get(job))["state"] not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, rec
            time.sleep(0.5)
        logs = "\n".join(Path(w["log"]).read_text()[-3000:] for w in Stack.load(stack_dir).workers)
        assert rec["state"] == "completed", (rec, logs)

        # Each rank ran on its own node, rank 0's TCPStore on its namespace's address and
        # in the worker's --store-ports range.
        assert sorted(rec["nodes"]) == sorted(a.address for a in nodes)
        rdzv = store.store_address(job, 1)
        rank0_ns = [a.address for a in nodes].index(rec["nodes"][0])
        assert rdzv and rdzv.rsplit(":", 1)[0] == links.address(rank0_ns), rdzv
        assert 29500 <= int(rdzv.rsplit(":", 1)[1]) <= 29509, rdzv

        # The lineage is on chain: steps 1, 2 attested by the two namespace nodes.
        # (its chain is on the stack's bridge address, not loopback: this user trusts their own stack)
        out = subprocess.run([DLX, "lineage", "--run-dir", rec["run_dir"], "--json", "--trust-run-endpoints"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        steps = json.loads(out.stdout)["steps"]
        assert [s["step"] for s in steps] == [1, 2]
        assert {a.address for a in nodes} == set(steps[-1]["nodes"])

        # Rank-to-rank traffic crossed the shaped veths: what both namespaces sent minus what
        # reached the host itself (Redis, anvil) is what the bridge forwarded between them.
        sent = {d: _counter(d, "rx_bytes") - before[d] for d in before}
        forwarded = sum(sent[d] for d in host_ends) - sent[links.bridge]
        model_bytes = 4 * 41_000  # ~41k float32 parameters: one uncompressed pseudo-gradient
        assert forwarded > 2 * model_bytes, (sent, forwarded)
        for r, d in enumerate(host_ends):  # and through each link's token bucket, both ways
            assert _tbf_sent(d) > model_bytes and _tbf_sent("eth0", links.names[r]) > model_bytes
        print(f"netns queue job: {forwarded} bytes between namespaces, links {MBPS} Mbit/s"
              + (f" + {latency} ms" if latency else " (no sch_netem here: rate only)"))
    finally:
        try:
            if (stack_dir / "stack.json").exists():
                down(stack_dir)
        finally:
            _stop_pids(pids)  # whatever `down` could not reach
            links.__exit__(None, None, None)
