"""DynamicBatcher without processes: when a batch goes, how requests are sliced and answered, what an error does."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from roboscale.errors import WorkerError
from roboscale.rollout.batcher import DynamicBatcher


class Replies:
    """Collects each request's reply, in the order they came."""

    def __init__(self, expected: int = 0) -> None:
        self.got: dict[str, tuple] = {}
        self.twice: list[str] = []
        self.lock = threading.Lock()
        self.expected = expected
        self.all_in = threading.Event()

    def to(self, name: str):
        def reply(outputs, error):
            with self.lock:
                if name in self.got:
                    self.twice.append(name)
                self.got[name] = (outputs, error)
                if len(self.got) == self.expected:
                    self.all_in.set()

        return reply


@contextlib.contextmanager
def serving(batcher: DynamicBatcher):
    """A serving thread (the model's), for as long as the block runs."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            batcher.run_once(timeout=0.05)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()


def recording_predict(calls: list):
    def predict(items):
        calls.append(list(items))
        return [10 * x for x in items]

    return predict


def test_a_full_batch_goes_at_once_without_waiting_for_the_timeout():
    calls, replies = [], Replies()
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=4, batch_timeout_ms=60_000)
    batcher.submit([1, 2], replies.to("a"))
    batcher.submit([3, 4], replies.to("b"))
    start = time.monotonic()
    assert batcher.run_once(timeout=5)
    assert time.monotonic() - start < 5  # a minute-long timeout was not waited for
    assert calls == [[1, 2, 3, 4]]
    assert replies.got == {"a": ([10, 20], None), "b": ([30, 40], None)}


def test_a_partial_batch_goes_after_the_timeout_with_whatever_arrived_meanwhile():
    calls, replies = [], Replies()
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=8, batch_timeout_ms=300)
    batcher.submit([1], replies.to("a"))
    late = threading.Timer(0.05, batcher.submit, ([2, 3], replies.to("b")))  # arrives within the first's window
    late.start()
    start = time.monotonic()
    assert batcher.run_once(timeout=5)
    elapsed = time.monotonic() - start
    late.join()
    assert 0.25 <= elapsed < 5  # waited for more, up to the timeout counted from the first request
    assert calls == [[1, 2, 3]]
    assert replies.got == {"a": ([10], None), "b": ([20, 30], None)}


def test_nothing_waiting_returns_after_the_timeout():
    batcher = DynamicBatcher(recording_predict([]), max_batch_size=2, batch_timeout_ms=0)
    assert not batcher.run_once(timeout=0.01)
    assert batcher.stats().calls == 0


def test_an_oversize_request_is_sliced_and_answered_once_with_all_its_outputs_in_order():
    calls, replies = [], Replies()
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=4, batch_timeout_ms=0)
    batcher.submit(list(range(10)), replies.to("big"))
    batcher.submit([100], replies.to("small"))
    while batcher.run_once(timeout=0):
        pass
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100]]  # the last batch shares the big one's tail
    assert replies.got == {"big": ([10 * i for i in range(10)], None), "small": ([1000], None)}
    stats = batcher.stats()
    assert (stats.calls, stats.items, dict(stats.sizes)) == (3, 11, {4: 2, 3: 1})
    assert batcher.take_stats().calls == 3 and batcher.stats().calls == 0  # since the last take


def test_requests_from_many_threads_each_get_exactly_their_own_outputs():
    requests = {f"r{i}": [1000 * i + j for j in range(1 + i % 7)] for i in range(60)}
    calls, replies = [], Replies(expected=len(requests))
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=5, batch_timeout_ms=2)

    def client(names):
        for name in names:
            batcher.submit(requests[name], replies.to(name))

    with serving(batcher):
        clients = [threading.Thread(target=client, args=(list(requests)[k::4],)) for k in range(4)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        assert replies.all_in.wait(timeout=30) and not replies.twice
    assert replies.got == {name: ([10 * x for x in items], None) for name, items in requests.items()}
    assert all(len(call) <= 5 for call in calls)
    assert sum(len(call) for call in calls) == sum(len(items) for items in requests.values())
    assert max(len(call) for call in calls) > 1  # it did batch across requests


def test_an_error_in_predict_reaches_every_caller_of_that_batch_and_the_serving_thread_goes_on():
    def predict(items):
        if "bad" in items:
            raise ValueError("the model diverged")
        return [x.upper() for x in items]

    batcher = DynamicBatcher(predict, max_batch_size=3, batch_timeout_ms=50)
    replies = Replies(expected=2)
    batcher.submit(["a", "bad"], replies.to("first"))
    batcher.submit(["b", "c"], replies.to("second"))  # its first item shares the failing batch, its last does not
    with serving(batcher) as server:
        assert replies.all_in.wait(timeout=30)
        for name in ("first", "second"):
            outputs, error = replies.got[name]
            assert outputs is None and isinstance(error, ValueError) and "diverged" in str(error)
        later = Replies(expected=1)
        batcher.submit(["d"], later.to("third"))
        assert later.all_in.wait(timeout=30) and later.got["third"] == (["D"], None)
        assert server.is_alive() and not replies.twice
    assert batcher.stats().calls == 2  # the rest of the failed request was dropped, not predicted


def test_predict_returning_the_wrong_number_of_outputs_is_an_error_for_the_callers():
    replies = Replies()
    batcher = DynamicBatcher(lambda items: items[:-1], max_batch_size=4, batch_timeout_ms=0)
    batcher.submit([1, 2], replies.to("a"))
    batcher.run_once(timeout=0)
    outputs, error = replies.got["a"]
    assert outputs is None and isinstance(error, WorkerError) and "1 outputs for 2 items" in str(error)


def test_close_answers_what_waits_and_refuses_what_comes():
    replies = Replies()
    batcher = DynamicBatcher(recording_predict([]), max_batch_size=4, batch_timeout_ms=0)
    batcher.submit([1], replies.to("waiting"))
    batcher.close()
    batcher.submit([2], replies.to("late"))
    assert not batcher.run_once(timeout=0)
    for name in ("waiting", "late"):
        assert replies.got[name][0] is None and "closed" in str(replies.got[name][1])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatcher(recording_predict([]), max_batch_size=0, batch_timeout_ms=1)
    with pytest.raises(ValueError, match="producers"):
        DynamicBatcher(recording_predict([]), max_batch_size=4, batch_timeout_ms=1, producers=-1)


class SteppingClock:
    """A clock that moves ``step`` seconds each time it is read: deadlines pass without anyone sleeping."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_batch_goes_at_once_when_every_producer_has_a_request_waiting():
    """Nothing more can come before these are answered: waiting out a minute-long timeout would only idle."""
    calls, replies = [], Replies()
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=32, batch_timeout_ms=60_000, producers=2)
    batcher.submit([1, 2], replies.to("worker0"))
    batcher.submit([3], replies.to("worker1"))
    start = time.monotonic()
    assert batcher.run_once(timeout=5)
    assert time.monotonic() - start < 5
    assert calls == [[1, 2, 3]] and replies.got == {"worker0": ([10, 20], None), "worker1": ([30], None)}
    assert batcher.stats().reasons == {"all_waiting": 1}


