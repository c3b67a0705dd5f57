"""Test-only misbehaviour stays off the production path: `dlx train`, `dlx worker` and
`dlx verify` (and the round loop and the sink) import no cheat module, the production job
schema has no `[cheat]`, honest runs inject nothing, and, under the tests' extension
(tests/dlx_testing), `[cheat]` tables become one injected `dlx_testing.cheat.Cheats` whose
hooks act only on their slots and steps."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dlx_testing import cheat

from trainer.config import load_job
from trainer.control import RankControl
from trainer.errors import ConfigError
from trainer.hooks import RankHooks, unchanged
from trainer.world import Topology
from workers.run.jobfile import EXTENSION_ENV, JobFile, job_file_class
from workers.run.sink import HONEST

ROOT = Path(__file__).resolve().parent.parent

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


def job_file(extra: str = "") -> cheat.CheatingJobFile:
    return load_job(tomllib.loads(JOB + extra), cheat.CheatingJobFile)


def production_env() -> dict[str, str]:
    """The environment of a production `dlx`: no test extension, tests/ not on the path."""
    env = {k: v for k, v in os.environ.items() if k != EXTENSION_ENV}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow  # not in --quick: three `dlx` processes importing torch
def test_dlx_train_worker_and_verify_load_no_cheat_module(tmp_path: Path) -> None:
    """The modules behind `dlx train` (the CLI, the local runner, the launcher, the round
    loop and its replay, the sink), `dlx worker` (the Celery app and its rank tasks) and `dlx verify` (the
    audit CLI, the verifier and its replays), and a job file read as `dlx train` reads it:
    no module of the attack harness is loaded, and `[cheat]` is an unknown section."""
    job = tmp_path / "job.toml"
    job.write_text(JOB + '[cheat]\nmode = "poison"\n')
    code = (
        "import sys\n"
        "import workers.cli, workers.run.local, workers.queue.tasks, workers.cli.jobs, workers.cli.audit, workers.run.sink\n"
        "import trainer.launch, trainer.engine, trainer.replay, lineage.audit.verify, lineage.audit.replay\n"
        "from workers.run.jobfile import load_job_file, JobFile\n"
        "assert 'cheat' not in JobFile.model_fields\n"
        "try:\n"
        f"    load_job_file({str(job)!r})\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n"
        "print(sorted(m for m in sys.modules if 'cheat' in m or m.startswith('dlx_testing')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=production_env(), cwd=tmp_path)
    refused, loaded = out.stdout.strip().splitlines()
    assert "cheat: unknown section" in refused
    assert loaded == "[]"
    assert not (ROOT / "trainer" / "cheat.py").exists()


def test_the_production_schema_has_no_cheat_and_the_extension_is_test_only(monkeypatch) -> None:
    assert "cheat" not in JobFile.model_fields
    assert load_job(tomllib.loads(JOB), JobFile).test_hooks() is None
    monkeypatch.delenv(EXTENSION_ENV, raising=False)
    assert job_file_class() is JobFile
    with pytest.raises(ConfigError, match="cheat: unknown section"):
        load_job(tomllib.loads(JOB + '[cheat]\nmode = "poison"\n'), job_file_class())
    monkeypatch.setenv(EXTENSION_ENV, "dlx_testing.cheat")
    assert job_file_class() is cheat.CheatingJobFile


def test_an_honest_job_injects_nothing_and_the_defaults_are_honest() -> None:
    job = job_file()
    assert cheat.hooks(job.cheat, job) is None and job.test_hooks() is None
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
