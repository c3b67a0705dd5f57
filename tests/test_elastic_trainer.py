"""Elastic replicas, the trainer side (issue 18): membership epochs in real torch.distributed
processes, with no Redis and no chain. The launcher's part (`RankControl.regroup`) is
played here by `Coordinator`: a TCPStore in the test process that ranks ask for their
next epoch, and a small decision rule (every rank of the epoch has asked or died; the
replicas whose every stage asked are in; a growth regroup adds the waiting replica).

    .venv/bin/pytest tests/test_elastic_trainer.py -m "not slow"   # config and units, a few s
    .venv/bin/pytest tests/test_elastic_trainer.py                  # + the process runs, ~2 min
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from trainer import ConfigError, load_job
from trainer.artifacts import param_tensors, same_tensors
from trainer.control import Membership, RankControl, ResumePoint
from trainer.diloco import apply_outer_step
from trainer.errors import Cancelled, TrainingDiverged, TrainingError
from trainer.launch import free_port, train_rank
from trainer.replay import ReplayItem, fresh_state_core, replay_round, replay_rounds, state_core
from trainer.supervisor import ChildOptions, Supervisor, peer_loss
from trainer.world import Topology, check_members, world_failure

BASE = {"name": "elastic", "outer": {"steps": 1, "inner_steps": 1}}


# --- configuration and the pure pieces -------------------------------------------------


@pytest.mark.parametrize(("parallel", "message"), [
    ({"replicas": 3, "min_replicas": 4}, "parallel.min_replicas: must be at most replicas (3) (got 4)"),
    ({"replicas": 3, "min_replicas": 0}, "parallel.min_replicas: Input should be greater than or equal to 1"),
    ({"replicas": 3, "min_replicas": 2, "sync": "allreduce"},
     "parallel.min_replicas: must equal replicas (3) under sync = 'allreduce'"),
])
def test_min_replicas_is_validated_naming_the_field(parallel: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job({**BASE, "parallel": parallel})
    assert str(info.value).startswith(message)


def test_min_replicas_left_out_or_at_r_dumps_as_before() -> None:
    plain = load_job({**BASE, "parallel": {"replicas": 3}})
    at_r = load_job({**BASE, "parallel": {"replicas": 3, "min_replicas": 3}})
    elastic = load_job({**BASE, "parallel": {"replicas": 3, "min_replicas": 2}})
    assert "min_replicas" not in plain.model_dump()["parallel"]
    assert plain.canonical_json() == at_r.canonical_json() != elastic.canonical_json()
    assert (plain.parallel.min_present, elastic.parallel.min_present) == (3, 2)
    assert load_job(elastic.model_dump()).parallel.min_replicas == 2
    assert load_job({**BASE, "parallel": {"replicas": 3, "min_replicas": 3, "sync": "allreduce"}})


def test_topology_places_present_replicas_by_position_and_keeps_their_ids() -> None:
    topo = Topology(3, 3, 2, (0, 2))  # world of replicas 0 and 2, two stages: rank 3 = (position 1, stage 1)
    assert (topo.position, topo.replica, topo.stage, topo.n, topo.full, topo.lead) == (1, 2, 1, 2, False, False)
    assert topo.global_rank(1, 0) == 2
    assert Topology(1, 2, 1).full and Topology(0, 3, 1, (1, 2)).replica == 1


def test_members_must_be_ascending_ids_and_at_least_min_replicas() -> None:
    job = load_job({**BASE, "parallel": {"replicas": 3, "min_replicas": 2}})
    assert check_members((0, 2), job, 1) == (0, 2)
    for bad in ((2, 0), (0, 0), (0, 3)):
        with pytest.raises(TrainingError, match="are not distinct ids in 0..2"):
            check_members(bad, job, 1)
    with pytest.raises(TrainingError, match=r"^membership epoch 4: 1 replica\(s\) \[1\] remain, fewer than "
                                            r"parallel.min_replicas \(2\)"):
        check_members((1,), job, 4)


def test_only_a_broken_world_regroups() -> None:
    assert world_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4000"))
    assert world_failure(RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"))
    assert world_failure(dist.DistBackendError("NCCL communicator was aborted"))
    for own in (TrainingError("connection closed by peer"), TrainingDiverged("loss is nan"),
                Cancelled("stopped"), ValueError("bad"), RuntimeError("shape mismatch"), AssertionError()):
        assert not world_failure(own)


def test_an_eager_start_is_checked_over_the_replicas_of_its_step() -> None:
    from trainer.artifacts import tensors_to_bytes
    from trainer.compress import decode_contribution
    from trainer.diloco import OuterOptimizer, eager_start
    from trainer.replay import eager_start_matches

    job = load_job({**BASE, "parallel": {"replicas": 3, "stages": 1, "min_replicas": 2},
                    "outer": {"steps": 3, "inner_steps": 1, "delay": 1, "overlap": "eager"}})
    g = torch.Generator().manual_seed(0)
    shard = OuterOptimizer({"w": torch.randn(3, 2, generator=g)}, job.outer).to_bytes()
    own, *stale = (tensors_to_bytes({"delta/w": torch.randn(3, 2, generator=g)}) for _ in range(3))
    shapes = {"w": torch.Size([3, 2])}
    # Replica 2 in a step of replicas (0, 2): position 1 of 2.
    start = eager_start(OuterOptimizer.from_bytes(shard, job.outer), [decode_contribution(b, shapes) for b in stale],
                        decode_contribution(own, shapes), 1, 2)
    state = tensors_to_bytes({"param/w": start["w"]})
    assert eager_start_matches(job, 2, state, shard, own, stale, members=(0, 2))
    assert not eager_start_matches(job, 0, state, shard, own, stale, members=(0, 2))
    assert not eager_start_matches(job, 2, state, shard, own, stale)  # all 3: the set is wrong


# --- a launcher's regroup, for the tests: a TCPStore in this process ------------------


def _client(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=120))


class StoreRegroup:
    """Picklable `RankControl.regroup` of slot (replica, stage): post the ask, block on the
    answer (a Membership, or an error text to raise)."""

    def __init__(self, port: int, replica: int, stage: int) -> None:
        self.port, self.replica, self.stage = port, replica, stage
        self.store: Any = None

    def __call__(self, epoch: int, reason: str) -> Membership:
        if self.store is None:
            self.store = _client("127.0.0.1", self.port)
        self.store.set(f"ask/{epoch}/{self.replica}/{self.stage}", reason)
        answer = pickle.loads(self.store.get(f"answer/{epoch}/{self.replica}/{self.stage}"))
        if isinstance(answer, str):
            raise TrainingError(answer)
        return answer


class GrowAfter:
    """Picklable `grow_requested` for rank 0: True at the `n`-th round boundary only."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls == self.n


