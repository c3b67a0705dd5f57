"""trainer.supervisor: what spawned children report to their parent, through the one
event queue every launcher (local runs, replays, the queue's rank tasks) reads."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainer.supervisor import ChildOptions, Supervisor, exit_note


def emits_then_ends(emit, value: int) -> None:
    emit("progress", value)
    emit("progress", value + 1)


def raises(emit) -> None:
    raise ValueError("a  bad\nvalue")


def sleeps(emit) -> None:
    time.sleep(60)


def cancelled(emit) -> None:
    from trainer.errors import Cancelled

    raise Cancelled("stopped at outer step 2, inner step 3")


def writes_output(emit) -> None:
    print("from the child", flush=True)
    os.write(2, b"native stderr\n")


def events_until(sup: Supervisor, kinds: set[str], timeout_s: float = 60.0) -> list[tuple]:
    """Every event up to and including the first whose kind is in `kinds`."""
    out: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = sup.next_event()
        if event is not None:
            out.append(event)
            if event[0] in kinds:
                return out
    raise AssertionError(f"no {kinds} event within {timeout_s} s: {out}")


@pytest.mark.slow
def test_a_child_reports_its_events_in_order_then_done() -> None:
    with Supervisor() as sup:
        sup.start(3, emits_then_ends, (10,), name="dlx-test-3")
        assert events_until(sup, {"done"}) == [("progress", 3, 10), ("progress", 3, 11), ("done", 3, None)]
        sup.join()
        assert sup.dead() == []


@pytest.mark.slow
def test_a_failure_is_one_line_with_where_it_was_raised_unless_asked_not_to() -> None:
    with Supervisor() as sup:
        sup.start(0, raises, (), name="dlx-test-0")
        sup.start(1, raises, (), name="dlx-test-1", options=ChildOptions(where=False))
        errors = {}
        for _ in range(2):
            kind, rank, text = events_until(sup, {"error"})[-1]
            errors[rank] = text
    assert errors[0].startswith("ValueError: a bad value (test_supervisor.py:") and errors[0].endswith(")")
    assert errors[1] == "ValueError: a bad value"


@pytest.mark.slow
def test_a_cooperative_stop_is_reported_as_cancelled() -> None:
    with Supervisor() as sup:
        sup.start(0, cancelled, (), name="dlx-test-0")
        assert events_until(sup, {"cancelled", "error"})[-1] == (
            "cancelled", 0, "stopped at outer step 2, inner step 3")


@pytest.mark.slow
def test_a_killed_child_is_dead_without_a_word_and_close_stops_the_rest() -> None:
    sup = Supervisor()
    victim = sup.start(0, sleeps, (), name="dlx-test-0")
    other = sup.start(1, sleeps, (), name="dlx-test-1")
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    assert sup.dead() == [(0, -9)]
    assert exit_note(-9) == "process exited with code -9 (SIGKILL)"
    assert sup.next_event(0.2) is None
    sup.close()
    assert not other.is_alive()


@pytest.mark.slow
def test_a_child_can_write_its_output_to_a_log_file(tmp_path) -> None:
    log = tmp_path / "logs" / "rank-0.log"
    with Supervisor() as sup:
        sup.start(0, writes_output, (), name="dlx-test-0", options=ChildOptions(log=str(log)))
        events_until(sup, {"done"})
    lines = log.read_text().splitlines()  # the rank's own lines between its start and end (trainer.supervisor.say)
    assert "rank 0: started (pid" in lines[0] and lines[-1].endswith(" rank 0: done")
    assert lines[1:-1] == ["from the child", "native stderr"]
