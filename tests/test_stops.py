"""Stops, crashes and resume of `dlx train`, with real processes (the CLI, its ranks, anvil).

Covers: SIGTERM, then SIGINT during a resumed run, each stop every rank at an inner-step
boundary, stop the embedded anvil and leave run.json `stopped` at the chain's head, with no
process of the run left (checked by PID); the stopped run verifies, and `dlx train --resume`
completes it. An embedded anvil killed with SIGKILL after step 3 loses no committed step
(its state file is rewritten after every transaction): the run fails, the restarted chain
holds steps 1-3, verify passes and resume continues; SIGKILL of the `dlx train` parent
leaves no rank or anvil behind and the run resumes to completion. `--resume` of what
cannot resume is one line, exit 2, with nothing changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DLX, small_job_toml

STEPS = 8
INNER = 30  # rounds long enough (about 1 s each) that the ranks do not finish before a stop lands


def train(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen([DLX, "train", *args], stdout=fh, stderr=subprocess.STDOUT)


def dlx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=300)


def record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_steps(run_dir: Path, proc: subprocess.Popen[bytes], steps: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while record(run_dir).get("steps", 0) < steps:
        assert proc.poll() is None, f"dlx train exited with {proc.returncode} before step {steps}"
        assert time.monotonic() < deadline, f"no step {steps} within {timeout} s"
        time.sleep(0.1)


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid` (from /proc), with its command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: dict[int, str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [cmd for p, cmd in pids.items() if running(p)], "processes left behind"


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def is_rank(pid: int, cmd: str, procs: dict[int, str]) -> bool:
    """Spawned, or forked by the warm server (trainer.supervisor.warm_up), whose children
    have its command line."""
    server = "multiprocessing.forkserver"
    return "spawn_main" in cmd or (server in cmd and server in procs.get(parent_of(pid) or 0, ""))


def run_processes(proc: subprocess.Popen[bytes]) -> dict[int, str]:
    """The run's anvil and its ranks, once all are up."""
    deadline = time.monotonic() + 60
    while True:
        procs = descendants(proc.pid)
        anvils = [p for p, cmd in procs.items() if "anvil" in cmd.split(" ", 1)[0]]
        ranks = [p for p, cmd in procs.items() if is_rank(p, cmd, procs)]
        if anvils and len(ranks) >= 2:
            return procs
        assert time.monotonic() < deadline, procs
        time.sleep(0.1)


def verified(run_dir: Path) -> dict:
    """`dlx verify --run-dir RUN_DIR --json`'s report, which must be ok: its audit
    (verify_run) in this process, not an interpreter importing torch and web3 per check."""
    from lineage.audit.verify import verify_run

    report = verify_run(run_dir).as_json()
    assert report["ok"], report
    return report


