"""The worker library's one way to run work in the background (pliant.worker.background): a daemon thread whose
future holds the result or what was raised, which any thread may wait for any number of times."""

from __future__ import annotations

import threading

import pytest

from pliant.worker.background import in_background


def test_the_result_comes_back_to_every_waiter_from_a_named_daemon_thread() -> None:
    seen: dict[str, object] = {}
    release = threading.Event()

    def work() -> int:
        seen["name"], seen["daemon"] = threading.current_thread().name, threading.current_thread().daemon
        release.wait(5)
        return 42

    task = in_background(work, "pliant-test-task")
    assert not task.done()
    release.set()
    assert task.result(timeout=5) == 42 and task.result() == 42
    assert seen == {"name": "pliant-test-task", "daemon": True}


def test_what_the_work_raised_is_raised_to_the_waiter_system_exit_included() -> None:
    def fails() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        in_background(fails, "pliant-test-fails").result(timeout=5)

    def exits() -> None:
        raise SystemExit(3)

    task = in_background(exits, "pliant-test-exits")
    assert isinstance(task.exception(timeout=5), SystemExit)


def test_a_callback_runs_as_the_work_ends_and_at_once_when_it_already_had() -> None:
    ran: list[str] = []
    release = threading.Event()
    task = in_background(lambda: release.wait(5), "pliant-test-callback")
    task.add_done_callback(lambda _t: ran.append(threading.current_thread().name))
    release.set()
    task.result(timeout=5)
    for _ in range(100):
        if ran:
            break
        threading.Event().wait(0.01)
    assert ran == ["pliant-test-callback"]
    task.add_done_callback(lambda _t: ran.append(threading.current_thread().name))
    assert ran[-1] == threading.current_thread().name