@dataclass
class Result:
    genesis: Any = None
    steps: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # slot -> error line
    done: set[int] = field(default_factory=set)
    epochs: list[dict] = field(default_factory=list)  # every rank's ("epoch", ...) events
    contributions: list[tuple[int, Any]] = field(default_factory=list)
    regroups: list[tuple[int, tuple[int, ...], int, set[str]]] = field(default_factory=list)


class Coordinator:
    """Runs a job's ranks as slots (replica, stage), plays the launcher's regroup and
    membership rule, and kills one slot when the first member's progress reaches
    `kill_at` = (outer step, inner step, slot)."""

    def __init__(self, job: Any, members: tuple[int, ...] | None = None, *, kill_at: tuple[int, int, int] | None = None,
                 grow_after: int | None = None, joiner: int | None = None) -> None:
        self.job, self.S = job, job.parallel.stages
        self.members = members or tuple(range(job.parallel.replicas))
        self.kill_at, self.grow_after, self.joiner = kill_at, grow_after, joiner
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=120))
        self.epoch, self.procs, self.res = 0, {}, Result()

    def control(self, slot: int, members: tuple[int, ...], epoch: int, start: ResumePoint | None = None) -> RankControl:
        replica, stage = divmod(slot, self.S)
        grow = GrowAfter(self.grow_after) if self.grow_after and replica == members[0] and stage == 0 else None
        return RankControl(members=members, epoch=epoch, start=start, timeout_s=30, emit_contributions=True,
                           regroup=StoreRegroup(self.port, replica, stage), grow_requested=grow)

    def start(self, sup: Supervisor, slot: int, rank: int, members: tuple[int, ...], init: str,
              start: ResumePoint | None = None) -> None:
        control = self.control(slot, members, self.epoch, start)
        args = (rank, len(members) * self.S, init, self.job, control)
        self.procs[slot] = sup.start(slot, train_rank, args, name=f"elastic-{slot}", options=ChildOptions())

    def run(self, timeout_s: float = 300) -> Result:
        deadline = time.monotonic() + timeout_s
        with Supervisor() as sup:
            init = f"tcp://127.0.0.1:{free_port()}"
            for p, r in enumerate(self.members):
                for s in range(self.S):
                    self.start(sup, r * self.S + s, p * self.S + s, self.members, init)
            while any(p.is_alive() for p in self.procs.values()):
                assert time.monotonic() < deadline, f"elastic run timed out: {self.res}"
                self.on_event(sup.next_event(0.1))
                self.maybe_regroup(sup)
            for event in sup.drain():
                self.on_event(event)
        return self.res

    def on_event(self, event: Any) -> None:
        if event is None:
            return
        kind, slot, payload = event
        res = self.res
        if kind == "genesis":
            res.genesis = payload
        elif kind == "step":
            assert payload.step not in res.steps, f"step {payload.step} reported twice"
            res.steps[payload.step] = payload
        elif kind == "error":
            res.errors[slot] = payload
        elif kind == "done":
            res.done.add(slot)
        elif kind == "epoch":
            res.epochs.append(payload)
        elif kind == "contribution":
            res.contributions.append(payload)
        elif kind == "progress" and self.kill_at and (payload.outer_step, payload.inner_step) == self.kill_at[:2]:
            os.kill(self.procs[self.kill_at[2]].pid, signal.SIGKILL)
            self.kill_at = None

    def maybe_regroup(self, sup: Supervisor) -> None:
        """Once a rank of the epoch asked, and every other has asked or died: answer them all."""
        slots = [r * self.S + s for r in self.members for s in range(self.S)]
        asked = {slot: self.store.check([self.key("ask", slot)]) for slot in slots}
        if not any(asked.values()) or any(not asked[x] and self.procs[x].is_alive() for x in slots):
            return
        for event in sup.drain(0.3):  # the steps rank 0 emitted before it asked
            self.on_event(event)
        reasons = {self.store.get(self.key("ask", x)).decode() for x in slots if asked[x]}
        present = tuple(r for r in self.members if all(asked[r * self.S + s] for s in range(self.S)))
        joining = () if "grow" not in reasons or self.joiner is None else (self.joiner,)
        members = tuple(sorted(present + joining))
        step = max(self.res.steps, default=0)
        shards = (self.res.steps[step] if step else self.res.genesis).stages
        init = f"tcp://127.0.0.1:{free_port()}"
        self.res.regroups.append((self.epoch, members, step, reasons))
        answers: dict[int, Any] = {}
        for x in slots:
            r, s = divmod(x, self.S)
            answers[x] = (Membership(self.epoch + 1, members.index(r) * self.S + s, members, init, step,
                                     shards[s].data) if r in members else f"replica {r} is out of the run")
        for x, answer in answers.items():
            if asked[x]:
                self.store.set(self.key("answer", x), pickle.dumps(answer))
        self.epoch += 1
        for r in joining:
            for s in range(self.S):
                self.start(sup, r * self.S + s, members.index(r) * self.S + s, members, init,
                           ResumePoint(step, shards[s].data))
        self.members = members

    def key(self, kind: str, slot: int) -> str:
        r, s = divmod(slot, self.S)
        return f"{kind}/{self.epoch}/{r}/{s}"


