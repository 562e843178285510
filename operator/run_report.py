"""The report of a run: input rate, parallelism and latency over time, decisions marked (PNG).

`keyshift run --report FILE` feeds a `Timeline` from every status snapshot the live view sees
and writes the chart when the job has drained. Used by `keyshift.operator.cli`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyshift.operator.live_view import RateTracker
from keyshift.policies.model import Decision


@dataclass
class Timeline:
    started: float
    keyed_stage: str
    times: list[float] = field(default_factory=list)
    input_rate: list[float] = field(default_factory=list)
    parallelism: list[int] = field(default_factory=list)
    latency_p99: list[float | None] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)

    def add(self, now: float, status: dict[str, Any], tracker: RateTracker) -> None:
        stages = tracker.stages()
        if not stages:
            return
        keyed = next((s for s in stages if s.name == self.keyed_stage), stages[0])
        self.times.append(now - self.started)
        self.input_rate.append(stages[0].rate_in)
        self.parallelism.append(keyed.parallelism)
        self.latency_p99.append(tracker.latency()[1])

    def decided(self, now: float, decisions: list[Decision]) -> None:
        self.decisions += [(now - self.started, d) for d in decisions if d.action != "hold"]


def write_png(timeline: Timeline, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none needed for a file
    import matplotlib.pyplot as plt

    fig, (rate_ax, par_ax, lat_ax) = plt.subplots(3, 1, sharex=True, figsize=(10, 8))
    t = timeline.times
    rate_ax.plot(t, [r / 1000 for r in timeline.input_rate], color="tab:blue")
    rate_ax.set_ylabel("input (k records/s)")
    par_ax.step(t, timeline.parallelism, where="post", color="tab:green")
    par_ax.set_ylabel(f"{timeline.keyed_stage} parallelism")
    par_ax.set_ylim(0, max([*timeline.parallelism, 1]) + 1)
    lat_ax.plot(t, [(v or 0.0) * 1000 for v in timeline.latency_p99], color="tab:red", label="p99")
    lat_ax.set_ylabel("latency p99 (ms)")
    lat_ax.set_xlabel("seconds since start")
    for at, decision in timeline.decisions:
        for ax in (rate_ax, par_ax, lat_ax):
            ax.axvline(at, color="grey", linestyle="--", linewidth=0.8)
        par_ax.annotate(
            f"{decision.current}→{decision.target}",
            (at, decision.target),
            textcoords="offset points",
            xytext=(3, 3),
            fontsize=8,
        )
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
