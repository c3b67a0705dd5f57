"""The exchange rules of trainer/diloco.py (sync, restart, eager, partial) on an in-process
fake transport: R replicas in R threads, no processes, no sockets.

Inner steps are stand-ins (a deterministic pull of each replica's weights towards its own
target plus noise), so each rule's bookkeeping is checked exactly: what is applied when,
what is committed, and what a verifier can re-derive.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainer.compress import Compressor, decode_contribution
from trainer.config import CompressionConfig, load_job
from trainer.diloco import (
    DiLoCo,
    OuterOptimizer,
    apply_outer_step,
    eager_start,
    fragment_groups,
    fragment_of,
)
from trainer.transport import Pending

R, T, H = 3, 4, 5


class Hub:
    """The shared wire: blobs by exchange number, complete once every replica posted."""

    def __init__(self, replicas: int):
        self.R = replicas
        self.blobs: dict[int, dict[int, bytes]] = {}
        self.cond = threading.Condition()

    def post(self, n: int, replica: int, payload: bytes) -> None:
        with self.cond:
            self.blobs.setdefault(n, {})[replica] = payload
            self.cond.notify_all()

    def collect(self, n: int) -> list[bytes]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.blobs.get(n, {})) == self.R, timeout=30), "peer lost"
            return [self.blobs[n][r] for r in range(self.R)]


class FakeTransport:
    """`trainer.transport.Transport`'s interface over a Hub (the k-th call of every replica
    is exchange k, as collectives are)."""

    def __init__(self, hub: Hub, replica: int):
        self.hub, self.R, self.replica = hub, hub.R, replica
        self.calls = 0
        self.wait_s = 0.0

    def start_all_gather(self, payload: bytes) -> Pending:
        n, self.calls = self.calls, self.calls + 1
        self.hub.post(n, self.replica, payload)
        done = threading.Event()
        pending = Pending(done, lambda sizes: None)
        hub = self.hub

        def wait() -> list[bytes]:
            pending.finished = pending.started
            return hub.collect(n)

        pending.wait = wait  # type: ignore[method-assign]
        return pending

    def all_gather(self, payload: bytes) -> list[bytes]:
        return self.start_all_gather(payload).wait()


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))


def outer_cfg(**outer):
    return load_job({"name": "t", "outer": {"steps": T, "inner_steps": H, **outer}}).outer


@torch.no_grad()
def inner_step(module: nn.Module, replica: int, t: int, h: int) -> None:
    """A stand-in inner step: pull towards the replica's target, plus noise."""
    g = torch.Generator().manual_seed(1000 * replica + 10 * t + h)
    for i, p in enumerate(module.parameters()):
        target = torch.full_like(p, float(replica - i))
        p.add_(0.2 * (target - p) + 0.01 * torch.randn(p.shape, generator=g))


@dataclass
class Log:
    """What one replica saw: per applied step, the outer state right after it; per round,
    its payload and start weights; the round each end_round/merge/flush applied."""

    shards: dict[int, bytes] = field(default_factory=dict)
    payloads: dict[int, bytes] = field(default_factory=dict)
    starts: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    applied_by: list[tuple[str, int, int | None]] = field(default_factory=list)
    genesis: bytes = b""


def run_replica(cfg, hub: Hub, replica: int, log: Log, module: nn.Module, kind: str, errors: list) -> None:
    try:
        comp = Compressor(CompressionConfig(kind=kind, bits=4), {n: p.shape for n, p in module.named_parameters()},
                          seed=replica)
        dl = DiLoCo(module, cfg, FakeTransport(hub, replica), comp)
        log.genesis = dl.outer.to_bytes()

        def record(where: str, t: int, applied) -> None:
            log.applied_by.append((where, t, None if applied is None else applied.round))
            if applied is not None:
                log.shards[applied.round] = dl.outer.to_bytes()
                log.payloads[applied.round] = applied.payload

        for t in range(1, T + 1):
            merge_at = dl.merge_step if dl.pending else None
            log.starts[t] = {n: p.detach().clone() for n, p in module.named_parameters()}
            for h in range(H):
                if h == merge_at:
                    record("merge", t, dl.merge(log.starts[t]))
                inner_step(module, replica, t, h)
            if merge_at == H:
                record("merge", t, dl.merge(log.starts[t]))
            applied = dl.end_round(t, tag=t)
            record("end", t, applied)
            if cfg.rule == "partial":
                dl.merge_step = cfg.tau if cfg.tau != "auto" else 2
        record("flush", T + 1, dl.flush())
        log.final = {n: p.detach().clone() for n, p in module.named_parameters()}  # type: ignore[attr-defined]
    except BaseException as exc:  # surfaced in the main thread
        errors.append(exc)


