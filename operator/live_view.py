"""The live terminal view and the closing report of `keyshift run`.

Turns the coordinator's status snapshots into per-stage rates, busy ratios, queue depths, the
rows an ingest source's clients report due but not pushed yet ("behind") and sink latency
percentiles over a sliding window. Drawn with rich when stdout is a terminal,
printed as plain lines otherwise. Used by `keyshift.operator.cli`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from keyshift.runtime.metrics import quantile_from_buckets

WINDOW_SECONDS = 5.0


@dataclass(frozen=True)
class StageView:
    name: str
    parallelism: int
    rate_in: float
    rate_out: float
    busy: float
    backpressured: float
    queue: int
    state_keys: int
    invalid: int
    total_in: float
    total_out: float
    behind: int = 0  # rows the stage's ingest clients report due but not pushed yet


def _sum(stage: dict[str, Any], key: str) -> float:
    return float(sum(i["stats"].get(key, 0) for i in stage["instances"]))


Instance = tuple[int, str, int]


def _identity(instance: dict[str, Any]) -> Instance:
    """An instance process: a stage index reused after a rescale is a new process."""
    return (instance["index"], str(instance.get("address")), int(instance.get("pid") or 0))


def _grown(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    """How much a counter grew between two snapshots of a stage, instance by instance: an
    instance that retired in between takes its counts with it, and must not count as negative."""
    old = {_identity(i): i["stats"].get(key, 0) for i in before["instances"]}
    return float(sum(i["stats"].get(key, 0) - old.get(_identity(i), 0) for i in after["instances"]))


def _sinks(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's sink stages (one or more)."""
    return [stage for stage in status["stages"] if stage["role"] == "sink"]


def _buckets(status: dict[str, Any]) -> list[int]:
    """The end-to-end latency histogram of every sink instance of every sink, summed."""
    total: list[int] = []
    for instance in (i for sink in _sinks(status) for i in sink["instances"]):
        counts = instance["stats"].get("latency_buckets") or []
        if not counts:
            continue  # an instance that has not reported its histogram yet
        total = [a + b for a, b in zip(total, counts, strict=True)] if total else list(counts)
    return total


class RateTracker:
    """Keeps recent status snapshots and derives rates over the last few seconds."""

    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self.window = window
        self._history: deque[tuple[float, dict[str, Any]]] = deque()
        # The last counters of every instance seen, retired ones included: run totals.
        self._last: dict[str, dict[Instance, dict[str, Any]]] = {}

    def add(self, status: dict[str, Any], now: float) -> None:
        for stage in status["stages"]:
            seen = self._last.setdefault(stage["name"], {})
            for instance in stage["instances"]:
                seen[_identity(instance)] = instance["stats"]
        self._history.append((now, status))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window:
            self._history.popleft()

    def stages(self) -> list[StageView]:
        if not self._history:
            return []
        (t0, old), (t1, new) = self._history[0], self._history[-1]
        span = max(t1 - t0, 1e-9)
        views = []
        for before, after in zip(old["stages"], new["stages"], strict=True):
            n = max(after["parallelism"], 1)
            views.append(
                StageView(
                    name=after["name"],
                    parallelism=after["parallelism"],
                    rate_in=_grown(before, after, "records_in") / span,
                    rate_out=_grown(before, after, "records_out") / span,
                    busy=_grown(before, after, "busy") / span / n,
                    backpressured=_grown(before, after, "backpressured") / span / n,
                    queue=int(_sum(after, "queue")),
                    state_keys=int(_sum(after, "state_keys")),
                    invalid=int(_sum(after, "invalid")),
                    total_in=self.total(after["name"], "records_in"),
                    total_out=self.total(after["name"], "records_out"),
                    behind=int(_sum(after, "client_backlog")),
                )
            )
        return views

    def total(self, stage: str, key: str) -> float:
        """A counter summed over every instance the stage has had in this run."""
        return float(sum(stats.get(key, 0) for stats in self._last.get(stage, {}).values()))

    def latency(self, overall: bool = False) -> tuple[float | None, float | None]:
        """Sink latency (p50, p99) in seconds over the window, or over the whole run."""
        if not self._history:
            return None, None
        new = _buckets(self._history[-1][1])
        old = [] if overall else _buckets(self._history[0][1])
        counts = new
        if old and len(old) == len(new) and all(a >= b for a, b in zip(new, old, strict=True)):
            counts = [a - b for a, b in zip(new, old, strict=True)]
        # else: the sinks restarted (a recovery) and their histograms began again
        return quantile_from_buckets(counts, 0.5), quantile_from_buckets(counts, 0.99)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M/s"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k/s"
    return f"{value:.0f}/s"