def test_with_a_producer_missing_the_batch_waits_for_the_timeout():
    clock = SteppingClock(0.004)
    calls, replies = [], Replies()
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=32, batch_timeout_ms=10, producers=3,
                             clock=clock)
    batcher.submit([1], replies.to("worker0"))
    batcher.submit([2], replies.to("worker1"))
    assert batcher.run_once(timeout=5)
    assert calls == [[1, 2]] and batcher.stats().reasons == {"timeout": 1}
    assert batcher.stats().fill_s > 0  # and the time it held them back is counted


def test_fewer_producers_let_the_waiting_requests_go_at_once():
    """The last episodes of a run: a group that ran out of episodes will not ask again."""
    calls = []
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=32, batch_timeout_ms=60_000, producers=3)
    batcher.submit([1], Replies().to("worker0"))
    batcher.submit([2], Replies().to("worker1"))
    batcher.set_producers(2)
    start = time.monotonic()
    assert batcher.run_once(timeout=5)
    assert time.monotonic() - start < 5
    assert calls == [[1, 2]] and batcher.stats().reasons == {"all_waiting": 1}


def test_a_full_batch_goes_before_every_producer_has_sent():
    calls = []
    batcher = DynamicBatcher(recording_predict(calls), max_batch_size=2, batch_timeout_ms=60_000, producers=4)
    batcher.submit([1, 2, 3], Replies().to("big"))
    assert batcher.run_once(timeout=5)
    assert calls == [[1, 2]] and batcher.stats().reasons == {"full": 1}


def test_unknown_producers_never_dispatch_early():
    """producers=None (a websocket server: callers come and go): only size and timeout decide."""
    clock = SteppingClock(0.004)
    batcher = DynamicBatcher(recording_predict([]), max_batch_size=32, batch_timeout_ms=10, clock=clock)
    batcher.submit([1], Replies().to("a"))
    assert batcher.run_once(timeout=5)
    assert batcher.stats().reasons == {"timeout": 1}
