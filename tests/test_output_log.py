"""Tests of the sink's output log (keyshift.runtime.output_log), a full disk (a small tmpfs)
included."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.log_retention import LogRetention
from keyshift.runtime.output_log import (
    TRIMMED_FILE,
    OutputLogError,
    OutputLogReader,
    OutputLogWriter,
    OutputStorageError,
    commit_reader,
    encode_jsonl,
    reader_offsets,
    segment_file_name,
)
from tests.small_disk import fill, small_disk

FORMATS = ["jsonl", "parquet"]


def batch(start: int, n: int) -> pa.RecordBatch:
    """Records whose key is their global index, so offsets can be checked against values."""
    keys = list(range(start, start + n))
    values = [k * 0.5 for k in keys]
    return pa.record_batch(
        {"key": pa.array(keys, pa.int64()), "value": pa.array(values, pa.float64())}
    )


def segment_names(part_dir: Path) -> list[str]:
    return sorted(p.name for p in part_dir.iterdir())


@pytest.mark.parametrize("fmt", FORMATS)
def test_offsets_contiguous_across_appends_and_segment_rolls(tmp_path: Path, fmt: str) -> None:
    w = OutputLogWriter(tmp_path, 0, fmt, segment_records=10)
    firsts = []
    total = 0
    for n in [3, 7, 0, 12, 25, 1, 4]:
        firsts.append(w.append(batch(total, n)))
        total += n
        assert w.end_offset == total
    assert firsts == [0, 3, 10, 10, 22, 47, 48]
    # Full segments were written as soon as 10 records were buffered; 2 remain buffered.
    assert w.records_written == 50
    w.close()
    assert w.records_written == total == 52
    assert segment_names(tmp_path / "part-00000") == [
        segment_file_name(s, e, fmt)
        for s, e in [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 52)]
    ]
    table = OutputLogReader(tmp_path).read(0, 0)
    assert table.column_names == ["offset", "key", "value"]
    assert table.schema.field("offset").type == pa.int64()
    assert table.column("offset").to_pylist() == list(range(total))
    assert table.column("key").to_pylist() == list(range(total))


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_ranges_across_segment_boundaries(tmp_path: Path, fmt: str) -> None:
    with OutputLogWriter(tmp_path, 3, fmt, segment_records=7) as w:
        w.append(batch(0, 30))
        w.flush()
        w.append(batch(30, 5))
    r = OutputLogReader(tmp_path)
    assert r.partitions() == [3]
    assert r.end_offset(3) == 35
    for start, stop in [(0, 35), (5, 9), (6, 7), (7, 14), (13, 29), (28, 31), (34, 35), (20, None)]:
        t = r.read(3, start, stop)
        expected = list(range(start, 35 if stop is None else stop))
        assert t.column("offset").to_pylist() == expected
        assert t.column("key").to_pylist() == expected
        assert t.column("value").to_pylist() == [k * 0.5 for k in expected]
    # Past the end and empty ranges give empty tables with the log's columns.
    for start, stop in [(35, None), (40, 50), (10, 10)]:
        t = r.read(3, start, stop)
        assert t.num_rows == 0
        assert t.column_names[0] == "offset"
    assert r.read(3, 30, 100).column("offset").to_pylist() == list(range(30, 35))
    with pytest.raises(OutputLogError):
        r.read(3, -1)
    with pytest.raises(OutputLogError):
        r.read(3, 5, 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_all_concatenates_partitions_in_order(tmp_path: Path, fmt: str) -> None:
    sizes = {2: 5, 0: 12, 1: 0}
    for p, n in sizes.items():
        with OutputLogWriter(tmp_path, p, fmt, segment_records=4) as w:
            w.append(batch(100 * p, n))
    r = OutputLogReader(tmp_path)
    assert r.partitions() == [0, 1, 2]
    assert [r.end_offset(p) for p in range(3)] == [12, 0, 5]
    t = r.read_all()
    assert t.column("offset").to_pylist() == list(range(12)) + list(range(5))
    assert t.column("key").to_pylist() == list(range(12)) + list(range(200, 205))
    tp = r.read_all(with_partition=True)
    assert tp.column_names[:2] == ["offset", "partition"]
    assert tp.column("partition").to_pylist() == [0] * 12 + [2] * 5


def test_read_all_of_empty_log(tmp_path: Path) -> None:
    t = OutputLogReader(tmp_path).read_all()
    assert t.num_rows == 0
    assert t.column_names == ["offset"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_reopen_continues_offsets(tmp_path: Path, fmt: str) -> None:
    w = OutputLogWriter(tmp_path, 1, fmt, segment_records=4)
    w.append(batch(0, 6))
    w.close()
    with pytest.raises(OutputLogError):
        w.append(batch(6, 1))
    w = OutputLogWriter(tmp_path, 1, fmt, segment_records=4)
    assert w.end_offset == 6
    assert w.records_written == 0
    assert w.append(batch(6, 5)) == 6
    w.close()
    assert w.records_written == 5
    t = OutputLogReader(tmp_path).read(1, 0)
    assert t.column("offset").to_pylist() == list(range(11))
    assert t.column("key").to_pylist() == list(range(11))


def test_unflushed_records_are_lost_on_crash_and_offsets_reused(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=4)
    w.append(batch(0, 6))  # 4 written, 2 buffered; the writer is then dropped without close
    w2 = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=4)
    assert w2.end_offset == 4


def test_none_format_writes_nothing_but_advances_offsets(tmp_path: Path) -> None:
    path = tmp_path / "out"
    with OutputLogWriter(path, 0, "none", segment_records=3) as w:
        assert w.append(batch(0, 5)) == 0
        assert w.append(batch(5, 4)) == 5
        w.flush()
        assert w.end_offset == 9
        assert w.records_written == 9
    assert not path.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_tmp_files_ignored_by_reader_and_cleaned_by_writer(tmp_path: Path, fmt: str) -> None:
    with OutputLogWriter(tmp_path, 0, fmt, segment_records=5) as w:
        w.append(batch(0, 5))
    part = tmp_path / "part-00000"
    stray = part / (segment_file_name(5, 10, fmt) + ".tmp")
    stray.write_bytes(b"half a segment")
    r = OutputLogReader(tmp_path)
    assert r.end_offset(0) == 5
    assert r.read(0, 0).num_rows == 5
    w = OutputLogWriter(tmp_path, 0, fmt, segment_records=5)
    assert not stray.exists()
    assert w.end_offset == 5
    w.append(batch(5, 2))
    w.close()
    assert not any(p.name.endswith(".tmp") for p in part.iterdir())
    assert r.read(0, 0).column("key").to_pylist() == list(range(7))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gap_between_segments_raises(tmp_path: Path, fmt: str) -> None:
    with OutputLogWriter(tmp_path, 0, fmt, segment_records=3) as w:
        w.append(batch(0, 9))
    missing = tmp_path / "part-00000" / segment_file_name(3, 6, fmt)
    missing.unlink()
    r = OutputLogReader(tmp_path)
    with pytest.raises(OutputLogError, match=segment_file_name(6, 9, fmt)):
        r.read(0, 0)
    with pytest.raises(OutputLogError, match="gap"):
        r.end_offset(0)
    with pytest.raises(OutputLogError, match="gap"):
        OutputLogWriter(tmp_path, 0, fmt, segment_records=3)


def test_missing_path_and_unknown_partition_raise(tmp_path: Path) -> None:
    with pytest.raises(OutputLogError, match="nope"):
        OutputLogReader(tmp_path / "nope")
    with OutputLogWriter(tmp_path, 0, "jsonl", segment_records=3) as w:
        w.append(batch(0, 1))
    r = OutputLogReader(tmp_path)
    with pytest.raises(OutputLogError, match="unknown partition 4"):
        r.read(4, 0)
    with pytest.raises(OutputLogError, match="unknown partition 4"):
        r.end_offset(4)


def test_writer_rejects_bad_arguments_and_schemas(tmp_path: Path) -> None:
    with pytest.raises(OutputLogError):
        OutputLogWriter(tmp_path, 0, "csv", segment_records=3)
    with pytest.raises(OutputLogError):
        OutputLogWriter(tmp_path, 0, "jsonl", segment_records=0)
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=3)
    with pytest.raises(OutputLogError, match="offset"):
        w.append(pa.record_batch({"offset": [1]}))
    w.append(batch(0, 1))
    with pytest.raises(OutputLogError, match="schema"):
        w.append(pa.record_batch({"key": ["a"], "value": [1.0]}))
    # Differences in nullability only are accepted.
    schema = pa.schema([pa.field("key", pa.int64(), nullable=False), ("value", pa.float64())])
    w.append(pa.record_batch({"key": [1], "value": [0.5]}, schema=schema))
    w.close()
    assert OutputLogReader(tmp_path).end_offset(0) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_string_keys_floats_bools_and_nulls_roundtrip(tmp_path: Path, fmt: str) -> None:
    rows = [
        {"key": "alpha", "value": 1.0, "n": 1, "ok": True},
        {"key": 'quo"te\\back\nline\ttab\x01', "value": -0.0, "n": -(2**62), "ok": False},
        {"key": "ünïcødé ✓ 鍵", "value": 0.1 + 0.2, "n": None, "ok": None},
        {"key": "2024-01-01T00:00:00", "value": 1e300, "n": 2**63 - 1, "ok": True},
        {"key": "123", "value": None, "n": 0, "ok": False},
        {"key": None, "value": 5e-324, "n": 7, "ok": True},
        {"key": "{}:,", "value": float("inf"), "n": 8, "ok": True},
    ]
    schema = pa.schema(
        [("key", pa.string()), ("value", pa.float64()), ("n", pa.int64()), ("ok", pa.bool_())]
    )
    with OutputLogWriter(tmp_path, 0, fmt, segment_records=3) as w:
        w.append(pa.RecordBatch.from_pylist(rows, schema=schema))
    t = OutputLogReader(tmp_path).read(0, 0)
    assert t.schema == pa.schema([("offset", pa.int64()), *schema])
    assert t.drop_columns(["offset"]).to_pylist() == rows
    assert math.copysign(1.0, t.column("value")[1].as_py()) == -1.0


def test_jsonl_text_matches_json_module() -> None:
    rows: list[dict[str, Any]] = [
        {"offset": 0, "k": 'a"b', "v": 1.0, "b": True, "i": 3},
        {"offset": 1, "k": None, "v": float("nan"), "b": None, "i": None},
        {"offset": 2, "k": "x", "v": -float("inf"), "b": False, "i": -1},
        {"offset": 3, "k": "", "v": 1e16, "b": True, "i": 0},
    ]
    table = pa.Table.from_pylist(rows)
    lines = encode_jsonl(table).decode().splitlines()
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        parsed = json.loads(line)
        assert list(parsed) == list(row)
        for key, value in row.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(parsed[key])
            else:
                assert parsed[key] == value
                assert type(parsed[key]) is type(value)
    assert lines[0] == json.dumps(rows[0], separators=(",", ":"))


# --- readers and trimming --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_trim_keeps_offsets_and_refuses_reads_below_it(tmp_path: Path, fmt: str) -> None:
    w = OutputLogWriter(tmp_path, 0, fmt, segment_records=10)
    w.append(batch(0, 35))
    w.flush()
    assert w.trim(25) == 20  # only whole segments go: [0, 10) and [10, 20)
    assert w.trimmed_offset == 20
    reader = OutputLogReader(tmp_path)
    assert (reader.start_offset(0), reader.end_offset(0)) == (20, 35)
    assert reader.read(0, 20).column("key").to_pylist() == list(range(20, 35))
    assert reader.read_all().column("offset").to_pylist() == list(range(20, 35))
    with pytest.raises(OutputLogError, match=r"offsets below 20 of partition 0 .* were deleted"):
        reader.read(0, 5)
    again = OutputLogWriter(tmp_path, 0, fmt, segment_records=10)  # a restarted sink
    assert again.append(batch(35, 1)) == 35


def test_an_interrupted_trim_is_finished_by_the_next_writer(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=10)
    w.append(batch(0, 30))
    part = w.directory
    (part / TRIMMED_FILE).write_text("10")  # the crash came before the deletes
    assert [s.start for s in OutputLogReader(tmp_path).segments(0)] == [10, 20]
    OutputLogWriter(tmp_path, 0, "jsonl", segment_records=10)
    assert segment_file_name(0, 10, "jsonl") not in segment_names(part)


def test_corrupt_trim_marker_and_reader_offsets_are_errors(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=10)
    w.append(batch(0, 10))
    (w.directory / TRIMMED_FILE).write_text("ten")
    with pytest.raises(OutputLogError, match=r"corrupt output log: .*trimmed holds 'ten'"):
        OutputLogReader(tmp_path).segments(0)
    commit_reader(tmp_path, "spark", {0: 5})
    (tmp_path / "_readers" / "spark.json").write_text("[1, 2]")
    with pytest.raises(OutputLogError, match="corrupt reader offsets"):
        reader_offsets(tmp_path)
    with pytest.raises(OutputLogError, match=r"reader name '\.\./x' must be"):
        commit_reader(tmp_path, "../x", {0: 1})


def test_retention_trims_what_every_reader_read_and_blocks_a_lagging_one(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 1, "parquet", segment_records=10)
    retention = LogRetention(w, tmp_path, ["a", "b"], max_unread=40, check_interval=0)
    w.append(batch(0, 40))
    retention.poll()
    assert retention.blocked() and retention.unread() == 40
    commit_reader(tmp_path, "a", {1: 30})
    commit_reader(tmp_path, "b", {1: 12, 0: 99})  # other partitions are someone else's
    retention.poll()
    assert retention.committed == 12 and not retention.blocked()
    assert w.trimmed_offset == 10  # the segment [10, 20) is still needed by b
    assert reader_offsets(tmp_path) == {"a": {1: 30}, "b": {0: 99, 1: 12}}


def test_retention_without_readers_keeps_everything(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=10)
    retention = LogRetention(w, tmp_path, [], max_unread=1)
    w.append(batch(0, 30))
    commit_reader(tmp_path, "someone", {0: 30})
    retention.poll()
    assert not retention.blocked() and w.trimmed_offset == 0


@pytest.mark.parametrize("fmt", [*FORMATS, "none"])
def test_truncate_rewinds_to_a_segment_boundary(tmp_path: Path, fmt: str) -> None:
    w = OutputLogWriter(tmp_path, 0, fmt, segment_records=10)
    w.append(batch(0, 25))
    w.flush()  # segments [0, 10), [10, 20), [20, 25)
    assert w.truncate(10) == 15
    assert w.append(batch(100, 3)) == 10
    w.flush()
    if fmt != "none":
        assert OutputLogReader(tmp_path).read(0, 0).column("key").to_pylist() == [
            *range(10),
            100,
            101,
            102,
        ]
        with pytest.raises(OutputLogError, match="inside segment"):
            w.truncate(5)
        with pytest.raises(OutputLogError, match="the log ends at 13"):
            w.truncate(20)


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_see_only_the_published_records(tmp_path: Path, fmt: str) -> None:
    w = OutputLogWriter(tmp_path, 0, fmt, segment_records=10)
    w.append(batch(0, 30))
    w.flush()
    reader = OutputLogReader(tmp_path)
    assert reader.end_offset(0) == 30  # a log that does not publish shows everything
    w.publish(20)
    assert reader.end_offset(0) == 20 and w.visible_offset == 20
    assert reader.read(0, 15).column("key").to_pylist() == list(range(15, 20))
    assert reader.read_all().num_rows == 20
    assert OutputLogWriter(tmp_path, 0, fmt, segment_records=10).visible_offset == 20
    with pytest.raises(OutputLogError, match=r"cannot publish offset 31 .* segments end at 30"):
        w.publish(31)
    w.publish(30)
    assert reader.end_offset(0) == 30


def test_truncating_below_the_published_offset_lowers_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = OutputLogWriter(tmp_path, 0, "jsonl", segment_records=10)
    w.append(batch(0, 30))
    w.flush()
    w.publish(30)
    w.truncate(20)  # only a recovery that skipped a corrupt checkpoint goes back this far
    assert "readers may see records 20..29 again" in caplog.text
    assert OutputLogReader(tmp_path).end_offset(0) == 20
    w.append(batch(100, 10))
    w.flush()
    assert OutputLogReader(tmp_path).end_offset(0) == 20  # until it is published


def test_retention_counts_only_what_readers_can_read(tmp_path: Path) -> None:
    w = OutputLogWriter(tmp_path, 0, "parquet", segment_records=10)
    retention = LogRetention(w, tmp_path, ["a"], max_unread=20, check_interval=0)
    w.publish(0)
    w.append(batch(0, 50))
    w.flush()
    commit_reader(tmp_path, "a", {0: 50})  # a confused reader: past what it could see
    retention.poll()
    assert retention.committed == 0 and retention.unread() == 0 and not retention.blocked()
    w.publish(40)
    retention.poll()
    assert retention.committed == 40 and w.trimmed_offset == 40


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_keeps_the_records_until_there_is_space(tmp_path: Path, fmt: str) -> None:
    with small_disk(tmp_path / "disk", "1m") as disk:
        w = OutputLogWriter(disk / "log", 0, fmt, segment_records=2000)
        filler = fill(disk, leave=8192)
        appended = 0
        with pytest.raises(OutputStorageError, match="No space left on device") as full:
            while appended < 100_000:
                appended += 500  # a batch the disk refuses stays buffered
                w.append(batch(appended - 500, 500))
        assert full.value.retryable
        assert w.end_offset == appended  # every record has its offset, written or not
        assert w.buffered_records == appended - w.records_written
        assert not [n for n in os.listdir(w.directory) if n.endswith(".tmp")]
        with pytest.raises(OutputStorageError):
            w.flush()
        filler.unlink()  # space again
        w.flush()
        w.append(batch(appended, 10))
        w.close()
        table = OutputLogReader(disk / "log").read(0, 0)
        assert table.column("offset").to_pylist() == list(range(appended + 10))
        assert table.column("key").to_pylist() == list(range(appended + 10))


def test_a_log_whose_directory_cannot_be_made_is_a_retryable_storage_error(tmp_path: Path) -> None:
    (tmp_path / "log").write_text("a file where the log's directory goes")
    with pytest.raises(OutputStorageError, match=r"cannot make .*part-00000") as failed:
        OutputLogWriter(tmp_path / "log", 0, "jsonl", segment_records=10)
    assert failed.value.retryable