def render_table(status: dict[str, Any], tracker: RateTracker, notes: Sequence[str] = ()) -> Table:
    p50, p99 = tracker.latency()
    caption = "\n".join(line for line in (rescale_note(status), *notes) if line)
    table = Table(
        title=f"keyshift job {status['job']} — {status['phase']} — {status['uptime']:.0f} s — "
        f"latency p50 {_ms(p50)} p99 {_ms(p99)}",
        caption=caption or None,
    )
    for column in (
        "stage",
        "parallelism",
        "in",
        "out",
        "busy",
        "backpressured",
        "queue",
        "keys",
        "invalid",
        "behind",
    ):
        table.add_column(column, justify="right" if column != "stage" else "left")
    for s in tracker.stages():
        table.add_row(
            s.name, str(s.parallelism), _rate(s.rate_in), _rate(s.rate_out), f"{s.busy:.0%}",
            f"{s.backpressured:.0%}", str(s.queue), f"{s.state_keys:,}", str(s.invalid),
            f"{s.behind:,}" if s.behind else "",
        )  # fmt: skip
    return table


def rescale_note(status: dict[str, Any]) -> str:
    """A running rescale, or the last one, in a few words, and the stages queued after it."""
    rescale = status.get("rescale") or (status.get("rescales") or [None])[-1]
    if not rescale:
        return ""
    note = (
        f"rescale {rescale['id']} {rescale['stage']} {rescale['from']}->{rescale['to']} "
        f"({rescale['strategy']}): {rescale['phase']}"
    )
    queued = status.get("queued") or []
    if queued:
        note += "; queued: " + ", ".join(f"{r['stage']}->{r['to']}" for r in queued)
    return note


def plain_line(status: dict[str, Any], tracker: RateTracker, notes: Sequence[str] = ()) -> str:
    p50, p99 = tracker.latency()
    parts = [f"[{status['uptime']:6.1f}s {status['phase']}]"]
    if status.get("rescale"):
        parts.append(rescale_note(status))
    for s in tracker.stages():
        behind = f" behind {s.behind:,}" if s.behind else ""
        parts.append(
            f"{s.name} x{s.parallelism} in {_rate(s.rate_in)} busy {s.busy:.0%} q {s.queue}{behind}"
        )
    parts.append(f"latency p50 {_ms(p50)} p99 {_ms(p99)}")
    return " | ".join([*parts, *notes])


class LiveView:
    """Feeds on status snapshots; redraws a rich table, or prints a line every few seconds."""

    def __init__(
        self,
        console: Console,
        enabled: bool = True,
        plain_every: float = 5.0,
        notes: Callable[[], Sequence[str]] = tuple,
    ) -> None:
        self.console = console
        self.notes = notes
        self.tracker = RateTracker()
        self.enabled = enabled
        self.plain_every = plain_every
        self._live: Live | None = None
        self._last_plain = -1e9

    def __enter__(self) -> LiveView:
        if self.enabled and self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def update(self, status: dict[str, Any], now: float) -> None:
        self.tracker.add(status, now)
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(render_table(status, self.tracker, self.notes()))
        elif now - self._last_plain >= self.plain_every:
            self._last_plain = now
            self.console.print(plain_line(status, self.tracker, self.notes()), highlight=False)


def final_report(status: dict[str, Any], tracker: RateTracker, elapsed: float) -> str:
    p50, p99 = tracker.latency(overall=True)
    lines = [f"job {status['job']} {status['phase']} after {elapsed:.1f} s"]
    for stage in status["stages"]:
        total_in = tracker.total(stage["name"], "records_in")
        total_out = tracker.total(stage["name"], "records_out")
        invalid = int(_sum(stage, "invalid"))
        lines.append(
            f"  {stage['name']:<10} x{stage['parallelism']}  in {total_in:>12,.0f}  "
            f"out {total_out:>12,.0f}  avg {_rate(total_in / max(elapsed, 1e-9))}"
            + (f"  rejected {invalid:,}" if invalid else "")
        )
    for sink in _sinks(status):
        ends = [i["stats"].get("output_offset") for i in sink["instances"]]
        if any(end is not None for end in ends):
            lines.append(f"  {sink['name']}: records in its output log, per instance: {ends}")
    lines.append(f"  end-to-end latency p50 {_ms(p50)}  p99 {_ms(p99)}")
    return "\n".join(lines)
