"""PySpark connectors of keyshift: `format("keyshift")` writes into a job's ingest endpoint and
reads a job's output log; `format("keyshift-bids")` generates a NEXMark-like bid stream.

Used by Spark jobs (examples/spark/) and the tests. Only these modules import pyspark: keyshift
itself runs without Spark installed (`pip install 'keyshift[spark]'` brings it).
"""
