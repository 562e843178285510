"""The NEXMark source of the event-time query jobs' Python twins (q5, q7, q11, closing: Q4
and Q6): one generator instance at 20,000 events/s, up to 50 ms out of order, with a watermark
that allows for it and does not wait on an idle partition. Each twin builds on it, so their job
files agree with the YAML ones (tests/test_nexmark_queries.py compares them)."""

from __future__ import annotations

from keyshift.runtime.pipeline import Stream, source


def timed_events(name: str = "events") -> Stream:
    """The `events` source stage (or another of its kind named `name`), with event time."""
    return source(
        name,
        {
            "kind": "nexmark",
            "seed": 1,
            "event_rate": 10000,
            "max_disorder_ms": 50,
            "profile": {"kind": "constant", "rate": 20000},
        },
        parallelism=1,
        event_time={"max_out_of_orderness_ms": 50, "idle_timeout_ms": 1000},
    )
