"""Test-only misbehaviour stays off the production path: the round loop and the sink
import no cheat module, honest runs inject nothing, and `[cheat]` tables become one
injected `trainer.cheat.Cheats` whose hooks act only on their slots and steps."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from trainer import cheat
from trainer.config import load_job
from trainer.engine import RankControl, RankHooks, Topology
from trainer.hooks import unchanged
from workers.jobfile import JobFile
from workers.sink import HONEST

JOB = """
name = "hooks"
[model]
vocab_size = 256
n_layers = 2
[parallel]
replicas = 2
stages = 2
microbatches = 2
[outer]
steps = 3
inner_steps = 2
"""


def job_file(extra: str = "") -> JobFile:
    return load_job(tomllib.loads(JOB + extra), JobFile)


def test_the_round_loop_and_the_sink_import_no_cheat_module() -> None:
    code = ("import sys, trainer.engine, trainer.launch, trainer.replay, workers.sink; "
            "print('trainer.cheat' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_honest_job_injects_nothing_and_the_defaults_are_honest() -> None:
    job = job_file()
    assert cheat.hooks(job.cheat, job) is None
    assert type(RankControl().hooks) is RankHooks
    topo = Topology(3, 2, 2)
    assert RankHooks().publish(topo) is unchanged
    assert RankHooks().cosigned_shard(topo, 1, b"shard", lambda b: b[::-1]) == b"drahs"
    assert (HONEST.stored_shard(2, 0, b"x"), HONEST.stale_parent(2), HONEST.signing_slot(2, 3)) == (b"x", False, 3)


def test_cheats_act_on_their_slot_and_from_their_step_only() -> None:
    job = job_file('[[cheat]]\nmode = "shared_key"\nreplica = 1\nstage = 1\nfrom_step = 2\n'
                   '[[cheat]]\nmode = "stale_parent"\nfrom_step = 3\n'
                   '[[cheat]]\nmode = "wrong_shard"\nreplica = 0\nstage = 1\n')
    hooks = cheat.hooks(job.cheat, job)
    assert isinstance(hooks, cheat.Cheats) and isinstance(hooks, RankHooks)
    assert [hooks.signing_slot(step, 3) for step in (1, 2, 3)] == [3, 1, 1]  # slot (1, 1) signs as (0, 1)
    assert hooks.signing_slot(2, 2) == 2
    assert [hooks.stale_parent(step) for step in (1, 2, 3)] == [False, False, True]
    digest = lambda b: b  # noqa: E731
    assert hooks.cosigned_shard(Topology(1, 2, 2), 1, b"s", digest) != b"s"  # rank 1 = slot (0, 1)
    assert hooks.cosigned_shard(Topology(3, 2, 2), 1, b"s", digest) == b"s"
    assert hooks.publish(Topology(0, 2, 2)) is unchanged  # no poison here


def test_a_cheat_is_never_dumped_with_the_job() -> None:
    job = job_file('[cheat]\nmode = "poison"\nreplica = 1\n')
    assert [c.mode for c in job.cheat] == ["poison"]
    assert "cheat" not in job.model_dump() and "cheat" not in job.training_config().model_dump()
    with pytest.raises(AttributeError):
        job.training_config().cheat  # noqa: B018  (the trainer's own schema has no cheat)
