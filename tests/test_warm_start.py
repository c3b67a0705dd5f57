"""Start-up of local runs: a warm Supervisor forks its children from a server that has
imported torch and the trainer once (trainer.supervisor.warm_up), with the launcher's
environment, and they die with the launcher as spawned children do; the launcher itself
(`dlx train`'s process) imports no torch on a CPU-only install.

Each case runs its launcher in a fresh interpreter: the warm server is one per process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_job_toml

TESTS = str(Path(__file__).resolve().parent)


def report(emit) -> None:
    """A child's work: what it found loaded and set when its work began."""
    emit("progress", {"torch": "torch" in sys.modules, "mark": os.environ.get("DLX_TEST_MARK"),
                      "late": os.environ.get("DLX_TEST_LATE"), "ppid": os.getppid()})


def sleeps(emit) -> None:
    emit("progress", os.getpid())
    time.sleep(120)


def launcher(mode: str) -> None:
    """Run in a fresh interpreter (see `_launch`): prints one JSON line per event."""
    from trainer.supervisor import Supervisor, warm_up

    warm_up()
    if mode == "late-env":
        os.environ["DLX_TEST_LATE"] = "set after the warm-up"
    sup = Supervisor(warm=True)
    sup.start(0, sleeps if mode == "sleep" else report, (), name="dlx-test-0")
    while (event := sup.next_event(60)) is not None:
        print(json.dumps({"warm": sup.warm, "pid": os.getpid(), "kind": event[0], "payload": event[2]}), flush=True)
        if event[0] != "progress" or mode != "sleep":
            break
        time.sleep(120)  # the test kills this launcher now
    sup.close()


def _launch(mode: str, **kwargs) -> subprocess.Popen[str]:
    code = f"import sys; sys.path.insert(0, {TESTS!r}); from test_warm_start import launcher; launcher({mode!r})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "DLX_TEST_MARK": "from the launcher"}, **kwargs)


def _first_event(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the launcher printed nothing (exit code {proc.wait(30)})"
    return json.loads(line)


@pytest.mark.slow
def test_a_warm_child_starts_with_torch_loaded_and_the_launchers_environment() -> None:
    proc = _launch("report")
    event = _first_event(proc)
    assert proc.wait(60) == 0
    assert event["warm"] and event["kind"] == "progress"
    assert event["payload"]["torch"]  # imported by the server, before the child's work began
    assert event["payload"]["mark"] == "from the launcher"
    assert event["payload"]["ppid"] != event["pid"]  # forked by the server, not by the launcher


@pytest.mark.slow
def test_an_environment_changed_after_the_warm_up_spawns_instead() -> None:
    proc = _launch("late-env")
    event = _first_event(proc)
    assert proc.wait(60) == 0
    assert not event["warm"]  # the server imported torch under the old environment
    assert event["payload"]["late"] == "set after the warm-up"
    assert event["payload"]["ppid"] == event["pid"]


@pytest.mark.slow
def test_a_killed_launcher_takes_its_warm_children_with_it() -> None:
    proc = _launch("sleep")
    event = _first_event(proc)
    child = event["payload"]
    assert event["warm"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError(f"the warm child {child} outlived its killed launcher by 30 s")


def test_the_launcher_imports_no_torch_on_a_cpu_only_install() -> None:
    code = ("import sys, tomllib; from workers.cli import app; import workers.run.local, workers.run.sink; "
            "from trainer.launch import _torch_has_gpu_build, check_local; from trainer.config import load_job; "
            f"job = load_job(tomllib.loads({small_job_toml('startup')!r})); "
            "import json; print(json.dumps([check_local(job), 'torch' in sys.modules, _torch_has_gpu_build()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    device, torch_loaded, gpu_build = json.loads(out.stdout.splitlines()[-1])
    assert device.startswith(("cpu", "cuda"))
    if not gpu_build:
        assert not torch_loaded, device  # else a CUDA or ROCm torch is asked for its GPUs


def test_the_gpu_count_read_without_torch_is_torchs() -> None:
    import torch

    from trainer.launch import gpu_count

    assert gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
