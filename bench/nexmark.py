"""NEXMark benchmark: events/s per query at full speed, and Q5's and Q8's latency through a
live 1 -> 2 rescale of their heaviest keyed stage, hot-first against all-at-once.

Every query runs its shipped job file (examples/nexmark/qN.yaml, read as it is now) with one
instance per stage and the output log replaced by a discarding sink (`format: none`).

Throughput: each query with its source unpaced (as fast as the pipeline takes), alternated
`--rounds` times; events/s is the source's own counter of events made (`records_in`) over a
window after a warm-up, and beside it each process's busy / backpressured share, which says
which process is the limit. The generator alone (`keyshift.runtime.nexmark.events` in this
process, batches of the job's size) is measured too: the ceiling of any query.

Latency: Q5 and Q8 paced at 65 % of their median full-speed rate; per strategy (hot-first,
all-at-once) and round, alternated, a fresh job: warm-up, a steady window, a live rescale
1 -> 2 of the keyed stage that was the busiest at full speed, a tail. Latency is what
bench/rescale.py measures: each sink batch's worst ingest -> sink time, the ingest time being
when the record fell due on the source's schedule (a window's result carries the time it
fired). Reported per run: steady p50/p99, p99/max in [rescale start, end + 1 s], and the
ratio of the two p99s of that same run (target for hot-first: <= 3).

Writes bench/reports/nexmark.json (all numbers and the latency series) and nexmark.png.
Run from the repository root (the job files name functions of examples.nexmark):
`.venv/bin/python bench/nexmark.py` (quick, about 4 minutes) or `--full` (about 15).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rescale import (
    TARGET_P99_FACTOR,
    WINDOW_TAIL,
    Probe,
    ScheduleLag,
    all_stats,
    baseline_source,
    binned_max,
    keyed_stats,
    package_tree,
    rescale,
    say,
    start_job,
    usage,
    window_stats,
)

from keyshift.operator.local_host import COORDINATOR_SERVICE, RunError
from keyshift.runtime import nexmark
from keyshift.runtime.job import Batching, NexmarkSource
from keyshift.runtime.transport import JsonClient, TransportError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "nexmark"
QUERIES = ("q0", "q1", "q2", "q3", "q3_ttl", "q4", "q5", "q6", "q7", "q8", "q11")
JOINS = frozenset({"q3", "q3_ttl", "q8"})  # the issue's "Q3/Q8's joins"
TARGET = 500_000
JOIN_TARGET = 250_000
LATENCY_QUERIES = ("q5", "q8")
STRATEGIES = ("hot-first", "all-at-once")
LOAD_SHARE = 0.65
SOURCE, SINK = "events", "out"  # the stage names every job file uses
FLOW_TIMEOUT = 60.0
GENERATOR_SECONDS = 1.0
# (throughput warm-up, window; latency warm-up, steady, tail after the rescale; rounds)
MODES = {"quick": (4.0, 6.0, 6.0, 6.0, 4.0, 1), "full": (8.0, 12.0, 10.0, 10.0, 6.0, 2)}
LATENCY_BIN = 0.25  # seconds per point of the chart's latency lines (max of the bin)


def query_job(query: str, rate: float | None) -> dict[str, Any]:
    """The query's job file with one instance per stage, a discarding sink, and its source
    unpaced (`rate` None) or at a constant `rate` events/s."""
    job: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{query}.yaml").read_text())
    for node in job["graph"]:
        if node["kind"] == "sink":
            node["config"] = {"kind": "log", "format": "none"}
            continue
        node["parallelism"] = 1  # map/filter stages run chained in the source's process
        if node["kind"] == "source":
            node["config"].pop("profile", None)
            if rate is not None:
                node["config"]["profile"] = {"kind": "constant", "rate": rate}
    job["name"] = f"bench-{job['name']}"
    return job


def keyed_names(job: dict[str, Any]) -> list[str]:
    return [n["name"] for n in job["graph"] if n["kind"] == "keyed"]


def wait_flowing(probe: Probe, keyed: str) -> None:
    probe.until(
        lambda s: (
            s["phase"] == "running" and keyed_stats(s, keyed).get(0, {}).get("records_in", 0) > 0
        ),
        FLOW_TIMEOUT,
        f"records to reach {keyed}",
    )


def full_speed(query: str, warmup: float, window: float, root: Path) -> dict[str, Any]:
    """Events/s through the query at full speed, and every process's share of busy time."""
    job = query_job(query, None)
    work = Path(tempfile.mkdtemp(prefix=f"{query}-", dir=root))
    with start_job(job, work) as local:
        probe = Probe(local, time.time(), SOURCE, SINK)
        local.start()
        wait_flowing(probe, keyed_names(job)[0])
        probe.run_for(warmup)
        before = all_stats(probe.poll())
        probe.run_for(window)
        after = all_stats(probe.poll())
    shutil.rmtree(work, ignore_errors=True)
    used = usage(before, after)
    return {"events_per_s": used[f"{SOURCE}/0"]["records_in_per_s"], "usage": used}


