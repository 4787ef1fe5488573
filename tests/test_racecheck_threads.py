"""racecheck.threads: which host thread of the checker each Python thread is.

The thread that made the checker is HOST; a thread seen starting knows what its starter knew; a
thread met for the first time knows nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from racecheck.clocks import HOST
from racecheck.hb import HappensBefore
from racecheck.threads import HostThreads


def in_thread(work: Callable[[], Any], name: str = "worker") -> tuple[Any, int]:
    """``work()``'s result in a new Python thread, and that thread's ident."""
    result: dict[str, Any] = {}

    def run() -> None:
        result["value"] = work()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return result["value"], thread.ident


def test_the_thread_that_made_it_is_the_host():
    threads = HostThreads(HappensBefore())
    assert threads.current() == HOST
    assert threads.current() == HOST
    assert threads.known(threading.get_ident())


def test_a_thread_met_first_is_added_knowing_nothing():
    hb = HappensBefore()
    s = hb.add_stream("copy")
    copy = hb.enqueue(s, "copy#1")
    hb.host_observes_stream(s)
    threads = HostThreads(hb)
    (index, again), ident = in_thread(lambda: (threads.current(), threads.current()), name="late")
    assert index == again != HOST
    assert index in hb.clocks.hosts
    assert hb.clocks.names[index] == "thread 'late'"
    assert hb.host_has_seen(copy)
    assert not hb.host_has_seen(copy, index)
    assert threads.known(ident)


def test_two_threads_alive_together_are_two_host_threads():
    threads = HostThreads(HappensBefore())
    barrier = threading.Barrier(2, timeout=10)
    found: dict[str, int] = {}

    def run() -> None:
        barrier.wait()  # both alive: their idents differ
        found[threading.current_thread().name] = threads.current()

    workers = [threading.Thread(target=run, name=name) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len({HOST, found["a"], found["b"]}) == 3


class FakeThreading:
    """What racecheck.threads asks of ``threading``, with the asking thread's ident and name set by
    the test: the OS reusing an ident is then deterministic."""

    Lock = threading.Lock

    def __init__(self) -> None:
        self.ident, self.name = 1, "MainThread"
        self.threads: dict[str, Any] = {}

    def get_ident(self) -> int:
        return self.ident

    @property
    def _active(self) -> dict[int, Any]:
        """threading's table of running threads: the asking thread, as the test set it."""
        return {self.ident: self.current_thread()}

    def current_thread(self) -> Any:
        # One object per thread, as threading keeps one: a new name is a new thread.
        return self.threads.setdefault(self.name, SimpleNamespace(name=self.name))


def test_a_thread_met_first_after_another_ended_is_a_new_host_thread(monkeypatch):
    fake = FakeThreading()
    monkeypatch.setattr("racecheck.threads.threading", fake)
    hb = HappensBefore()
    s = hb.add_stream("copy")
    copy = hb.enqueue(s, "copy#1")
    threads = HostThreads(hb)
    fake.ident, fake.name = 2, "first"
    first = threads.current()
    hb.host_observes_stream(s, host=first)
    fake.name = "second"  # "first" ended; the OS gave its ident to a new thread
    second = threads.current()
    assert second != first
    assert not hb.host_has_seen(copy, second)


def test_a_started_thread_knows_what_its_parent_knew():
    hb = HappensBefore()
    s = hb.add_stream("copy")
    copy = hb.enqueue(s, "copy#1")
    hb.host_observes_stream(s)
    threads = HostThreads(hb)
    child = threads.started(parent=threading.get_ident(), child=123456789, name="worker")
    assert hb.clocks.names[child] == "thread 'worker'"
    assert hb.host_has_seen(copy, child)
    assert threads.known(123456789)


def test_a_started_thread_does_not_learn_what_its_parent_sees_later():
    hb = HappensBefore()
    s = hb.add_stream("copy")
    threads = HostThreads(hb)
    child = threads.started(parent=threading.get_ident(), child=123456789, name="worker")
    copy = hb.enqueue(s, "copy#1")
    hb.host_observes_stream(s)
    assert not hb.host_has_seen(copy, child)


def test_a_thread_started_by_an_unknown_parent_knows_nothing():
    hb = HappensBefore()
    s = hb.add_stream("copy")
    copy = hb.enqueue(s, "copy#1")
    hb.host_observes_stream(s)
    threads = HostThreads(hb)
    child = threads.started(parent=987654321, child=123456789, name="orphan")
    assert not hb.host_has_seen(copy, child)


def test_a_real_started_thread_is_that_host_thread_when_it_asks():
    hb = HappensBefore()
    threads = HostThreads(hb)
    ready, go = threading.Event(), threading.Event()
    seen: list[int] = []

    def run() -> None:
        ready.set()
        go.wait(timeout=10)
        seen.append(threads.current())

    thread = threading.Thread(target=run, name="worker")
    thread.start()
    ready.wait(timeout=10)
    index = threads.started(parent=threading.get_ident(), child=thread.ident, name="worker")
    go.set()
    thread.join()
    assert seen == [index]


def test_an_ended_thread_is_forgotten_so_its_ident_can_be_reused():
    threads = HostThreads(HappensBefore())
    index, ident = in_thread(threads.current)
    threads.ended(ident)
    assert not threads.known(ident)
    assert threads.started(parent=threading.get_ident(), child=ident, name="reused") != index


def test_the_host_thread_is_never_forgotten():
    threads = HostThreads(HappensBefore())
    threads.ended(threading.get_ident())
    threads.ended(42)  # unknown: nothing to do
    assert threads.current() == HOST
