"""Failed authentication is throttled per client: after a burst of wrong tokens an
address gets 429 with ``Retry-After``, and a right token from the same address is never
slowed or refused.

Oracles: a real ``dmuon-server`` process and a real HTTP client (httpx); the token
bucket's arithmetic on a clock the test drives.
"""

from __future__ import annotations

import time
from pathlib import Path

from server_helpers import LiveServer

from dmuon_server.http.auth import FailureThrottle

TOKEN = "the-right-token-of-this-test-0123456789"


def test_a_burst_of_wrong_tokens_gets_429_and_the_right_token_still_passes(
    tmp_path: Path,
) -> None:
    server = LiveServer(tmp_path / "d", "--token", TOKEN).start()
    try:
        with server.client() as c:
            codes = []
            right = []
            started_burst = time.perf_counter()
            for i in range(200):
                r = c.get("/v1/jobs", headers={"Authorization": f"Bearer wrong-{i}"})
                codes.append((r.status_code, r.headers.get("retry-after")))
                if i % 10 == 9:
                    started = time.perf_counter()
                    ok = c.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
                    right.append((ok.status_code, time.perf_counter() - started))
            burst_seconds = time.perf_counter() - started_burst
            # The bucket refills one failure a second: on a loaded machine a refill may
            # land first, which this failure spends; the next one is refused.
            for _ in range(5):
                throttled = c.get("/v1/me", headers={"Authorization": "Bearer wrong"})
                if throttled.status_code == 429:
                    break
            assert throttled.status_code == 429
            problem = throttled.json()
            wait = int(throttled.headers["retry-after"])
            time.sleep(wait)
            again = c.get("/v1/me", headers={"Authorization": "Bearer wrong"}).status_code
            no_header = c.get("/v1/me").status_code
    finally:
        server.stop()
    statuses = [code for code, _ in codes]
    # 20 at once, then one a second for as long as the 200 took.
    assert 20 <= statuses.count(401) <= 20 + int(burst_seconds) + 1, (statuses, burst_seconds)
    assert statuses[:20] == [401] * 20
    assert statuses.count(429) == 200 - statuses.count(401)
    assert all(after == "1" for code, after in codes if code == 429)
    assert [code for code, _ in right] == [200] * 20
    assert max(seconds for _, seconds in right) < 2.0
    assert problem["type"].endswith("auth-throttled") and "wait" in problem["detail"]
    assert again == 401  # one failure had refilled
    assert no_header == 429  # a request without a token is a failure too


def test_the_bucket_refills_at_its_rate_and_forgets_idle_clients() -> None:
    now = [0.0]
    throttle = FailureThrottle(burst=3, per_second=0.5, clock=lambda: now[0])
    for _ in range(3):
        assert throttle.retry_after("a") is None
        throttle.failed("a")
    assert throttle.retry_after("a") == 2  # one failure back after 1 / 0.5 s
    assert throttle.retry_after("b") is None  # another client is not held back
    now[0] = 1.0
    assert throttle.retry_after("a") == 1
    now[0] = 2.0
    assert throttle.retry_after("a") is None
    throttle.MAX_CLIENTS = 2
    throttle.failed("b")
    now[0] = 100.0  # both refilled: the next new client makes room
    throttle.failed("c")
    assert set(throttle._buckets) == {"c"}