def measure_tree(
    package: Path | None, query: str, warmup: float, window: float, root: Path
) -> dict[str, Any]:
    """`full_speed` of `query` with this tree's runtime; or, given another tree's `package`
    folder, in a subprocess with it first on PYTHONPATH (the instances inherit it, so the
    whole job runs that code; the job files are this tree's)."""
    if package is None:
        return full_speed(query, warmup, window, root)
    done = subprocess.run(
        [sys.executable, __file__, "--one", query, "--warmup", str(warmup), "--window",
         str(window)],
        env={**os.environ, "PYTHONPATH": str(package)}, cwd=REPO, capture_output=True,
        text=True, timeout=warmup + window + 2 * FLOW_TIMEOUT, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{query} on {package} failed:\n{done.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def generator_alone(batch: int, seconds: float) -> float:
    """Events/s of the NEXMark generator alone in this process (the job files' model)."""
    config = yaml.safe_load((EXAMPLES / "q5.yaml").read_text())["graph"][0]["config"]
    model = NexmarkSource.model_validate(config).model()
    made, seq = 0, 0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        nexmark.events(model, nexmark.event_numbers(0, 1, seq, batch))
        seq += batch
        made += batch
    return made / (time.perf_counter() - began)


def heaviest(result: dict[str, Any], keyed: list[str]) -> str:
    """The keyed stage with the largest busy share at full speed."""
    return max(keyed, key=lambda name: result["usage"].get(f"{name}/0", {}).get("busy", 0.0))


def latency_run(
    query: str,
    stage: str,
    strategy: str,
    rate: float,
    times: tuple[float, float, float],
    root: Path,
    round_: int,
) -> dict[str, Any]:
    """A fresh paced job: warm-up, steady window, a live 1 -> 2 rescale of `stage`, a tail."""
    warmup, steady, tail = times
    job = query_job(query, rate)
    work = Path(tempfile.mkdtemp(prefix=f"{query}-{strategy}-", dir=root))
    report: dict[str, Any] = {
        "query": query, "stage": stage, "strategy": strategy, "rate": rate, "round": round_
    }  # fmt: skip
    report["load_average_at_start"] = round(os.getloadavg()[0], 2)
    began = time.time()
    with start_job(job, work) as local:
        probe = Probe(local, began, SOURCE, SINK)
        try:
            local.start()
            wait_flowing(probe, stage)
            probe.run_for(warmup)
            steady_from = time.time()
            before = all_stats(probe.poll())
            probe.run_for(steady)
            report["steady_usage"] = usage(before, all_stats(probe.status))
            # Below 1 the source fell behind R: latency then grows with its backlog.
            made = report["steady_usage"][f"{SOURCE}/0"]["records_in_per_s"]
            report["steady_share_of_rate"] = round(made / rate, 3)
            client = JsonClient(local.address, COORDINATOR_SERVICE, local.security)
            try:
                moved = rescale(probe, client, 2, strategy, keyed=stage)
            finally:
                client.close()
            probe.run_for(tail)
            lag = ScheduleLag(probe, rate, (steady_from, began + moved["start"]), time.time())
            report["steady"] = window_stats(probe, lag, steady_from, began + moved["start"])
            kept = ("phase", "start", "end", "duration_s", "mb_moved", "keys_moved",
                    "records_parked", "state_keys_at_start")  # fmt: skip
            during = (began + moved["start"], began + moved["end"] + WINDOW_TAIL)
            report["rescale"] = {k: moved[k] for k in kept} | window_stats(probe, lag, *during)
            steady_p99, during_p99 = report["steady"]["p99_ms"], report["rescale"]["p99_ms"]
            report["p99_ratio"] = (
                round(during_p99 / steady_p99, 2) if steady_p99 and during_p99 else None
            )
        except (RunError, TransportError) as exc:
            report["error"] = str(exc)
            say(f"{query} {strategy}: FAILED: {exc}")
        report["series"] = {
            "t": [round(t - began, 4) for t, _ in sorted(probe.latency.items())],
            "latency_ms": [round(v * 1e3, 3) for _, v in sorted(probe.latency.items())],
        }
    if "error" not in report:
        shutil.rmtree(work, ignore_errors=True)  # logs of failed runs are kept
    return report


def summarize_throughput(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    found = {}
    for query, results in runs.items():
        rate = statistics.median(r["events_per_s"] for r in results)
        target = JOIN_TARGET if query in JOINS else TARGET
        found[query] = {
            "events_per_s": round(rate),
            "rounds_events_per_s": [r["events_per_s"] for r in results],
            "target_events_per_s": target,
            "target_met": rate >= target,
            "usage_last_round": results[-1]["usage"],
        }
    return found


def latency_targets(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per query: hot-first's rescale p99 against its own steady p99, every run."""
    found = []
    for query in dict.fromkeys(r["query"] for r in reports):
        hot = [r for r in reports if r["query"] == query and r["strategy"] == "hot-first"]
        ratios = [r.get("p99_ratio") for r in hot]
        met = bool(hot) and all(x is not None and x <= TARGET_P99_FACTOR for x in ratios)
        found.append({"query": query, "hot_first_p99_ratios": ratios, "target_met": met})
    return found


def plot(
    throughput: dict[str, Any], reports: list[dict[str, Any]], generator: float, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queries = list(dict.fromkeys(r["query"] for r in reports if "rescale" in r))
    fig, axes = plt.subplots(1 + len(queries), 1, figsize=(11, 3.6 * (1 + len(queries))))
    axes = np.atleast_1d(axes)
    names = list(throughput)
    rates = [throughput[q]["events_per_s"] / 1e3 for q in names]
    colors = ["C2" if throughput[q]["target_met"] else "C3" for q in names]
    axes[0].bar(names, rates, color=colors)
    for i, q in enumerate(names):
        axes[0].plot([i - 0.4, i + 0.4], [throughput[q]["target_events_per_s"] / 1e3] * 2, "k--")
    axes[0].axhline(generator / 1e3, color="C0", lw=1, ls=":", label="generator alone")
    axes[0].set_ylabel("events/s (thousands)")
    axes[0].set_title(
        "NEXMark at full speed, one instance per stage (green: target met, red: missed; "
        "dashed: target)",
        fontsize=9,
    )
    axes[0].legend(fontsize=8)
    for ax, query in zip(axes[1:], queries, strict=True):
        runs = [r for r in reports if r["query"] == query and "rescale" in r]
        for r in runs:
            zero = r["rescale"]["start"]
            t = np.asarray(r["series"]["t"]) - zero
            v = np.asarray(r["series"]["latency_ms"], dtype=float)
            color = f"C{STRATEGIES.index(r['strategy'])}"
            if len(t):
                bt, bmax = binned_max(t, v, LATENCY_BIN)
                label = f"{r['strategy']} {r['round'] + 1}: p99 x{r.get('p99_ratio')}"
                style = "-" if r["round"] == 0 else "--"
                ax.plot(bt, np.maximum(bmax, 0.1), lw=1, color=color, ls=style, label=label)
            ax.axvspan(0, r["rescale"]["end"] - zero, color=color, alpha=0.1)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_ylabel("worst latency per sink batch (ms)", fontsize=8)
        ax.set_xlabel("seconds since the rescale started (shaded: until it ended)", fontsize=8)
        ax.set_title(
            f"{query} at {runs[0]['rate']:,.0f} events/s: live 1→2 rescale of '{runs[0]['stage']}'",
            fontsize=9,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def brief(result: dict[str, Any]) -> dict[str, Any]:
    """What the README records of a run: the numbers without the series and usage details."""
    latency = []
    for r in result["latency"]:
        row = {"query": r["query"], "strategy": r["strategy"], "round": r["round"] + 1}
        if "rescale" in r:
            s, w = r["steady"], r["rescale"]
            row |= {"rate": r["rate"], "kept_up": r["steady_share_of_rate"],
                    "steady_p50_ms": s["p50_ms"], "steady_p99_ms": s["p99_ms"],
                    "rescale_s": w["duration_s"], "rescale_p99_ms": w["p99_ms"],
                    "rescale_max_ms": w["max_ms"], "p99_ratio": r["p99_ratio"]}  # fmt: skip
        else:
            row["error"] = r["error"]
        latency.append(row)
    return {
        "load_average_1m": result["machine"]["load_average_1m"],
        "generator_alone_events_per_s": result["generator_alone_events_per_s"],
        "throughput": {
            q: {k: v for k, v in t.items() if k != "usage_last_round"}
            for q, t in result["throughput"].items()
        },
        "baseline": result["baseline"],
        "latency": latency,
        "latency_targets": result["latency_targets"],
    }


def is_commit(revision: str) -> bool:
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True, check=False, timeout=30,
    )  # fmt: skip
    return found.returncode == 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="longer windows, two rounds each")
    parser.add_argument("--queries", default=",".join(QUERIES), help="throughput: comma list")
    parser.add_argument(
        "--latency-queries", default=",".join(LATENCY_QUERIES), help="comma list ('' skips)"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list")
    parser.add_argument("--warmup", type=float, help="throughput warm-up seconds")
    parser.add_argument("--window", type=float, help="throughput window seconds")
    parser.add_argument(
        "--steady", type=float, help="latency: seconds of warm-up, steady window and tail, each"
    )
    parser.add_argument("--rounds", type=int, help="times each query / strategy runs")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "reports")
    parser.add_argument(
        "--baseline",
        help="a git revision: also measure every query's full speed on its runtime, "
        "alternated with this tree's in each round (an A/B of a change)",
    )
    parser.add_argument("--one", choices=QUERIES, help=argparse.SUPPRESS)  # measure_tree's
    args = parser.parse_args()
    split = {
        name: [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        for name in ("queries", "latency_queries", "strategies")
    }
    for name, allowed in (
        ("queries", QUERIES),
        ("latency_queries", QUERIES),
        ("strategies", STRATEGIES),
    ):
        unknown = sorted(set(split[name]) - set(allowed))
        if unknown:
            parser.error(f"unknown {name.replace('_', '-')} {unknown}: choose from {allowed}")
        setattr(args, name, split[name])
    if not args.queries:
        parser.error("--queries names no query")
    missing = sorted(set(args.latency_queries) - set(args.queries))
    if missing:
        parser.error(f"latency queries {missing} need their full-speed rate: add to --queries")
    if args.baseline and not is_commit(args.baseline):
        parser.error(f"--baseline {args.baseline!r} is not a commit of this repository")
    warmup, window, lat_warmup, steady, tail, rounds = MODES["full" if args.full else "quick"]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.window = window if args.window is None else args.window
    args.latency_times = (lat_warmup, steady, tail) if args.steady is None else (args.steady,) * 3
    args.rounds = rounds if args.rounds is None else args.rounds
    if args.rounds < 1 or args.window <= 0 or args.warmup < 0 or min(args.latency_times) <= 0:
        parser.error("--rounds must be >= 1, --window and --steady > 0, --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    # The job files name functions of examples.nexmark: this process checks them, and the
    # instances (which append their working directory to sys.path) run them.
    os.chdir(REPO)
    sys.path.append(str(REPO))
    root = Path(tempfile.mkdtemp(prefix="keyshift-bench-nexmark-"))
    if args.one:
        print(json.dumps(full_speed(args.one, args.warmup, args.window, root)))
        shutil.rmtree(root, ignore_errors=True)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    trees: dict[str, Path | None] = {"current": None}
    if args.baseline:
        old = baseline_source(root / "baseline-src", args.baseline)
        trees = {"baseline": package_tree(old, root / "baseline-pkg"), "current": None}
    load = [round(os.getloadavg()[0], 2)]
    say(f"work dir {root}; load average {load[0]} on {os.cpu_count()} cores")
    batch = Batching().max_records
    generator = generator_alone(batch, GENERATOR_SECONDS)
    say(f"generator alone: {generator:,.0f} events/s ({batch}-event batches, this process)")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        tree: {q: [] for q in args.queries} for tree in trees
    }
    for round_ in range(args.rounds):
        for query in args.queries:
            # Alternated: which tree goes first changes every round.
            for tree in list(trees)[:: 1 if round_ % 2 == 0 else -1]:
                result = measure_tree(trees[tree], query, args.warmup, args.window, root)
                runs[tree][query].append(result)
                busy = ", ".join(f"{n} {u['busy']:.0%}" for n, u in result["usage"].items())
                say(
                    f"round {round_ + 1} {query} ({tree}): {result['events_per_s']:,} events/s "
                    f"(busy: {busy})"
                )
    load.append(round(os.getloadavg()[0], 2))
    throughput = summarize_throughput(runs["current"])
    baseline = None
    if args.baseline:
        before = summarize_throughput(runs["baseline"])
        baseline = {
            "revision": args.baseline,
            "events_per_s": {q: t["events_per_s"] for q, t in before.items()},
            "rounds_events_per_s": {q: t["rounds_events_per_s"] for q, t in before.items()},
            "current_over_baseline": {
                q: round(throughput[q]["events_per_s"] / max(t["events_per_s"], 1), 2)
                for q, t in before.items()
            },
        }
    reports: list[dict[str, Any]] = []
    for query in args.latency_queries:
        rate = round(LOAD_SHARE * throughput[query]["events_per_s"])
        stage = heaviest(runs["current"][query][-1], keyed_names(query_job(query, None)))
        for round_ in range(args.rounds):
            for strategy in args.strategies:
                r = latency_run(query, stage, strategy, rate, args.latency_times, root, round_)
                reports.append(r)
                if "rescale" in r:
                    s, w = r["steady"], r["rescale"]
                    say(
                        f"{query} {strategy} round {round_ + 1} at {rate:,} events/s "
                        f"({r['steady_share_of_rate']:.0%} of it made): steady "
                        f"p50/p99 {s['p50_ms']}/{s['p99_ms']} ms; 1->2 of {stage} {w['phase']} "
                        f"in {w['duration_s']} s, p99/max {w['p99_ms']}/{w['max_ms']} ms "
                        f"(p99 x{r['p99_ratio']})"
                    )
    load.append(round(os.getloadavg()[0], 2))
    result = {
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_average_1m": load},
        "mode": "full" if args.full else "quick",
        "config": {
            "warmup_s": args.warmup,
            "window_s": args.window,
            "latency_warmup_steady_tail_s": args.latency_times,
            "rounds": args.rounds,
            "batching": Batching().model_dump(),
            "load_share": LOAD_SHARE,
        },
        "generator_alone_events_per_s": round(generator),
        "throughput": throughput,
        "baseline": baseline,
        "latency_targets": latency_targets(reports),
        "latency": reports,
    }
    (args.out_dir / "nexmark.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(throughput, reports, generator, args.out_dir / "nexmark.png")
    print(json.dumps(brief(result), indent=1))
    failed = [r for r in reports if "error" in r]
    if not failed:
        shutil.rmtree(root, ignore_errors=True)
    say(f"wrote {args.out_dir / 'nexmark.json'} and {args.out_dir / 'nexmark.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
