"""ScrapeSource (the local host's embedded metrics source) against what may answer at an
instance's metrics address: its endpoint, nothing, or another process that took the retired
instance's port (a gRPC server's bytes are no HTTP reply). Real sockets on loopback; no job."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from keyshift.operator.scaling_metrics import Graph, ScrapeSource
from keyshift.runtime.metrics import MetricName

GRAPH: Graph = [("source", ())]


class FixedClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


@contextmanager
def metrics_endpoint(text: bytes) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def raw_bytes_server(reply: bytes) -> Iterator[str]:
    """Answers every request with `reply` and closes the connection, as a non-HTTP server may."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.recv(65536)  # the request, as a server reads before it answers
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def counter(value: float) -> bytes:
    name = MetricName.RECORDS_IN
    return f"# TYPE {name} counter\n{name} {value}\n".encode()


def test_an_address_answering_bytes_that_are_not_http_is_skipped_and_scraping_goes_on() -> None:
    clock = FixedClock()
    # A gRPC server's HTTP/2 preface and settings frame, as a reused port answered in CI.
    grpc_bytes = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x04\x00@\x00\x00\xfe\xff\x00\r\n"
    with raw_bytes_server(grpc_bytes) as foreign, metrics_endpoint(counter(10)) as good:
        members = {"source": {"source-0": foreign, "source-1": good}}
        scrape = ScrapeSource(GRAPH, lambda: members, clock, timeout=2.0)
        scrape.scrape_once()
        clock.t += 1
        scrape.scrape_once()
    assert set(scrape._history) == {("source", "source-1")}
    samples = scrape._history[("source", "source-1")]
    assert [values[MetricName.RECORDS_IN] for _, values in samples] == [10.0, 10.0]


def test_an_http_reply_that_is_not_prometheus_text_is_skipped() -> None:
    with metrics_endpoint(b"\xff\xfe not metrics {{{") as odd:
        scrape = ScrapeSource(GRAPH, lambda: {"source": {"source-0": odd}}, FixedClock())
        scrape.scrape_once()
    assert scrape._history == {}
