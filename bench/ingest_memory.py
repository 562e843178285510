"""Ingest endpoint memory benchmark: peak RSS growth of the process serving an ingest endpoint
while it takes one JSON push of 3,000,000 rows (~100 MB), the case of issue 19.

Each measurement runs in a fresh Python process that reads the payload from a file, notes its
RSS, hands the push's body to `IngestService.push` (what the gRPC handler calls with the request
bytes), and reports how far its peak RSS grew above that, with the Arrow size of the accepted
rows for scale. Measured: the endpoint as it is (limits raised so the push is taken), the same
with its default limits (the push is refused as too large), and, with `--before COMMIT`, the
endpoint module of an earlier commit (it decoded the whole array to Python objects first).

Run: `.venv/bin/python bench/ingest_memory.py [--before b6326df]` (about a minute).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

ROWS = 3_000_000
FIELDS = {"user": "str", "clicks": "int"}
REPO = Path(__file__).resolve().parent.parent


def write_body(path: Path) -> int:
    """The body of a JSON push of ROWS row objects, written in pieces (no list of them in
    memory); the size of its payload."""
    from keyshift.runtime.ingest import pack_request

    header = pack_request({"format": "json"}, b"")
    with path.open("wb") as out:
        out.write(header)
        out.write(b"[")
        for start in range(0, ROWS, 100_000):
            rows = (
                b'{"user": "u%d", "clicks": %d}' % (i % 100_000, i % 1000)
                for i in range(start, min(ROWS, start + 100_000))
            )
            out.write((b"," if start else b"") + b",".join(rows))
        out.write(b"]")
    return path.stat().st_size - len(header)


def measure(body_file: str, module_file: str | None, raised: bool) -> dict[str, Any]:
    """In this (fresh) process: peak RSS growth while the endpoint takes the push."""
    if module_file is None:
        from keyshift.runtime import ingest
    else:
        spec = importlib.util.spec_from_file_location("ingest_before", module_file)
        assert spec is not None and spec.loader is not None
        ingest = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = ingest  # its dataclasses look their module up there
        spec.loader.exec_module(ingest)
    kwargs: dict[str, Any] = {}
    if raised:
        kwargs["limits"] = ingest.IngestLimits(ROWS, 256 << 20, 256 << 20)
    service = ingest.IngestService(FIELDS, 0, 4, lambda *_: None, **kwargs)
    body = Path(body_file).read_bytes()
    rss = psutil.Process().memory_info().rss
    try:
        reply: dict[str, Any] = service.push(body)
    except ingest.IngestRefused as exc:
        reply = {"refused": str(exc)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    batch = service.take(0)
    return {
        "rss_before_mb": round(rss / 1e6),
        "peak_growth_mb": round(max(0, peak - rss) / 1e6),
        "arrow_mb": round(batch.nbytes / 1e6) if batch is not None else 0,
        "reply": reply,
    }


def run_child(body: Path, module_file: str | None, raised: bool) -> dict[str, Any]:
    args = [sys.executable, __file__, "--child", str(body), "--module", module_file or ""]
    out = subprocess.run(
        [*args, *(["--raised"] if raised else [])], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"the measurement failed:\n{out.stderr}")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="also measure runtime/ingest.py of this commit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--module", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raised", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.module or None, args.raised)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "push.bin"
        size = write_body(body)
        results: dict[str, Any] = {"rows": ROWS, "payload_mb": round(size / 1e6)}
        results["now_limits_raised"] = run_child(body, None, raised=True)
        results["now_default_limits"] = run_child(body, None, raised=False)
        if args.before:
            before = Path(tmp) / "ingest_before.py"
            source = subprocess.run(
                ["git", "show", f"{args.before}:runtime/ingest.py"],
                cwd=REPO, capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            before.write_text(source)
            results[f"before_{args.before}"] = run_child(body, str(before), raised=False)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
