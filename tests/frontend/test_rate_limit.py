"""Per-tenant limits (frontend/rate_limit.py) on a fake clock: no sleeps, no timing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.errors import QueueFullError
from raypaged.frontend.rate_limit import TenantLimiter, TenantLimitError, TokenBucket
from raypaged.frontend.tenants import Tenant, TenantLimits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: FakeClock, priority: int = 0, **limits) -> TenantLimiter:
    return TenantLimiter(Tenant("team-a", TenantLimits(**limits), priority), clock)


def refusal(call) -> TenantLimitError:
    with pytest.raises(TenantLimitError) as error:
        call()
    assert isinstance(error.value, QueueFullError)  # answered 429 / RESOURCE_EXHAUSTED
    return error.value


def test_requests_per_second_allows_the_burst_then_paces():
    clock = FakeClock()
    lim = limiter(clock, requests_per_second=2.0, burst=3)
    grants = [lim.admit(5) for _ in range(3)]
    error = refusal(lambda: lim.admit(5))
    assert error.reason == "requests_per_second" and error.tenant == "team-a"
    assert "rate limit of 2 requests per second (burst 3)" in str(error)
    assert error.retry_after_s == 1.0  # half a request short at 2/s: 0.5 s, rounded up to 1
    refusal(lim.check)  # refused before tokenizing too
    clock.now += 0.5  # one request refilled
    lim.admit(5)
    refusal(lambda: lim.admit(5))
    clock.now += 100  # the bucket holds at most the burst
    for _ in range(3):
        lim.admit(1)
    refusal(lambda: lim.admit(1))
    for grant in grants:
        grant.close()


def test_a_slow_rate_says_when_to_come_back():
    clock = FakeClock()
    lim = limiter(clock, requests_per_second=0.1)  # burst: 1
    lim.admit(1)
    assert refusal(lambda: lim.admit(1)).retry_after_s == 10.0
    clock.now += 4
    assert refusal(lambda: lim.admit(1)).retry_after_s == 6.0


def test_tokens_per_minute_charges_prompts_then_generated_tokens_into_debt():
    clock = FakeClock()
    lim = limiter(clock, tokens_per_minute=600)  # refills 10 tokens a second
    grant = lim.admit(500)
    error = refusal(lambda: lim.admit(200))  # 100 left
    assert error.reason == "tokens_per_minute" and "limit of 600 tokens per minute" in str(error)
    assert error.retry_after_s == 10.0  # 100 short at 10/s
    lim.check()  # not in debt: another prompt may still be tokenized
    grant.on_tokens(300)  # generated tokens are taken whatever the level: 100 - 300 = -200
    assert refusal(lim.check).retry_after_s == 21.0  # 201 tokens short of 1
    clock.now += 20.1
    lim.check()
    refusal(lambda: lim.admit(50))
    clock.now += 5
    lim.admit(50)


def test_a_prompt_larger_than_the_bucket_passes_when_it_is_full():
    clock = FakeClock()
    lim = limiter(clock, tokens_per_minute=60)
    lim.admit(100)  # full bucket: admitted, the rest is debt
    error = refusal(lambda: lim.admit(100))
    assert error.retry_after_s == 100.0  # from -40 to full (60) at 1 token a second
    clock.now += 100
    lim.admit(100)


def test_max_concurrent_counts_requests_in_flight():
    clock = FakeClock()
    lim = limiter(clock, max_concurrent=2)
    first, second = lim.admit(1), lim.admit(1)
    error = refusal(lambda: lim.admit(1))
    assert error.reason == "max_concurrent" and "2 requests in flight" in str(error)
    assert error.retry_after_s == 1.0
    refusal(lim.check)
    first.close()
    first.close()  # idempotent: gives back one place only
    assert lim.in_flight == 1
    third = lim.admit(1)
    refusal(lambda: lim.admit(1))
    second.close()
    third.close()
    assert lim.in_flight == 0


def test_a_refused_request_takes_nothing():
    clock = FakeClock()
    lim = limiter(clock, requests_per_second=1.0, burst=2, tokens_per_minute=60, max_concurrent=5)
    lim.admit(50)
    for _ in range(5):
        refusal(lambda: lim.admit(20))  # 10 tokens left: refused for tokens, not for requests
    assert lim.in_flight == 1
    lim.admit(10)  # the second request of the burst is still there
    assert lim.in_flight == 2


def test_no_limits_admit_everything():
    lim = limiter(FakeClock())
    grants = [lim.admit(10**6) for _ in range(1000)]
    assert lim.in_flight == 1000
    for grant in grants:
        grant.on_tokens(10**6)
        grant.close()
    assert lim.in_flight == 0


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.1, 50), burst=st.integers(1, 20),
       gaps=st.lists(st.floats(0, 2), min_size=1, max_size=60))
def test_admitted_requests_never_pass_burst_plus_rate_times_time(rate, burst, gaps):
    """Over any sequence of arrivals, what a key gets admitted is bounded by the bucket."""
    clock = FakeClock()
    lim = limiter(clock, requests_per_second=rate, burst=burst)
    start, admitted = clock.now, 0
    for gap in gaps:
        clock.now += gap
        try:
            lim.admit(1).close()
            admitted += 1
        except TenantLimitError as e:
            assert e.retry_after_s is not None and e.retry_after_s >= 1
    assert admitted <= burst + rate * (clock.now - start) + 1e-6


def test_bucket_refills_to_its_capacity():
    bucket = TokenBucket(rate_per_s=2.0, capacity=10, now=0.0)
    bucket.take(15, now=0.0)
    assert bucket.level(1.0) == -3.0
    assert bucket.wait_s(1, now=1.0) == 2.0
    assert bucket.level(100.0) == 10
