"""The scheduler: slots handed out in the given order, FIFO admission under the token budget,
a prompt held until running requests leave, bad settings refused."""
from __future__ import annotations

import pytest

from tpinv.engine import Request, Scheduler
from tpinv.engine.scheduler import SequenceState


def state(n, rid="x"):
    return SequenceState(Request(rid, [1] * n), [1] * n)


def test_scheduler_slots_fifo_and_token_budget():
    s = Scheduler(3, token_budget=10, slot_order=[2, 0, 1])
    a, b, c, d, e = (state(n, rid) for n, rid in ((4, "a"), (5, "b"), (3, "c"), (20, "d"), (2, "e")))
    for r in (a, b, c, d, e):
        s.add(r)
    ids = lambda states: [r.request.request_id for r in states]  # noqa: E731
    first = s.admit()                              # a (4) + b (5) = 9 <= 10; c would make 12
    assert ids(first) == ["a", "b"] and [r.slot for r in first] == [2, 0]
    assert ids(s.admit()) == ["c"]                 # 2 decode tokens + 3 = 5; then no free slot
    s.release(a)
    s.release(b)
    big = s.admit()                                # d (20 > the whole budget) runs as the only prompt of its step
    assert ids(big) == ["d"] and big[0].slot == 2
    assert ids(s.admit()) == ["e"] and e.slot == 0  # 2 decode tokens + 2 = 4
    assert s.has_work() and not s.waiting
    with pytest.raises(ValueError, match="does not hold slot"):
        s.release(state(1, "stranger"))


def test_scheduler_holds_a_prompt_until_running_requests_leave():
    s = Scheduler(2, token_budget=6)
    x, y = state(6, "x"), state(6, "y")
    s.add(x)
    s.add(y)
    assert s.admit() == [x]
    assert s.admit() == []                         # 1 decode token + 6 > 6: y waits though a slot is free
    s.release(x)
    assert s.admit() == [y] and y.slot == 0        # the freed slot is reused
    s.release(y)
    assert not s.has_work()


@pytest.mark.parametrize("kwargs,match", [(dict(max_batch=0), "max_batch"),
                                          (dict(max_batch=2, token_budget=1), "token_budget"),
                                          (dict(max_batch=2, slot_order=[0, 0]), "permutation")])
def test_scheduler_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(**kwargs)
