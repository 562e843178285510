"""Who can talk to a job: every keyshift gRPC service refuses a call without the job's token or
with a wrong one (UNAUTHENTICATED, nothing changes, the refusal is counted), TLS when
configured, and the per-instance identities the coordinator issues (keyshift.runtime.auth,
keyshift.runtime.identity). Services run in this process on loopback; the attacks on a running
job use real keyshift processes.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from keyshift.operator.autoscaler import MetricsUnavailable
from keyshift.operator.scaling_metrics import PrometheusSource, job_graph
from keyshift.runtime.auth import AuthError, Security, Tls
from keyshift.runtime.coordinator import SERVICE, Coordinator
from keyshift.runtime.identity import Issuer
from keyshift.runtime.ingest import COMMIT_METHOD, PUSH_METHOD, IngestService, pack_request
from keyshift.runtime.ingest_client import IngestClient, encode_rows
from keyshift.runtime.instance import migrate_handler
from keyshift.runtime.job import parse_job
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.metrics import UNAUTHENTICATED
from keyshift.runtime.stage_context import MIGRATE_SERVICE
from keyshift.runtime.transport import (
    DATA_SERVICE,
    END,
    GRPC_OPTIONS,
    HELLO,
    MARKER,
    Inbox,
    JsonClient,
    TransportError,
    start_server,
)
from tests.conftest import (
    KEYSHIFT,
    REPO,
    cli,
    count_job,
    latest_by_version,
    running_job,
    status_of,
    wait_for,
    write_job,
)

ANONYMOUS = Security(None)
WRONG = Security(new_job_secret().encode())
METRIC = "keyshift_rpc_unauthenticated_total"


@pytest.fixture
def job_security() -> Security:
    """The settings of the job under test (conftest put its secret in the environment)."""
    return Security.from_env()


def unary(security: Security, address: str, method: str, body: bytes = b"{}") -> grpc.StatusCode:
    """The status a unary call ends with."""
    with security.channel(address, GRPC_OPTIONS) as channel:
        try:
            channel.unary_unary(method, None, None)(body, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def push_stream(security: Security, address: str, messages: list[bytes]) -> grpc.StatusCode:
    """Open a data stream, send `messages`, and return the status it ends with."""
    with security.channel(address, GRPC_OPTIONS) as channel:
        call = channel.stream_stream(f"/{DATA_SERVICE}/Push", None, None)
        try:
            for _credit in call(iter(messages), timeout=10):
                pass
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def hello(sender: str, identity: dict[str, str] | None = None) -> bytes:
    body: dict[str, Any] = {"sender": sender}
    if identity is not None:
        body["identity"] = identity
    return HELLO + json.dumps(body).encode()


@pytest.fixture
def coordinator(job_security: Security) -> Iterator[tuple[Coordinator, str]]:
    spec = parse_job(count_job(keyed={"parallelism": 1}, sink={"parallelism": 1}))
    coord = Coordinator(spec, 30.0, secret=job_security.secret)
    server, port = start_server("127.0.0.1:0", [coord.handler()], security=job_security)
    try:
        yield coord, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


REGISTER = {"stage": "counts", "index": 0, "data_address": "x:1", "metrics_address": "x:2"}


def test_the_coordinator_refuses_calls_without_the_token_and_counts_them(
    coordinator: tuple[Coordinator, str], job_security: Security
) -> None:
    coord, address = coordinator
    before = UNAUTHENTICATED.count(SERVICE)
    calls = [
        ("Register", REGISTER),
        ("Drain", {}),
        ("Rescale", {"stage": "counts", "parallelism": 2}),
        ("Shutdown", {}),
        ("Status", {}),
    ]
    for security in (ANONYMOUS, WRONG):
        for method, body in calls:
            code = unary(security, address, f"/{SERVICE}/{method}", json.dumps(body).encode())
            assert code == grpc.StatusCode.UNAUTHENTICATED, method
        with pytest.raises(TransportError, match="wrong job token"):
            next(JsonClient(address, SERVICE, security).stream("Watch", REGISTER))
    refused = 2 * (len(calls) + 1)
    assert UNAUTHENTICATED.count(SERVICE) == before + refused
    exported = coord.metrics.registry.get_sample_value(METRIC, {"service": SERVICE})
    assert exported == before + refused
    # Nothing changed: no instance registered, no drain, no rescale, not stopped.
    assert coord.members["counts"] == {} and coord.phase == "starting"
    assert not coord.stopped.is_set() and coord.rescale_status is None
    assert not coord._drain_requested
    # The job's own token works.
    client = JsonClient(address, SERVICE, job_security)
    assert client.call("Register", REGISTER)["identity"]["credential"]
    assert client.call("Status")["phase"] == "starting"
    client.close()


def test_reports_and_commands_need_the_identity_issued_at_registration(
    coordinator: tuple[Coordinator, str], job_security: Security
) -> None:
    """A peer with the token, but not the instance's identity, cannot report it finished (the
    job would end), fail it, or take its command stream."""
    coord, address = coordinator
    client = JsonClient(address, SERVICE, job_security)
    issued = client.call("Register", REGISTER)["identity"]
    forged = {"incarnation": issued["incarnation"], "credential": "0" * 64}
    before = UNAUTHENTICATED.count(SERVICE)
    for identity in (None, forged, {"incarnation": 1}):
        body = {"stage": "counts", "index": 0, "identity": identity}
        with pytest.raises(TransportError, match="not the identity issued to instance counts/0"):
            client.call("Report", {**body, "finished": True, "error": "forged"})
        with pytest.raises(TransportError, match="not the identity"):
            next(client.stream("Watch", body))
    assert UNAUTHENTICATED.count(SERVICE) == before + 6
    record = coord.members["counts"][0]
    assert not record.finished and not record.watching and coord.errors == []
    # The registrant's own identity works.
    client.call("Report", {"stage": "counts", "index": 0, "identity": issued, "stats": {"a": 1}})
    assert record.stats == {"a": 1}
    client.close()


@pytest.fixture
def instance_server(job_security: Security) -> Iterator[tuple[Inbox, str, Issuer]]:
    """An instance's servers (data and migration) as `keyshift.runtime.instance` starts them."""
    inbox = Inbox()
    senders = Issuer("t", job_security.secret)
    server, port = start_server(
        "127.0.0.1:0", [inbox.handler(), migrate_handler([])], security=job_security
    )
    inbox.open(4, senders)
    try:
        yield inbox, f"127.0.0.1:{port}", senders
    finally:
        server.stop(None)