# --- the process runs -------------------------------------------------------------------


def tiny_job(replicas: int, stages: int, steps: int, outer: dict | None = None, **parallel: Any) -> Any:
    return load_job({
        "name": "elastic", "seed": 5,
        "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "parallel": {"replicas": replicas, "stages": stages, "microbatches": 2, **parallel},
        "data": {"batch_size": 2, "eval_batches": 1, "max_bytes": 200_000},
        "inner": {"warmup": 1},
        "outer": {"steps": steps, "inner_steps": 4, **(outer or {})},
    })


def check_steps(job: Any, res: Result) -> None:
    """Every step once, each new shard the ordered mean of exactly its present replicas'
    contributions applied to the parent shard, bit for bit."""
    S, T = job.parallel.stages, job.outer.steps
    assert sorted(res.steps) == list(range(1, T + 1))
    parent = [sh.data for sh in res.genesis.stages]
    for t in range(1, T + 1):
        step = res.steps[t]
        present = step.replicas or tuple(range(job.parallel.replicas))
        assert [(c.replica, c.stage) for c in step.contributions] == [(r, s) for r in present for s in range(S)]
        for s in range(S):
            mine = [step.contributions[p * S + s].data for p in range(len(present))]
            assert apply_outer_step(parent[s], mine, job.outer) == step.stages[s].data, (t, s)
        parent = [sh.data for sh in step.stages]


