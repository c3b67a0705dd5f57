"""One process supervisor for everything that runs ranks in spawned processes: local runs
(`trainer.launch`), replays (`trainer.replay`) and the job queue's rank tasks
(workers/queue/tasks.py).

    with Supervisor() as sup:
        sup.start(train_rank, (rank, world, init_method, job, control), name="dlx-rank-0")
        event = sup.next_event()          # (kind, rank, payload) or None after POLL_S
        ...

The parent side: a spawn context, one event queue every child writes to, `dead()` for
children that exited without a word, `stop()` that terminates then kills. The child side:
`child_main` wraps a work function so that every child ignores what it must, dies with
its parent, reports ("error", rank, one line) for any exception, ("cancelled", rank, why)
for a cooperative stop and ("done", rank, None) at the end, and skips interpreter teardown.
Work functions get an `Emitter` (`emit(kind, payload)` puts (kind, rank, payload)).

`Supervisor(warm=True)` forks its children from a warm server (multiprocessing's
forkserver) that has imported `WARM_MODULES` once, instead of spawning fresh interpreters
that each import torch: about 4 s of CPU per rank process otherwise. `warm_up()` starts
that server early, so its imports overlap the launcher's own work.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "PEER_LOSS_MARKERS",
    "POLL_S",
    "SILENT",
    "WARM_MODULES",
    "ChildOptions",
    "Emitter",
    "Event",
    "Supervisor",
    "child_main",
    "exit_note",
    "peer_loss",
    "warm_up",
]

POLL_S = 0.2
STOP_GRACE_S = 5.0  # after terminate(), how long a child may take before it is killed
SILENT = "process exited with code"  # how a child that died without a word is described

Event = tuple[str, int, Any]  # (kind, rank, payload)
# How gloo and the c10d store describe a lost or unreachable peer (matched case-blind): in
# a rank's own error, the echo of another's death rather than a cause of its own.
PEER_LOSS_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "timed out",
    "socket closed",
    "gloo connectfullmesh",
    "connection refused",
)


# What a rank (or a replay process) imports before its first step, imported once by the
# warm server: torch with the trainer (2.1 s), torch._dynamo and torch._inductor (1.7 s:
# torch.optim's first optimizer and torch.use_deterministic_algorithms import them) and
# pipelining (multi-stage ranks).
WARM_MODULES = ("trainer.launch", "trainer.engine", "trainer.replay", "torch._dynamo", "torch._inductor.config",
                "torch.distributed.pipelining")
# Environment variables that differ from one moment to the next without bearing on what a
# child computes (pytest names the running test in one): they never make a warm server stale.
_BOOKKEEPING_ENV = frozenset({"PYTEST_CURRENT_TEST"})
_warm_env: dict[str, str] | None = None  # the environment the warm server was started in


def _env_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _BOOKKEEPING_ENV}


def warm_up(also: tuple[str, ...] = ()) -> None:
    """Start the warm server (in the background; its imports take a few seconds) if it is
    not running: a launcher calls this as early as it can, so the imports overlap its own
    work, naming in `also` the modules its children import beyond `WARM_MODULES` (the first
    call's list counts). The server serves this process's warm Supervisors for as long as
    the environment stays the one it was started in (libraries read some variables at import)."""
    global _warm_env
    from multiprocessing import forkserver

    if _warm_env is None:
        forkserver.set_forkserver_preload([*WARM_MODULES, *also])
        _warm_env = _env_key()
        atexit.register(_stop_warm_server)
    if _env_key() == _warm_env:
        forkserver.ensure_running()


def _stop_warm_server() -> None:
    """At exit: kill the warm server at once, even in the middle of its imports. It holds
    this process's stdout and stderr (its children write there), so a caller reading them
    to the end would otherwise wait for those imports after a command that failed early.
    Its children die with it (`die_with_parent`); a launcher has stopped its own by then."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _context(warm: bool) -> Any:
    """The warm server's context if asked for and the environment is still the one it was
    started in (started here if need be); otherwise spawn's."""
    if warm:
        warm_up()
        if _env_key() == _warm_env:
            return mp.get_context("forkserver")
    return mp.get_context("spawn")


def peer_loss(text: str) -> bool:
    """Whether an error's text says a peer was lost (`PEER_LOSS_MARKERS`)."""
    low = text.lower()
    return any(marker in low for marker in PEER_LOSS_MARKERS)


class Emitter:
    """Picklable: a child's `emit(kind, payload)`, which puts (kind, rank, payload) on the
    supervisor's queue."""

    def __init__(self, events: Any, rank: int) -> None:
        self.events, self.rank = events, rank

    def __call__(self, kind: str, payload: Any) -> None:
        self.events.put((kind, self.rank, payload))


class EchoEmitter(Emitter):
    """A child whose output goes to a log file of its own (`ChildOptions.log`: a queue
    job's rank): every event is also written there as one line, so the log shows the
    rank's training as it happens (global rank 0 reports inner steps and outer steps;
    every rank its contributions and re-formed worlds)."""

    def __call__(self, kind: str, payload: Any) -> None:
        super().__call__(kind, payload)
        line = echo_line(kind, payload)
        if line:
            say(self.rank, line)


def say(rank: int, text: str) -> None:
    """One timestamped line of a rank's log (its stdout, line-buffered: `output_to`)."""
    sys.stdout.write(f"{time.strftime('%H:%M:%S')} rank {rank}: {text}\n")
    sys.stdout.flush()


def echo_line(kind: str, payload: Any) -> str:
    """What a rank's log says about one of its events ("" for none)."""
    if kind == "progress":
        return (f"outer step {payload.outer_step}/{payload.outer_steps} inner {payload.inner_step}/"
                f"{payload.inner_steps} loss {payload.loss:.4f} lr {payload.lr:.3g}")
    if kind == "step":
        ev = payload.metrics.get("eval_loss")
        return f"outer step {payload.step} done" + (f", eval loss {ev:.4f}" if ev is not None else "")
    if kind == "contribution":
        step, contribution = payload
        return f"outer step {step}: contribution ready, loss {contribution.loss:.4f}"
    if kind == "genesis":
        return "genesis shards ready"
    if kind == "epoch":
        return f"world re-formed: epoch {payload['epoch']}, rank {payload['rank']}, replicas {payload['members']}"
    return ""


@dataclass(frozen=True)
class ChildOptions:
    """How a child starts before its work: `log` (append stdout and stderr to this file),
    `netns` (enter this network namespace before any socket), `ignore_sigint` (the
    launcher decides how ranks stop, so a Ctrl-C never kills one mid-step), `where`
    (end an error line with the file:line it was raised at) and `env` (the launcher's
    environment, for a child forked from the warm server: set by `Supervisor.start`)."""

    log: str | None = None
    netns: str | None = None
    ignore_sigint: bool = False
    where: bool = True
    env: dict[str, str] | None = None


def child_main(events: Any, rank: int, work: Callable[..., None], args: tuple[Any, ...],
               options: ChildOptions = ChildOptions()) -> None:
    """The body of every supervised child: `work(emit, *args)`, every outcome reported on
    `events` (see the module docstring); never returns."""
    from trainer.errors import Cancelled

    if options.env is not None:  # forked from the warm server: the launcher's environment, as a spawned child has
        os.environ.clear()
        os.environ.update(options.env)
        _release_warm_server()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if options.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    emit = Emitter(events, rank)
    if options.log is not None:
        output_to(options.log)
        emit = EchoEmitter(events, rank)
        say(rank, f"started (pid {os.getpid()})")
    if options.netns is not None:  # before any socket: the replica's shaped namespace
        from trainer.netns import enter_netns

        enter_netns(options.netns)
    try:
        work(emit, *args)
    except Cancelled as exc:
        if options.log is not None:
            say(rank, f"cancelled: {exc}")
        events.put(("cancelled", rank, str(exc)))
        exit_quietly(events, 0)
    except BaseException as exc:  # every failure, even SystemExit, must reach the parent
        if options.log is not None:
            traceback.print_exc()  # the whole story in the rank's log; the parent gets one line
        events.put(("error", rank, error_line(exc, options.where)))
        exit_quietly(events, 1)
    if options.log is not None:
        say(rank, "done")
    events.put(("done", rank, None))
    exit_quietly(events, 0)


def error_line(exc: BaseException, where: bool = True) -> str:
    """`Type: message` on one line, with the file:line it was raised at when `where`."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ and where else []
    return text + (f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else "")


def _release_warm_server() -> None:
    """In a child forked from the warm server: close the child's end of the pipe the
    server watches. The server exits when every holder has closed it, and holding it would
    keep the server alive after the launcher dies, and with it this child (whose parent,
    for `die_with_parent`, is the server)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies, so a killed
    launcher or worker never leaves an orphan rank training on."""
    if sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def output_to(path: str) -> None:
    """Send this process's stdout and stderr (Python's and native libraries' alike) to
    `path`, appended: the job queue keeps each rank's output in a file of its own."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # not writable on this host: the output stays with the launcher's
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line-buffered, so `dlx logs --follow` sees each line as it is written and a killed
    # rank loses none; fresh objects, since a launcher (Celery) may have replaced the
    # originals with proxies that write elsewhere.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115


def exit_quietly(events: Any, code: int) -> None:
    """Flush our events to the parent, then skip interpreter teardown: tearing down torch
    (dynamo, gloo threads) takes seconds per process and there is nothing left to save."""
    events.close()
    events.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_note(code: int) -> str:
    """How a child that exited with `code` and no report is described."""
    if code < 0:
        try:
            return f"{SILENT} {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"{SILENT} {code}"


class Supervisor:
    """Spawned children sharing one event queue; a context manager that stops them all and
    closes the queue on exit. Children are numbered in start order (`dead()` names them so).
    `warm`: fork them from the warm server (`warm_up`), where the environment allows."""

    def __init__(self, *, warm: bool = False) -> None:
        self.ctx = _context(warm)
        self.warm = self.ctx.get_start_method() == "forkserver"
        self.events = self.ctx.Queue()
        self.procs: list[Any] = []

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, rank: int, work: Callable[..., None], args: tuple[Any, ...], *, name: str,
              options: ChildOptions = ChildOptions(), daemon: bool = True) -> Any:
        """Spawn a child running `child_main(events, rank, work, args, options)`."""
        if self.warm:
            options = replace(options, env=dict(os.environ))
        proc = self.ctx.Process(target=child_main, args=(self.events, rank, work, args, options),
                                name=name, daemon=daemon)
        proc.start()
        self.procs.append(proc)
        return proc

    def next_event(self, timeout: float = POLL_S) -> Event | None:
        """The next event any child sent, or None after `timeout` seconds."""
        try:
            event: Event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        return event

    def drain(self, timeout: float = 0.05) -> list[Event]:
        """Every event already sent (waiting at most `timeout` for each next one)."""
        out = []
        while (event := self.next_event(timeout)) is not None:
            out.append(event)
        return out

    def dead(self) -> list[tuple[int, int]]:
        """(child index, exit code) of every child that exited with a non-zero code."""
        return [(i, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode not in (None, 0)]

    def join(self) -> None:
        for p in self.procs:
            p.join()

    def stop(self, *, kill: bool = False) -> None:
        """Terminate (or `kill`) every child still alive, then kill any that outlives
        STOP_GRACE_S."""
        for p in self.procs:
            if p.is_alive():
                p.kill() if kill else p.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def close(self, *, kill: bool = False) -> None:
        """Stop (or `kill`) every child and close the queue without waiting for unread events."""
        self.stop(kill=kill)
        self.events.close()
        self.events.cancel_join_thread()