def test_data_and_migration_services_refuse_calls_without_the_token(
    instance_server: tuple[Inbox, str, Issuer], job_security: Security
) -> None:
    inbox, address, senders = instance_server
    identity = senders.issue("source/0").to_json()
    messages = [hello("source/0", identity), MARKER + b"message", END]
    data_before = UNAUTHENTICATED.count(DATA_SERVICE)
    migrate_before = UNAUTHENTICATED.count(MIGRATE_SERVICE)
    fetch = f"/{MIGRATE_SERVICE}/Fetch"
    for security in (ANONYMOUS, WRONG):
        assert push_stream(security, address, messages) == grpc.StatusCode.UNAUTHENTICATED
        assert unary(security, address, fetch) == grpc.StatusCode.UNAUTHENTICATED
    assert inbox.get(0.5) is None and inbox.failures.empty()
    assert UNAUTHENTICATED.count(DATA_SERVICE) == data_before + 2
    assert UNAUTHENTICATED.count(MIGRATE_SERVICE) == migrate_before + 2
    # With the token: the fetch reaches the handler (this instance serves no state yet)...
    assert unary(job_security, address, fetch) == grpc.StatusCode.UNAVAILABLE
    # ...and a sender with its identity delivers.
    assert push_stream(job_security, address, messages) == grpc.StatusCode.OK
    message, end = inbox.get(5), inbox.get(5)
    assert message is not None and (message.sender, message.kind, message.payload) == (
        "source/0",
        MARKER,
        b"message",
    )
    assert end is not None and (end.sender, end.kind) == ("source/0", END)


