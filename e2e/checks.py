"""What the kind end-to-end suite decides, as pure functions of what it observed.

The suite (e2e/test_kind.py, with the cluster and the job watcher of e2e/conftest.py) polls the
StreamingJob and its keyed StatefulSet into `Sample`s, reads Events and the job's output log; the
functions here turn those into answers (has the stage scaled out? is every decision explained?
is every record in the output exactly once?) so they can be unit-tested without a cluster
(tests/test_e2e_files.py). `missing_prerequisites` is why the suite skips on a machine without
Docker or kind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.job import GeneratorSource

TOOLS = ("docker", "kind", "helm", "kubectl")
SCALE_ACTIONS = ("scale_up", "scale_down")
# Every DS2 decision to rescale says what it measured; the suite checks the words are there.
EXPLANATION = "true rate"


def missing_prerequisites(
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> str | None:
    """Why the suite cannot run here, in one line, or None when it can: the four tools must be
    on PATH and `docker info` must reach an engine."""
    missing = [tool for tool in TOOLS if which(tool) is None]
    problems = [f"{', '.join(missing)} not on PATH"] if missing else []
    if "docker" not in missing:
        try:
            info = run(["docker", "info"], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"`docker info` failed: {exc}")
        else:
            if info.returncode != 0:
                lines = [line.strip() for line in (info.stderr or info.stdout).splitlines()]
                why = next((line for line in lines if line), f"exit status {info.returncode}")
                problems.append(f"`docker info` failed: {why}")
    if not problems:
        return None
    return f"needs {', '.join(TOOLS)} and a Docker engine: {'; '.join(problems)}"


# -- the job over time -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One poll of the StreamingJob and its keyed stage's StatefulSet."""

    at: float  # seconds since the job was applied
    phase: str
    ready: bool  # the Ready condition is True
    replicas: int | None  # the keyed StatefulSet's spec.replicas (None before it exists)
    ready_replicas: int
    decisions: tuple[Mapping[str, Any], ...] = ()
    rescales: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def of(
        cls, at: float, job: Mapping[str, Any] | None, stateful_set: Mapping[str, Any] | None
    ) -> Sample:
        status = (job or {}).get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        spec = (stateful_set or {}).get("spec") or {}
        set_status = (stateful_set or {}).get("status") or {}
        return cls(
            at=at,
            phase=str(status.get("phase") or ""),
            ready=ready,
            replicas=int(spec["replicas"]) if stateful_set and "replicas" in spec else None,
            ready_replicas=int(set_status.get("readyReplicas") or 0),
            decisions=tuple(status.get("decisions") or ()),
            rescales=tuple(status.get("rescales") or ()),
        )

    def brief(self) -> str:
        return (
            f"t={self.at:.0f}s phase={self.phase or '-'} ready={self.ready} "
            f"replicas={self.replicas} readyReplicas={self.ready_replicas}"
        )


def ready(samples: Sequence[Sample]) -> Sample | None:
    """The first sample where the job is Ready (the condition, or phase Running)."""
    return next((s for s in samples if s.ready or s.phase == "Running"), None)


def initial_replicas(samples: Sequence[Sample]) -> int | None:
    return next((s.replicas for s in samples if s.replicas is not None), None)


def scaled_out(samples: Sequence[Sample]) -> Sample | None:
    """The first sample whose keyed replicas exceed the initial ones (the scale-out)."""
    start = initial_replicas(samples)
    if start is None:
        return None
    return next((s for s in samples if s.replicas is not None and s.replicas > start), None)


@dataclass(frozen=True)
class ScaleIn:
    peak: Sample  # the most replicas seen before the scale-in
    after: Sample  # the first sample with fewer, while the job still ran


def scaled_in(samples: Sequence[Sample]) -> ScaleIn | None:
    """A scale-in after a scale-out: replicas fall below their peak to at least one while the
    job still runs (a finished job's workers go to zero, which is no scale-in)."""
    start = initial_replicas(samples)
    peak: Sample | None = None
    for sample in samples:
        if sample.replicas is None:
            continue
        if peak is None or sample.replicas > (peak.replicas or 0):
            peak = sample
        elif (
            start is not None
            and (peak.replicas or 0) > start
            and 1 <= sample.replicas < (peak.replicas or 0)
            and sample.phase != "Finished"
        ):
            return ScaleIn(peak, sample)
    return None


def finished(samples: Sequence[Sample]) -> Sample | None:
    return next((s for s in samples if s.phase == "Finished"), None)