def contribution(step: Any, replica: int, stage: int = 0) -> Any:
    (c,) = [c for c in step.contributions if (c.replica, c.stage) == (replica, stage)]
    return c


def start_state(step: Any, replica: int, stage: int = 0) -> bytes:
    return contribution(step, replica, stage).start_state


def replay(job: Any, res: Result, t: int, replica: int) -> Any:
    """Replica `replica`'s round `t` replayed from its published start state (S = 1)."""
    parent = res.steps[t - 1] if t > 1 else res.genesis
    outer = [parent.stages[0].data] if job.outer.rule == "partial" else None
    (out,) = replay_rounds(job, [ReplayItem(t, replica, [start_state(res.steps[t], replica)], outer=outer)])
    assert not out.error, out.error
    return out


RULES = {"sync": {}, "partial": {"delay": 1, "overlap": "partial", "tau": 1}}


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_three_replicas_lose_one_to_sigkill_and_the_others_finish_every_step(rule: str) -> None:
    job = tiny_job(3, 1, 5, RULES[rule], min_replicas=2)
    res = Coordinator(job, kill_at=(3, 2, 1)).run()
    assert not res.errors and res.done == {0, 2}
    check_steps(job, res)
    assert [res.steps[t].replicas for t in range(1, 6)] == [(), (), (0, 2), (0, 2), (0, 2)]
    assert [res.steps[t].epoch for t in range(1, 6)] == [0, 0, 1, 1, 1]
    ((epoch, members, at, reasons),) = res.regroups
    assert (epoch, members, at) == (0, (0, 2), 2) and all(peer_loss(r) for r in reasons)  # the lost peer
    assert {(e["epoch"], e["rank"], e["members"]) for e in res.epochs if e["epoch"] == 1} == {(1, 0, (0, 2)),
                                                                                           (1, 1, (0, 2))}
    # Round 3 restarted from the committed shard of step 2, with the inner and compressor
    # state round 2 left (kept in memory, not fresh): what a verifier's continuity check wants.
    shard2 = res.steps[2].stages[0].data
    for r in (0, 2):
        assert same_tensors(param_tensors(start_state(res.steps[3], r)), param_tensors(shard2))
    assert replay(job, res, 2, 2).end_states == [state_core(start_state(res.steps[3], 2))]
    assert state_core(start_state(res.steps[3], 2)) != fresh_state_core(job, 2, 0, 3)
    # Post-regroup rounds replay bit for bit, by replica id.
    for t, r in ((3, 2), (4, 0)):
        assert replay(job, res, t, r).payloads == [contribution(res.steps[t], r).data]
    assert res.steps[5].metrics["tokens"] == (2 * 3 + 3 * 2) * 4 * 2 * 16
    assert res.steps[5].metrics["train_loss"] == (res.steps[5].contributions[0].loss
                                                  + res.steps[5].contributions[1].loss) / 2


@pytest.mark.slow
def test_two_by_two_loses_a_stage_of_replica_1_and_replica_0_goes_on_alone() -> None:
    job = tiny_job(2, 2, 4, min_replicas=1)
    res = Coordinator(job, kill_at=(2, 2, 3)).run()
    assert set(res.errors) == {2} and "replica 1 is out of the run" in res.errors[2]
    assert res.done == {0, 1}
    check_steps(job, res)
    assert [res.steps[t].replicas for t in range(1, 5)] == [(), (0,), (0,), (0,)]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sync", "eager"])