def test_a_data_stream_in_another_instances_name_is_refused(
    instance_server: tuple[Inbox, str, Issuer], job_security: Security
) -> None:
    """With the token but without the sender's identity, nobody can push records or end a
    source's stream in its name (which would make the job finish early)."""
    inbox, address, senders = instance_server
    other = senders.issue("source/1").to_json()
    before = UNAUTHENTICATED.count(DATA_SERVICE)
    for identity in (None, other, {"incarnation": other["incarnation"], "credential": "ab"}):
        messages = [hello("source/0", identity), MARKER + b"fake", END]
        assert push_stream(job_security, address, messages) == grpc.StatusCode.UNAUTHENTICATED
    for bad_start in ([END], [HELLO + b"not json", END], []):
        assert push_stream(job_security, address, bad_start) == grpc.StatusCode.INVALID_ARGUMENT
    assert UNAUTHENTICATED.count(DATA_SERVICE) == before + 3
    assert inbox.get(0.5) is None and inbox.failures.empty()


FIELDS = {"user": "str", "clicks": "int"}


def test_the_ingest_service_refuses_pushes_without_the_token(job_security: Security) -> None:
    service = IngestService(FIELDS, 0, 16, lambda *_: None)
    server, port = start_server("127.0.0.1:0", [service.handler()], security=job_security)
    address = f"127.0.0.1:{port}"
    rows = pa.Table.from_pylist([{"user": "u", "clicks": 1}])
    fmt, payload = encode_rows(rows)
    request = pack_request({"format": fmt}, payload)
    staged = pack_request({"format": fmt, "transaction": "t1", "part": "p"}, payload)
    commit = json.dumps({"transaction": "t1", "parts": ["p"]}).encode()
    service_name = PUSH_METHOD.strip("/").partition("/")[0]
    before = UNAUTHENTICATED.count(service_name)
    try:
        for security in (ANONYMOUS, WRONG):
            assert unary(security, address, PUSH_METHOD, request) == grpc.StatusCode.UNAUTHENTICATED
            assert unary(security, address, PUSH_METHOD, staged) == grpc.StatusCode.UNAUTHENTICATED
            assert unary(security, address, COMMIT_METHOD, commit) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
        assert service.take(0.3) is None and service.staged_rows() == 0
        assert UNAUTHENTICATED.count(service_name) == before + 6
        with IngestClient(address, security=job_security) as client:
            assert client.push(rows).accepted == 1
        batch = service.take(5)
        assert batch is not None and batch.num_rows == 1
    finally:
        server.stop(None)


@pytest.mark.live
def test_a_process_without_a_secret_refuses_to_start(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(count_job()))
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    for module in ("coordinator", "instance"):
        args = ["--job", str(job)] if module == "coordinator" else [
            "--coordinator", "127.0.0.1:1", "--stage", "source", "--index", "0"]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", f"keyshift.runtime.{module}", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert f"no job secret: set {SECRET_ENV}" in done.stderr
    with pytest.raises(AuthError, match="KEYSHIFT_INSECURE=1"):
        Security.from_env(env)
    assert Security.from_env({**env, "KEYSHIFT_INSECURE": "1"}).token is None


# --- TLS --------------------------------------------------------------------------------------