def scale_decisions(samples: Iterable[Sample], stage: str) -> list[Mapping[str, Any]]:
    """Every decision to rescale `stage` that any sample's status showed, once each, in order
    (the status keeps only the latest few; the samples together keep them all)."""
    seen: dict[tuple[Any, ...], Mapping[str, Any]] = {}
    for sample in samples:
        for d in sample.decisions:
            if d.get("stage") == stage and d.get("action") in SCALE_ACTIONS:
                key = (d.get("time"), d.get("action"), d.get("from"), d.get("to"))
                seen.setdefault(key, d)
    return [seen[k] for k in sorted(seen, key=lambda k: str(k[0]))]


def replica_values(samples: Iterable[Sample]) -> list[int]:
    """The keyed StatefulSet's replicas as they changed, the initial value first."""
    values: list[int] = []
    for sample in samples:
        if sample.replicas is not None and (not values or values[-1] != sample.replicas):
            values.append(sample.replicas)
    return values


def unexplained(
    decisions: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
    set_name: str,
    replicas: Sequence[int],
) -> list[str]:
    """What the CR status and the Events leave unexplained (empty when all is explained): there
    must be a scale-up and a scale-down; each decision's reason gives the true rate it used and
    was posted as an AutoscalerDecision Event; each replica change the suite saw has a Scaled
    Event (`<set> -> <replicas>`)."""
    problems = []
    actions = {d.get("action") for d in decisions}
    problems += [f"no {a} decision in the status" for a in SCALE_ACTIONS if a not in actions]
    posted = [
        str(e.get("message") or "") for e in events if e.get("reason") == "AutoscalerDecision"
    ]
    for d in decisions:
        reason = str(d.get("reason") or "")
        what = f"{d.get('action')} {d.get('from')}->{d.get('to')} at {d.get('time')}"
        if EXPLANATION not in reason:
            problems.append(f"decision {what} does not give the {EXPLANATION}: {reason!r}")
        if not any(m and (m == reason or reason.startswith(m.rstrip(". "))) for m in posted):
            problems.append(f"decision {what} has no AutoscalerDecision Event: {reason!r}")
    scaled = {str(e.get("message") or "") for e in events if e.get("reason") == "Scaled"}
    for value in replicas[1:]:
        if f"{set_name} -> {value}" not in scaled:
            problems.append(f"no Scaled Event for {set_name} -> {value} (events: {sorted(scaled)})")
    return problems


def rescale_problems(samples: Iterable[Sample], stage: str) -> list[str]:
    """What is wrong with the rescales of `stage` the status showed (empty when all is well):
    there must be a finished scale-out and a finished scale-in, and no failed rescale."""
    seen: dict[Any, Mapping[str, Any]] = {}
    for sample in samples:
        for r in sample.rescales:
            if r.get("stage") == stage:
                seen[r.get("id")] = r  # the latest view of each rescale
    done = [r for r in seen.values() if r.get("phase") == "done"]
    problems = [
        f"rescale {r.get('id')} {r.get('from')}->{r.get('to')} failed: {r.get('error')}"
        for r in seen.values()
        if r.get("phase") == "failed"
    ]
    if not any(int(r["to"]) > int(r["from"]) for r in done):
        problems.append(
            f"no finished scale-out of {stage} in the status (saw {list(seen.values())})"
        )
    if not any(int(r["to"]) < int(r["from"]) for r in done):
        problems.append(
            f"no finished scale-in of {stage} in the status (saw {list(seen.values())})"
        )
    return problems


# -- the output --------------------------------------------------------------------------------