def test_a_replica_joins_at_a_growth_boundary_with_fresh_state(rule: str) -> None:
    job = tiny_job(3, 1, 4, {"delay": 1, "overlap": "eager"} if rule == "eager" else {}, min_replicas=2)
    res = Coordinator(job, members=(0, 1), grow_after=2, joiner=2).run()
    assert not res.errors and res.done == {0, 1, 2}
    check_steps(job, res)
    assert [res.steps[t].replicas for t in range(1, 5)] == [(0, 1), (0, 1), (), ()]
    assert res.regroups[0][:3] == (0, (0, 1, 2), 2) and res.regroups[0][3] == {"grow"}
    shard2 = res.steps[2].stages[0].data
    joined = start_state(res.steps[3], 2)
    assert same_tensors(param_tensors(joined), param_tensors(shard2))
    assert state_core(joined) == fresh_state_core(job, 2, 0, 3)
    assert state_core(start_state(res.steps[3], 0)) != fresh_state_core(job, 0, 0, 3)
    assert replay_round(job, 3, 2, [joined]) == [contribution(res.steps[3], 2).data]
    if rule == "eager":  # round 4 starts from the lookahead over the 3 present, none stale
        from trainer.replay import eager_start_matches

        for r in range(3):
            assert eager_start_matches(job, r, start_state(res.steps[4], r), shard2,
                                       contribution(res.steps[3], r).data, None, members=(0, 1, 2))
        for r in range(2):  # and round 2 from the lookahead over the first world's (0, 1)
            assert eager_start_matches(job, r, start_state(res.steps[2], r), res.genesis.stages[0].data,
                                       contribution(res.steps[1], r).data, None, members=(0, 1))
    assert res.steps[4].metrics["tokens"] == (2 * 2 + 3 * 2) * 4 * 2 * 16


def _leave_while_exchanging(emit: Any, rank: int, init: str, again: str) -> None:
    """Rank 0 starts an exchange that rank 1 never joins, then leaves the world and forms
    a new one alone; it emits how long leaving and re-forming took."""
    from trainer.engine import RoundLoop
    from trainer.world import agree_device, init_world

    job = tiny_job(2, 1, 2, min_replicas=1)
    init_world(init, rank, 2, 30)
    control = RankControl(regroup=StoreRegroup(0, rank, 0))  # never called here
    loop = RoundLoop(Topology(rank, 2, 1), job, emit, control, agree_device(job, None))
    if rank == 1:
        time.sleep(10)  # alive, never exchanging: rank 0's exchange thread stays blocked
        return
    loop.diloco._pending = (loop.transport.start_all_gather(b"x" * 1000), 1, b"", None)
    time.sleep(0.5)
    began = time.perf_counter()
    loop._leave()
    init_world(again, 0, 1, 30)
    dist.barrier()
    emit("left", time.perf_counter() - began)
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_exchange_blocked_on_a_live_peer_does_not_hold_up_leaving_the_world() -> None:
    init, again = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with Supervisor() as sup:
        for rank in range(2):
            sup.start(rank, _leave_while_exchanging, (rank, init, again), name=f"leave-{rank}")
        deadline = time.monotonic() + 60
        while (event := sup.next_event()) is None or event[0] != "left":
            assert event is None or event[0] != "error", event
            assert time.monotonic() < deadline
    assert event[1] == 0 and event[2] < 5  # not the 30 s collective timeout, nor rank 1's 10 s


@pytest.mark.slow
def test_a_regroup_below_min_replicas_fails_with_a_clear_error() -> None:
    job = tiny_job(2, 1, 3, min_replicas=2)
    res = Coordinator(job, kill_at=(2, 2, 1)).run()
    assert set(res.errors) == {0}
    assert "membership epoch 1: 1 replica(s) [0] remain, fewer than parallel.min_replicas (2)" in res.errors[0]
    assert sorted(res.steps) == [1]