def _certificate(
    subject: str, issuer_key: Any, issuer: x509.Name | None, key: Any, ca: bool
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(tmp_path: Path, name: str) -> dict[str, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 it signed, as PEM files."""
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _certificate(f"{name} CA", ca_key, None, ca_key, ca=True)
    server = _certificate("keyshift", ca_key, ca.subject, server_key, ca=False)
    key_pem = server_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    files = {"ca": tmp_path / f"{name}-ca.pem", "cert": tmp_path / f"{name}-cert.pem",
             "key": tmp_path / f"{name}-key.pem"}  # fmt: skip
    files["ca"].write_bytes(_pem(ca))
    files["cert"].write_bytes(_pem(server))
    files["key"].write_bytes(key_pem)
    return files


def tls_env(files: dict[str, Path], server: bool) -> dict[str, str]:
    env = {SECRET_ENV: os.environ[SECRET_ENV], "KEYSHIFT_TLS_CA": str(files["ca"])}
    if server:
        env.update(KEYSHIFT_TLS_CERT=str(files["cert"]), KEYSHIFT_TLS_KEY=str(files["key"]))
    return env


def test_tls_servers_are_reached_only_by_clients_that_trust_their_ca(tmp_path: Path) -> None:
    files, other = make_ca(tmp_path, "job"), make_ca(tmp_path, "other")
    spec = parse_job(count_job())
    coord = Coordinator(spec, 30.0)
    server_security = Security.from_env(tls_env(files, server=True))
    server, port = start_server("127.0.0.1:0", [coord.handler()], security=server_security)
    address = f"127.0.0.1:{port}"
    try:
        trusting = JsonClient(address, SERVICE, Security.from_env(tls_env(files, server=False)))
        assert trusting.call("Status")["phase"] == "starting"
        trusting.close()
        plaintext = Security.from_env({SECRET_ENV: os.environ[SECRET_ENV]})
        distrusting = Security.from_env(tls_env(other, server=False))
        for security in (plaintext, distrusting):
            code = unary(security, address, f"/{SERVICE}/Status")
            assert code == grpc.StatusCode.UNAVAILABLE
        # A certificate for another name is accepted only when told which name to expect.
        named = Tls(ca=files["ca"].read_bytes(), server_name="localhost")
        secret = server_security.secret
        by_name = Security(secret, named)
        with by_name.channel(f"127.0.0.1:{port}", GRPC_OPTIONS) as channel:
            reply = channel.unary_unary(f"/{SERVICE}/Status", None, None)(b"{}", timeout=10)
        assert json.loads(reply)["phase"] == "starting"
        wrong_name = Security(secret, Tls(ca=files["ca"].read_bytes(), server_name="elsewhere"))
        assert unary(wrong_name, address, f"/{SERVICE}/Status") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


def test_bad_tls_settings_get_a_clear_error(tmp_path: Path) -> None:
    files = make_ca(tmp_path, "job")
    secret = {SECRET_ENV: os.environ[SECRET_ENV]}
    with pytest.raises(AuthError, match="TLS needs KEYSHIFT_TLS_CA"):
        Security.from_env({**secret, "KEYSHIFT_TLS_CERT": str(files["cert"])})
    with pytest.raises(AuthError, match="both KEYSHIFT_TLS_CERT and KEYSHIFT_TLS_KEY"):
        Security.from_env(
            {**secret, "KEYSHIFT_TLS_CA": str(files["ca"]), "KEYSHIFT_TLS_CERT": str(files["cert"])}
        )
    with pytest.raises(AuthError, match="cannot read the TLS CA"):
        Security.from_env({**secret, "KEYSHIFT_TLS_CA": str(tmp_path / "missing.pem")})
    client_only = Security.from_env(tls_env(files, server=False))
    with pytest.raises(AuthError, match="a TLS server needs"):
        start_server("127.0.0.1:0", [], security=client_only)


# --- attacks on a running job -----------------------------------------------------------------


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


@pytest.mark.live
@pytest.mark.slow
def test_peers_without_the_token_or_an_identity_cannot_end_or_stop_a_running_job(
    tmp_path: Path,
) -> None:
    """On real processes: an anonymous peer cannot register in an open slot (and get the job's
    spec), drain, rescale or stop the job; a peer with the token cannot end a source's data
    stream in its name or report instances finished. The job finishes with every record."""
    total = 60_000
    job = count_job(
        source={
            "config": {
                "kind": "generator",
                "keys": 500,
                "seed": 5,
                "total": total,
                "profile": {"rate": 3000},
            }
        },
        sink={"config": {"kind": "log", "format": "jsonl", "path": str(tmp_path / "out")}},
    )
    with running_job(tmp_path, job) as local:
        anonymous = JsonClient(local.address, SERVICE, ANONYMOUS)
        with pytest.raises(TransportError, match="wrong job token"):
            anonymous.call("Register", {**REGISTER, "stage": "source"})
        for method, body in [("Drain", {}), ("Shutdown", {}),
                             ("Rescale", {"stage": "counts", "parallelism": 1})]:  # fmt: skip
            with pytest.raises(TransportError, match="wrong job token"):
                anonymous.call(method, body)
        anonymous.close()
        # Five processes start on a loaded machine (the suite runs two at a time): minutes.
        status = wait_for(
            lambda: (s := local.status())["phase"] == "running" and s, 180, "the job to run"
        )
        keyed = next(s for s in status["stages"] if s["name"] == "counts")
        insider = Security.from_env()  # holds the token, not the instances' identities
        for instance in keyed["instances"]:
            fake_end = [hello("source/0"), END]
            code = push_stream(insider, instance["address"], fake_end)
            assert code == grpc.StatusCode.UNAUTHENTICATED
        client = JsonClient(local.address, SERVICE, insider)
        for stage in status["stages"]:
            for instance in stage["instances"]:
                with pytest.raises(TransportError, match="not the identity"):
                    client.call(
                        "Report",
                        {"stage": stage["name"], "index": instance["index"], "finished": True},
                    )
        assert client.call("Status")["phase"] == "running"
        client.close()
        instances = sum(len(stage["instances"]) for stage in status["stages"])
        metrics = scrape(local.coordinator_metrics_port)
        assert f'{METRIC}{{service="{SERVICE}"}} {4 + instances}.0' in metrics, metrics
        wait_for(lambda: local.status()["phase"] == "finished", 120, "the job to finish")
    counts = latest_by_version(tmp_path / "out")
    assert sum(value for _version, value in counts.values()) == total


# --- the autoscaler's Prometheus client -------------------------------------------------------


class _EmptyPrometheus(http.server.BaseHTTPRequestHandler):
    """Answers every query with no series: a stand-in for Prometheus, since what is tested is
    the client's check of the server's certificate, not the query."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_the_prometheus_client_verifies_the_servers_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = make_ca(tmp_path, "prometheus")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EmptyPrometheus)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files["cert"], files["key"])
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_port}"
    spec = parse_job(count_job())
    try:
        monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
        untrusted = PrometheusSource(url, "t", job_graph(spec), lambda: {})
        with pytest.raises(MetricsUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            untrusted.collect(10, time.time())
        # Trusted through the option, or requests' standard variable: the query goes through
        # (and finds no series).
        by_option = PrometheusSource(
            url, "t", job_graph(spec), lambda: {}, ca_bundle=str(files["ca"])
        )
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(files["ca"]))
        by_env = PrometheusSource(url, "t", job_graph(spec), lambda: {})
        for source in (by_option, by_env):
            with pytest.raises(
                MetricsUnavailable, match="Prometheus has no keyshift_input_records_total"
            ):
                source.collect(10, time.time())
    finally:
        server.shutdown()
        server.server_close()


# --- the command line -------------------------------------------------------------------------


def keyshift(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KEYSHIFT, *args], cwd=REPO, env={**env, "COLUMNS": "200"}, capture_output=True,
        text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.live
@pytest.mark.slow
def test_keyshift_run_makes_a_secret_that_status_finds_and_others_lack(tmp_path: Path) -> None:
    """Without KEYSHIFT_JOB_SECRET, `keyshift run` generates one and records it for
    `keyshift status NAME` (readable by the user only); a client given only the address needs
    the secret in its environment."""
    bare = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    job = count_job(name="secretive", source={"config": {"kind": "generator", "keys": 100,
                                                         "profile": {"rate": 1000}}})  # fmt: skip
    with cli(["run", str(write_job(tmp_path, job)), "--no-view"], env={SECRET_ENV: ""}) as run:
        # Polled in process (with the registry's secret, as the command finds it): a command per
        # poll costs seconds of CPU. Then the command itself, once.
        wait_for(lambda: status_of("secretive"), 60, "the job's status by name")
        status = keyshift(bare, "status", "secretive")
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["job"] == "secretive"
        record = Path(bare["KEYSHIFT_HOME"]) / "jobs" / "secretive.json"
        assert record.stat().st_mode & 0o777 == 0o600
        address = json.loads(record.read_text())["coordinator"]
        out = keyshift(bare, "status", address)
        assert out.returncode == 2 and f"no job secret: set {SECRET_ENV}" in out.stdout
        out = keyshift({**bare, SECRET_ENV: new_job_secret()}, "status", address)
        assert out.returncode == 1 and "missing or wrong job token" in out.stdout
        out = keyshift(bare, "rescale", address, "counts", "3")
        assert out.returncode == 2 and "no job secret" in out.stdout
        run.send_signal(signal.SIGINT)
        output, _ = run.communicate(timeout=60)
    assert run.returncode == 0, output


@pytest.mark.live
def test_keyshift_run_refuses_a_secret_too_short(tmp_path: Path) -> None:
    job = write_job(tmp_path, count_job())
    out = keyshift({**os.environ, SECRET_ENV: "short"}, "run", str(job), "--no-view")
    assert out.returncode == 2 and f"{SECRET_ENV} is 5 characters long" in out.stdout
