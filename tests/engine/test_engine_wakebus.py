"""The in-process wake bus: edge-triggered wakes, the subscribe-then-check latch, no leaks, the no-op variant.

Real threads and a real SIGINT; results are asserted by variant and count, never by elapsed time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from smthrs_plugin.engine.wakebus import (
    Delivered,
    Dropped,
    NoopWakeBus,
    TimedOut,
    WakeBus,
    WakeOutcome,
    Woken,
)

# Long enough that a waiter returning Woken cannot have reached it; the test fails (slowly) if a wake is lost.
NEVER = 60.0


def until(predicate: Callable[[], bool], what: str) -> None:
    """Spin until `predicate` holds (a deadline far above any step guards against a hang; nothing is timed)."""
    deadline = time.monotonic() + 120
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.0005)


def start_waiter(
    bus: WakeBus, execution_id: str, results: list[WakeOutcome], done: threading.Event
) -> threading.Thread:
    def run() -> None:
        results.append(bus.await_wake(execution_id, timeout=NEVER))
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_waiter_woken_from_another_thread_returns_woken_before_its_timeout() -> None:
    bus = WakeBus()
    results: list[WakeOutcome] = []
    done = threading.Event()
    t = start_waiter(bus, "run-1", results, done)
    until(lambda: bus.waiters("run-1") == 1, "the waiter registered")
    assert bus.wake("run-1") == Delivered("run-1", 1)
    assert done.wait(NEVER / 2), "the woken waiter did not return"
    t.join()
    assert results == [Woken("run-1")]
    assert bus.waiters("run-1") == 0 and bus.watched() == 0


def test_a_wake_after_subscribing_but_before_wait_still_wakes() -> None:
    # The lost-wakeup rule: subscribe, check durable state, then wait. A wake landing between the check and the
    # wait is latched by the subscription.
    bus = WakeBus()
    with bus.subscribe("run-1") as sub:
        assert bus.wake("run-1") == Delivered("run-1", 1)
        assert sub.wait(timeout=0) == Woken("run-1")  # timeout 0: answered from the latch alone
        assert sub.wait(timeout=0) == TimedOut("run-1", 0.0)  # the latch was consumed


def test_several_wakes_before_a_wait_coalesce_into_one() -> None:
    bus = WakeBus()
    with bus.subscribe("run-1") as sub:
        for _ in range(3):
            bus.wake("run-1")
        assert sub.wait(timeout=0) == Woken("run-1")
        assert isinstance(sub.wait(timeout=0), TimedOut)


def test_a_wake_with_no_waiter_is_dropped_and_not_remembered() -> None:
    bus = WakeBus()
    assert bus.wake("run-1") == Dropped("run-1")
    with bus.subscribe("run-1") as sub:
        assert sub.wait(timeout=0) == TimedOut("run-1", 0.0)
    assert bus.watched() == 0


def test_a_wake_reaches_only_its_own_execution() -> None:
    bus = WakeBus()
    with bus.subscribe("run-1") as one, bus.subscribe("run-2") as two:
        assert bus.wake("run-2") == Delivered("run-2", 1)
        assert isinstance(one.wait(timeout=0), TimedOut)
        assert two.wait(timeout=0) == Woken("run-2")


def test_many_waiters_on_one_execution_all_wake() -> None:
    bus = WakeBus()
    n = 8
    results: list[WakeOutcome] = []
    dones = [threading.Event() for _ in range(n)]
    threads = [start_waiter(bus, "run-1", results, d) for d in dones]
    until(lambda: bus.waiters("run-1") == n, "every waiter registered")
    assert bus.wake("run-1") == Delivered("run-1", n)
    for d in dones:
        assert d.wait(NEVER / 2)
    for t in threads:
        t.join()
    assert results == [Woken("run-1")] * n
    assert bus.waiters("run-1") == 0 and bus.watched() == 0


def test_a_timed_out_wait_leaks_nothing() -> None:
    bus = WakeBus()
    assert bus.await_wake("run-1", timeout=0.01) == TimedOut("run-1", 0.01)
    assert bus.waiters("run-1") == 0
    assert bus.watched() == 0


def test_an_exception_inside_a_subscription_leaks_nothing() -> None:
    bus = WakeBus()
    with pytest.raises(LookupError), bus.subscribe("run-1") as sub:
        assert bus.waiters("run-1") == 1
        raise LookupError("the durable check failed")
    assert sub.closed
    assert bus.waiters("run-1") == 0 and bus.watched() == 0


def test_a_wait_interrupted_by_a_real_sigint_leaks_nothing() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default KeyboardInterrupt handler here")
    bus = WakeBus()

    def interrupt_once_blocked() -> None:
        until(lambda: bus.waiters("run-1") == 1, "the main thread registered")
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt_once_blocked, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        bus.await_wake("run-1", timeout=NEVER)
    t.join()
    assert bus.waiters("run-1") == 0 and bus.watched() == 0


def test_concurrent_subscribers_and_wakers_leave_no_registration_behind() -> None:
    bus = WakeBus()
    ids = [f"run-{i}" for i in range(4)]
    stop = threading.Event()
    outcomes: list[WakeOutcome] = []
    lock = threading.Lock()

    def subscriber(execution_id: str) -> None:
        for _ in range(300):
            with bus.subscribe(execution_id) as sub:
                result = sub.wait(timeout=0)
            with lock:
                outcomes.append(result)

    def waker() -> None:
        while not stop.is_set():
            for execution_id in ids:
                bus.wake(execution_id)

    wakers = [threading.Thread(target=waker) for _ in range(2)]
    subs = [threading.Thread(target=subscriber, args=(i,)) for i in ids]
    for t in wakers + subs:
        t.start()
    for t in subs:
        t.join()
    stop.set()
    for t in wakers:
        t.join()
    assert len(outcomes) == 4 * 300
    assert all(isinstance(o, (Woken, TimedOut)) for o in outcomes)
    assert bus.watched() == 0
    assert all(bus.waiters(i) == 0 for i in ids)


def test_noop_bus_drops_every_wake_so_waits_time_out() -> None:
    bus = NoopWakeBus()
    with bus.subscribe("run-1") as sub:
        assert bus.waiters("run-1") == 1
        assert bus.wake("run-1") == Dropped("run-1")
        assert sub.wait(timeout=0) == TimedOut("run-1", 0.0)

    results: list[WakeOutcome] = []

    def wait_briefly() -> None:
        results.append(bus.await_wake("run-1", timeout=0.05))

    t = threading.Thread(target=wait_briefly)
    t.start()
    until(lambda: bus.waiters("run-1") == 1 or bool(results), "the waiter registered or finished")
    assert bus.wake("run-1") == Dropped("run-1")
    t.join()
    assert results == [TimedOut("run-1", 0.05)]
    assert bus.watched() == 0


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), None, "1", True])
def test_an_unbounded_or_malformed_timeout_is_refused_before_registering(timeout: object) -> None:
    bus = WakeBus()
    with pytest.raises(ValueError, match="timeout"):
        bus.await_wake("run-1", timeout=timeout)  # type: ignore[arg-type]
    assert bus.watched() == 0
    with bus.subscribe("run-1") as sub, pytest.raises(ValueError, match="timeout"):
        sub.wait(timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("execution_id", ["", None, 7])
def test_an_execution_id_must_be_a_non_empty_string(execution_id: object) -> None:
    bus = WakeBus()
    for call in (bus.subscribe, bus.wake, bus.waiters):
        with pytest.raises(ValueError, match="execution_id"):
            call(execution_id)  # type: ignore[arg-type]
    assert bus.watched() == 0


def test_a_closed_subscription_refuses_to_wait_and_closing_twice_is_harmless() -> None:
    bus = WakeBus()
    sub = bus.subscribe("run-1")
    sub.close()
    sub.close()
    assert sub.closed and bus.watched() == 0
    with pytest.raises(RuntimeError, match="closed"):
        sub.wait(timeout=0)
    assert bus.wake("run-1") == Dropped("run-1")