@dataclass
class OutputReport:
    """What the output log holds, and what is wrong with it (nothing, if `problems` is empty)."""

    records: int = 0
    keys: int = 0
    per_source: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def check_output(table: pa.Table, source: GeneratorSource, total: int) -> OutputReport:
    """Exactly once, in order, and the right keys: the output of a job whose keyed stage runs
    examples.lookups:enrich (its value is the key's running count) on a generator source.

    - `total` records, each (source, seq) once, and every source's seqs are 0..n-1;
    - each record's key is the one the generator makes for its (source, seq);
    - per key, the counts are 1..n (every record applied to the key's state exactly once,
      wherever the key lived meanwhile), and applying them in count order applies each
      source's records in seq order.
    """
    report = OutputReport(records=table.num_rows)
    missing = [c for c in ("key", "value", "source", "seq") if c not in table.column_names]
    if missing:
        report.problems.append(f"output has no column {missing} (columns: {table.column_names})")
        return report
    if table.num_rows != total:
        report.problems.append(f"{table.num_rows} records in the output, expected {total}")
    keys = table.column("key").to_numpy().astype(np.int64)
    sources = table.column("source").to_numpy().astype(np.int64)
    seqs = table.column("seq").to_numpy().astype(np.int64)
    counts = pc.cast(table.column("value"), pa.int64()).to_numpy().astype(np.int64)
    report.keys = len(np.unique(keys))

    by_record = np.lexsort((seqs, sources))
    s, q, k = sources[by_record], seqs[by_record], keys[by_record]
    twice = int(np.count_nonzero((s[1:] == s[:-1]) & (q[1:] == q[:-1])))
    if twice:
        report.problems.append(f"{twice} records appear more than once")
    for src in np.unique(s):
        mine = s == src
        n = int(np.count_nonzero(mine))
        report.per_source[int(src)] = n
        if twice:
            continue  # the seqs cannot line up with the generator's; the duplicates are the news
        got = q[mine]
        if not np.array_equal(got, np.arange(n)):
            lost = int(got[-1]) + 1 - n
            report.problems.append(f"source {src}: seqs are not 0..{n - 1} ({lost} missing)")
            continue
        expected = KeyGenerator(source, int(src)).records(0, n)[0]
        wrong = int(np.count_nonzero(k[mine] != expected))
        if wrong:
            report.problems.append(
                f"source {src}: {wrong} records carry a key the generator "
                "did not make for their seq"
            )

    by_count = np.lexsort((counts, keys))
    k2, c2, s2, q2 = keys[by_count], counts[by_count], sources[by_count], seqs[by_count]
    n = len(k2)
    if n:
        starts = np.flatnonzero(np.r_[True, k2[1:] != k2[:-1]])
        first = np.repeat(starts, np.diff(np.r_[starts, n]))
        bad = np.flatnonzero(c2 != np.arange(n) - first + 1)
        if bad.size:
            key = int(k2[bad[0]])
            report.problems.append(
                f"{bad.size} outputs break the count sequence 1..n of their key (first: key "
                f"{key}, counts {c2[k2 == key][:10].tolist()}...)"
            )
        same = (k2[1:] == k2[:-1]) & (s2[1:] == s2[:-1])
        disorder = int(np.count_nonzero(same & (q2[1:] <= q2[:-1])))
        if disorder:
            report.problems.append(f"{disorder} records were applied out of their source's order")
    return report


def committed_spark_files(batches: Iterable[str]) -> list[str]:
    """The names of the files a Spark streaming file sink committed, from the texts of its
    `_spark_metadata` batch files in batch order: a version line, then one JSON entry per file
    (`action` add or delete; a `.compact` batch repeats the earlier ones). Files of a batch that
    failed before its commit are in no entry: readers that skip them see each batch once."""
    committed: dict[str, None] = {}
    for text in batches:
        lines = text.splitlines()
        if not lines or not lines[0].startswith("v"):
            raise ValueError(f"not a Spark file sink metadata batch: {text[:40]!r}")
        for line in lines[1:]:
            entry = json.loads(line)
            name = str(entry["path"]).rstrip("/").rsplit("/", 1)[-1]
            if entry.get("action", "add") == "add":
                committed[name] = None
            else:
                committed.pop(name, None)
    return list(committed)


def same_records(read: pa.Table, log: pa.Table) -> list[str]:
    """What differs between the rows a Spark query read (`partition`, `offset` first) and the
    output log's (`read_all(with_partition=True)`): each (partition, offset) once, all of them,
    with the log's values."""
    problems = []
    if read.num_rows != log.num_rows:
        problems.append(f"the query read {read.num_rows} records, the log holds {log.num_rows}")
    order = [("partition", "ascending"), ("offset", "ascending")]
    read, log = read.sort_by(order), log.sort_by(order)
    pairs = np.stack([read.column(c).to_numpy() for c in ("partition", "offset")], axis=1)
    twice = len(pairs) - len(np.unique(pairs, axis=0))
    if twice:
        problems.append(f"{twice} records read more than once")
    if not problems:
        for column in log.column_names:
            if not read.column(column).equals(
                log.column(column).cast(read.schema.field(column).type)
            ):
                problems.append(f"column {column} differs between the query and the log")
    return problems


# -- after uninstall ---------------------------------------------------------------------------


def leftovers(items: Iterable[Mapping[str, Any]]) -> list[str]:
    """`Kind namespace/name` of each object in a `kubectl get -o json` list."""
    found = []
    for item in items:
        meta = item.get("metadata") or {}
        where = f"{meta['namespace']}/" if meta.get("namespace") else ""
        found.append(f"{item.get('kind')} {where}{meta.get('name')}")
    return sorted(found)