def run_all(cfg, kind: str = "none") -> list[Log]:
    hub, logs, errors = Hub(R), [Log() for _ in range(R)], []
    modules = [model() for _ in range(R)]  # one thread seeds torch at a time
    threads = [threading.Thread(target=run_replica, args=(cfg, hub, r, logs[r], modules[r], kind, errors))
               for r in range(R)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    return logs


RULES = [
    ({"delay": 0}, "sync"),
    ({"delay": 1, "overlap": "restart", "momentum": 0.0, "nesterov": False}, "restart"),
    ({"delay": 1, "overlap": "eager"}, "eager"),
    ({"delay": 1, "overlap": "partial", "tau": 2}, "partial"),
    ({"delay": 1, "overlap": "partial", "tau": H}, "partial"),
    ({"delay": 1, "overlap": "partial", "tau": 3, "alpha": 0.5}, "partial"),
    ({"delay": 1, "overlap": "partial", "tau": 2, "fragments": 2}, "partial"),
]


@pytest.mark.parametrize("kind", ["none", "quantize"])
@pytest.mark.parametrize(("outer", "rule"), RULES)
def test_every_rule_commits_the_ordered_mean_step_and_applies_each_round_once(outer, rule, kind) -> None:
    cfg = outer_cfg(**outer)
    assert cfg.rule == rule
    logs = run_all(cfg, kind)
    for log in logs:
        applied = [(where, t, a) for where, t, a in log.applied_by if a is not None]
        assert [a for _, _, a in applied] == list(range(1, T + 1)), log.applied_by  # each round once, in order
        if rule != "sync":
            assert log.applied_by[0] == ("end", 1, None)  # round 1 applies nothing
            assert applied[-1] == ("flush", T + 1, T)  # flush applies the last exchange
        else:
            assert log.applied_by[-1] == ("flush", T + 1, None)
        if rule == "partial":
            assert all(where == "merge" for where, _, _ in applied[:-1])
    # Every replica commits the same state, and it is the ordered mean's outer step of the
    # published payloads, recomputed from the parent shard alone.
    for t in range(1, T + 1):
        assert len({log.shards[t] for log in logs}) == 1
        parent = logs[0].genesis if t == 1 else logs[0].shards[t - 1]
        assert apply_outer_step(parent, [log.payloads[t] for log in logs], cfg, t) == logs[0].shards[t]
    # flush leaves the local weights at the committed outer ones.
    final = OuterOptimizer.from_bytes(logs[0].shards[T], cfg).params
    for log in logs:
        assert all(torch.equal(log.final[n], final[n]) for n in final)  # type: ignore[attr-defined]


def test_partial_with_tau_0_is_synchronous_diloco_bit_for_bit() -> None:
    sync = run_all(outer_cfg(delay=0), "quantize")
    partial = run_all(outer_cfg(delay=1, overlap="partial", tau=0), "quantize")
    for a, b in zip(sync, partial, strict=True):
        assert a.shards == b.shards and a.payloads == b.payloads


def test_restart_and_eager_start_weights_are_derived_from_committed_data() -> None:
    for outer in ({"delay": 1, "overlap": "restart"}, {"delay": 1, "overlap": "eager"}):
        cfg = outer_cfg(**outer)
        logs = run_all(cfg, "quantize")
        for r, log in enumerate(logs):
            genesis = OuterOptimizer.from_bytes(log.genesis, cfg).params
            assert all(torch.equal(log.starts[1][n], genesis[n]) for n in genesis)
            for t in range(2, T + 1):
                before = log.genesis if t == 2 else log.shards[t - 2]  # committed state after step t-2
                if cfg.rule == "restart":
                    want = OuterOptimizer.from_bytes(before, cfg).params
                else:
                    outer = OuterOptimizer.from_bytes(before, cfg)
                    shapes = {n: p.shape for n, p in outer.params.items()}
                    own = decode_contribution(log.payloads[t - 1], shapes)
                    stale = None if t == 2 else [decode_contribution(lg.payloads[t - 2], shapes) for lg in logs]
                    want = eager_start(outer, stale, own, r, R)
                assert all(torch.equal(log.starts[t][n], want[n]) for n in want), (outer, t)


def test_partial_start_weights_continue_the_previous_round() -> None:
    """Round t+1 starts where round t ended (no restart): its first tau steps run on."""
    cfg = outer_cfg(delay=1, overlap="partial", tau=2)
    sync = run_all(outer_cfg(delay=0))
    logs = run_all(cfg)
    for t in range(2, T + 1):
        # The start weights are not a committed state, unlike synchronous DiLoCo's.
        committed = OuterOptimizer.from_bytes(logs[0].shards[t - 1], cfg).params
        assert not all(torch.equal(logs[0].starts[t][n], committed[n]) for n in committed)
        s_committed = OuterOptimizer.from_bytes(sync[0].shards[t - 1], cfg).params
        assert all(torch.equal(sync[0].starts[t][n], s_committed[n]) for n in s_committed)


@pytest.mark.parametrize("kind", ["none", "quantize"])
def test_fragments_exchange_one_group_a_round_and_step_only_it(kind) -> None:
    """Streaming DiLoCo's fragments: round t's payload carries group (t - 1) mod F and
    nothing else, outer step t moves that group's weights and momentum only (the other
    groups are byte for byte the parent's), and the groups are whole tensors in order."""
    cfg = outer_cfg(delay=1, overlap="partial", tau=2, fragments=2)
    logs = run_all(cfg, kind)
    shapes = {n: p.shape for n, p in model().named_parameters()}
    groups = fragment_groups(shapes, 2)
    assert groups == [["0.bias", "0.weight"], ["1.bias", "1.weight"]]
    for t in range(1, T + 1):
        mine = {n: shapes[n] for n in fragment_of(t, groups)}
        other = {n: shapes[n] for n in shapes if n not in mine}
        for log in logs:
            decode_contribution(log.payloads[t], mine, exact_keys=True)
            with pytest.raises(ValueError, match="contribution: no delta/|contribution: no "):
                decode_contribution(log.payloads[t], other)
        before = OuterOptimizer.from_bytes(logs[0].genesis if t == 1 else logs[0].shards[t - 1], cfg)
        after = OuterOptimizer.from_bytes(logs[0].shards[t], cfg)
        for n in shapes:
            same = torch.equal(before.params[n], after.params[n]) and torch.equal(
                before.momentum()[n], after.momentum()[n])
            assert same == (n in other), (t, n)
    with pytest.raises(ValueError, match="needs its step number"):
        apply_outer_step(logs[0].genesis, [log.payloads[1] for log in logs], cfg)
    # A contribution holding another group's tensors is refused, not silently ignored.
    with pytest.raises(ValueError, match="not in the round's fragment"):
        apply_outer_step(logs[0].shards[1], [log.payloads[1] for log in logs], cfg, 2)


def test_fragments_of_one_group_are_the_partial_rule_bit_for_bit() -> None:
    one = run_all(outer_cfg(delay=1, overlap="partial", tau=2), "quantize")
    explicit = run_all(outer_cfg(delay=1, overlap="partial", tau=2, fragments=1), "quantize")
    for a, b in zip(one, explicit, strict=True):
        assert a.shards == b.shards and a.payloads == b.payloads


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.data())
@settings(max_examples=300, deadline=None)
def test_fragment_groups_cover_the_stage_in_contiguous_nonempty_groups(sizes, data) -> None:
    F = data.draw(st.integers(1, len(sizes)))
    shapes = {f"blocks.{i}.w": (n,) for i, n in enumerate(sizes)}
    groups = fragment_groups(shapes, F)
    assert len(groups) == F and all(groups)
    flat = [n for g in groups for n in sorted(g, key=lambda n: int(n.split(".")[1]))]
    assert flat == [f"blocks.{i}.w" for i in range(len(sizes))]  # contiguous, in depth order (10 after 9)
    assert groups == fragment_groups(dict(reversed(shapes.items())), F)  # names and shapes alone
    if len(set(sizes)) == 1 and len(sizes) % F == 0:  # equal tensors split evenly
        assert {len(g) for g in groups} == {len(sizes) // F}
    with pytest.raises(ValueError, match="fragments"):
        fragment_groups(shapes, len(sizes) + 1)


def test_auto_tau_hides_the_exchange_up_to_a_quarter_of_the_sync_period() -> None:
    """tau = auto: the steps the modelled exchange takes (padded), at most a quarter of the
    period between two syncs of the same weights: H / 4, or with F fragments F H / 4, never
    past the next round's end."""
    from types import SimpleNamespace

    from trainer.engine import TAU_MARGIN, auto_tau
    from trainer.transport import LinkModel

    wire = SimpleNamespace(R=2, link=LinkModel(bandwidth=1000.0))  # 1 kB/s: 992 bytes + header = 1 s
    assert auto_tau(wire, 992, 0.0, 0.1, 80) == math.ceil(TAU_MARGIN / 0.1)  # 13 steps of 0.1 s
    assert auto_tau(wire, 992, 0.0, 0.01, 40) == 10  # 125 steps wanted: H / 4
    assert auto_tau(wire, 992, 0.0, 0.01, 40, fragments=2) == 20  # F H / 4
    assert auto_tau(wire, 992, 0.0, 0.01, 10, fragments=8) == 10  # at most H
    assert auto_tau(wire, 992, 5.0, 0.1, 400) == math.ceil(5.0 * TAU_MARGIN / 0.1)  # the measured, if longer
