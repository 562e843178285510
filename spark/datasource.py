"""The `keyshift` Spark data source: write into a job's ingest endpoint, read its output log.

Registered by keyshift.spark.session.register (or `spark.dataSource.register(
KeyshiftDataSource)`); Spark builds the writers and readers of keyshift.spark.ingest_writer
and keyshift.spark.log_reader from it.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from keyshift.spark.ingest_writer import (
    KeyshiftBatchWriter,
    KeyshiftStreamWriter,
    WriterOptions,
    check_due_column,
)
from keyshift.spark.log_reader import KeyshiftLogReader, KeyshiftLogStreamReader, spark_schema


class KeyshiftDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "keyshift"

    def schema(self) -> StructType:
        return spark_schema(dict(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> KeyshiftBatchWriter:
        _append_only(overwrite)
        writer = KeyshiftBatchWriter(dict(self.options))
        check_due_column(writer.options, schema.fieldNames())
        return writer

    def streamWriter(self, schema: StructType, overwrite: bool) -> KeyshiftStreamWriter:
        _append_only(overwrite)
        # Fail when the query starts, not in a task.
        check_due_column(WriterOptions.parse(dict(self.options)), schema.fieldNames())
        return KeyshiftStreamWriter(dict(self.options))

    def reader(self, schema: StructType) -> KeyshiftLogReader:
        return KeyshiftLogReader(dict(self.options), schema)

    def streamReader(self, schema: StructType) -> KeyshiftLogStreamReader:
        return KeyshiftLogStreamReader(dict(self.options), schema)


def _append_only(overwrite: bool) -> None:
    if overwrite:
        raise ValueError("a keyshift job only takes appended rows: use mode 'append'")
