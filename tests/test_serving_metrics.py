"""The Prometheus registry: what one request's report adds, and the text exposition."""

from __future__ import annotations

import pytest

from kvhandoff.serving.metrics import ServingMetrics

pytestmark = pytest.mark.timeout(30)


def report(status, mapped, cached, source="small", target="large"):
    return {"status": status, "from": source if status != "none" else None, "to": target, "mapped_tokens": mapped,
            "cached_tokens": cached, "read_tokens": 3, "prompt_tokens": cached + 3, "guard": None,
            "milliseconds": 1.0}


def test_reports_count_handoffs_tokens_and_first_token_times():
    metrics = ServingMetrics()
    metrics.record_first_token(report("applied", 40, 50), 0.02)
    metrics.record_first_token(report("fallback", 40, 0), 0.5)
    metrics.record_first_token(report("none", 0, 12), 0.01)
    metrics.record_first_token(report("reprefill", 0, 0), 0.4)
    value = metrics.registry.get_sample_value
    assert value("kvhandoff_handoffs_total", {"from": "small", "to": "large", "status": "applied"}) == 1
    assert value("kvhandoff_handoffs_total", {"from": "small", "to": "large", "status": "fallback"}) == 1
    assert value("kvhandoff_handoffs_total", {"from": "small", "to": "large", "status": "reprefill"}) == 1
    assert value("kvhandoff_mapped_tokens_total", {"from": "small", "to": "large"}) == 80
    assert value("kvhandoff_guard_fallbacks_total", {"from": "small", "to": "large"}) == 1
    assert value("kvhandoff_prefill_tokens_avoided_total", {"kind": "mapped"}) == 40
    assert value("kvhandoff_prefill_tokens_avoided_total", {"kind": "own"}) == 10 + 12
    for status in ("applied", "fallback", "reprefill", "none"):
        assert value("kvhandoff_time_to_first_token_seconds_count", {"status": status}) == 1
    metrics.track(lambda: 3, lambda: 4096)
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain") and "kvhandoff_live_sessions 3.0" in text
    assert "kvhandoff_cache_bytes 4096.0" in text and "# TYPE kvhandoff_evictions_total counter" in text


def test_each_engine_has_its_own_registry():
    first, second = ServingMetrics(), ServingMetrics()
    first.cancelled.inc()
    assert second.registry.get_sample_value("kvhandoff_cancelled_total") == 0