def chain_steps(run_dir: Path) -> list[int]:
    res = dlx("lineage", "--run-dir", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    return [s["step"] for s in json.loads(res.stdout)["steps"]]


@pytest.fixture()
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(small_job_toml("stops", steps=STEPS, inner_steps=INNER, replicas=2, stages=1))
    return path


def stop_with(proc: subprocess.Popen[bytes], run_dir: Path, sig: signal.Signals, after: int) -> dict:
    """Send `sig` once step `after` is committed; check the stop; returns the verify report
    (one entry per step on chain)."""
    wait_steps(run_dir, proc, after)
    procs = run_processes(proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 128 + sig
    wait_gone(procs)
    rec = record(run_dir)
    assert rec["status"] == "stopped"
    assert after <= rec["steps"] < STEPS
    report = verified(run_dir)  # run.json's head is the chain's (verify checks it)
    assert [s["step"] for s in report["steps"]] == list(range(1, rec["steps"] + 1))
    return report


@pytest.mark.slow
def test_sigterm_and_sigint_stop_at_a_step_boundary_and_resume_completes(job: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(str(job), "--run-dir", str(run_dir), log=tmp_path / "train.log")
    steps = stop_with(proc, run_dir, signal.SIGTERM, after=1)["steps"]
    first = len(steps)
    assert "continue with: dlx train --resume" in (tmp_path / "train.log").read_text()

    # A crash between a commit and run.json's update leaves run.json one step behind: still verifies.
    saved = (run_dir / "run.json").read_text()
    behind = {**json.loads(saved), "status": "running", "steps": first - 1,
              "head": steps[-2]["checkpoint"] if first > 1 else json.loads(saved)["genesis"]}
    (run_dir / "run.json").write_text(json.dumps(behind))
    assert verified(run_dir)["ok"]
    (run_dir / "run.json").write_text(saved)

    proc = train("--resume", str(run_dir), log=tmp_path / "resume.log")
    second = len(stop_with(proc, run_dir, signal.SIGINT, after=first + 1)["steps"])

    res = dlx("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-2000:]
    rec = record(run_dir)
    assert (rec["status"], rec["steps"]) == ("completed", STEPS)
    assert second < STEPS
    # each step committed once, and all verify
    assert [s["step"] for s in verified(run_dir)["steps"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_killed_anvil_keeps_its_steps_and_a_killed_parent_leaves_nothing_behind(job: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = train(str(job), "--run-dir", str(run_dir), log=tmp_path / "train.log")
    wait_steps(run_dir, proc, 3)
    procs = run_processes(proc)
    (anvil,) = [p for p, cmd in procs.items() if "anvil" in cmd.split(" ", 1)[0]]
    os.kill(anvil, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0  # the next commit finds no chain
    wait_gone(procs)
    rec = record(run_dir)
    assert rec["status"] == "failed"
    assert chain_steps(run_dir) == list(range(1, rec["steps"] + 1))  # every committed step came back
    assert rec["steps"] >= 3
    assert verified(run_dir)["ok"]

    proc = train("--resume", str(run_dir), log=tmp_path / "resume.log")
    wait_steps(run_dir, proc, rec["steps"] + 1)
    procs = run_processes(proc)
    proc.kill()
    proc.wait(timeout=30)
    wait_gone(procs)  # ranks (PDEATHSIG) and anvil (SIGTERM when its parent dies)

    res = dlx("train", "--resume", str(run_dir))
    assert res.returncode == 0, res.stderr[-2000:]
    assert record(run_dir)["status"] == "completed"
    assert [s["step"] for s in verified(run_dir)["steps"]] == list(range(1, STEPS + 1))


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_resume_refuses_what_cannot_resume_in_one_line(trained_run, tmp_path: Path) -> None:
    run_dir, _ = trained_run
    before = (run_dir / "run.json").read_bytes()
    cases = {
        (): "give a job file, or --resume RUN_DIR",
        ("job.toml", "--resume", str(run_dir)): "give a job file, or --resume RUN_DIR",
        ("--resume", str(run_dir), "--run-dir", str(tmp_path)): "--run-dir: not with --resume",
        ("--resume", str(tmp_path)): "not a run directory",
        ("--resume", str(run_dir)): "already completed all 3 steps",
    }
    for args, message in cases.items():
        res = subprocess.run([DLX, "train", *args], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.count("\n") == 1 and message in res.stderr, (args, res.stderr)
    assert (run_dir / "run.json").read_bytes() == before


def test_resume_reads_a_relative_init_from_the_job_files_own_directory(tmp_path: Path) -> None:
    """The run directory's copy of the job file resolves `[model] init = "hf"` against the
    directory of the file the run was started with (run.json `job_dir`), not its own."""
    import transformers

    from lineage.chain.runrecord import RunRecord
    from workers.run.local import resumable

    project = tmp_path / "project"
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(project / "hf")
    text = small_job_toml("init", stages=1).replace("[model]\nd_model = 32\nn_layers = 2\nn_heads = 2\n",
                                                    '[model]\nfamily = "llama"\ninit = "hf"\n')
    (project / "job.toml").write_text(text)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.toml").write_text(text)
    RunRecord(name="init", chain_id=31337, rpc=None, chain_state="chain/state.json", registry="0x0",
              ledger="0x0", blocks="blocks", run_id=1, steps=1, status="stopped",
              job_dir=str(project)).save(run_dir)
    _, job = resumable(run_dir)
    assert job.model.init == str((project / "hf").resolve()) and job.model.family == "llama"
