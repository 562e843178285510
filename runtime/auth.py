"""Who may talk to a job: the call token every gRPC call presents, and optional TLS.

Every keyshift gRPC server checks the job's call token (derived from the job's secret, see
`keyshift.runtime.job_secret`) in a server interceptor, in constant time; a call without it or
with a wrong one ends UNAUTHENTICATED before any handler runs, and is counted. Every client
channel presents the token as call metadata. With TLS configured (a certificate, its key and the
CA that signed it, from files named by environment variables), servers listen with TLS and
clients verify the server's certificate against that CA.

A process without a secret refuses to start its servers and clients unless the explicit
opt-out `KEYSHIFT_INSECURE=1` is set (tests and development only).
Called by `keyshift.runtime.transport` (servers, control and data channels), the ingest client,
the migration channels, and the hosts and Spark connectors that build a `Security` themselves.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from keyshift.runtime.job_secret import SECRET_ENV, derive_key, load_job_secret

TOKEN_METADATA = "keyshift-token"  # gRPC metadata keys are lower case
INSECURE_ENV = "KEYSHIFT_INSECURE"
TLS_CERT_ENV = "KEYSHIFT_TLS_CERT"
TLS_KEY_ENV = "KEYSHIFT_TLS_KEY"
TLS_CA_ENV = "KEYSHIFT_TLS_CA"
# The name clients expect in the servers' certificates, when it is not the host they dial (pods
# are dialled by IP; one certificate for `keyshift.<job>` serves every pod of a job).
TLS_SERVER_NAME_ENV = "KEYSHIFT_TLS_SERVER_NAME"


class AuthError(ValueError):
    """Security settings that cannot be used: no secret without the opt-out, unreadable TLS."""


@dataclass(frozen=True)
class Tls:
    """PEM bytes: this process's certificate and key (servers) and the CA clients trust."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None


@dataclass(frozen=True)
class Security:
    """The job's secret (None: the explicit insecure opt-out) and TLS settings, if any."""

    secret: bytes | None
    tls: Tls | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Security:
        secret = load_job_secret(environ)
        if secret is None and environ.get(INSECURE_ENV) != "1":
            raise AuthError(
                f"no job secret: set {SECRET_ENV} (the local host and the operator do), or "
                f"{INSECURE_ENV}=1 to run without authentication (tests and development only)"
            )
        return cls(secret, _tls_from_env(environ))

    @property
    def token(self) -> str | None:
        """What clients present and servers expect; None when running insecure."""
        return None if self.secret is None else derive_key(self.secret, "grpc-token").hex()

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A client channel to `address`: TLS if configured, presenting the token."""
        if self.tls is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            if self.tls.server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.tls.server_name)]
            credentials = grpc.ssl_channel_credentials(root_certificates=self.tls.ca)
            channel = grpc.secure_channel(address, credentials, options=options)
        token = self.token
        if token is None:
            return channel
        return grpc.intercept_channel(channel, _PresentToken(token))

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Listen on `address`, with TLS if configured; the bound port (0: failed)."""
        if self.tls is None:
            return server.add_insecure_port(address)
        if self.tls.cert is None or self.tls.key is None:
            raise AuthError(f"a TLS server needs {TLS_CERT_ENV} and {TLS_KEY_ENV}")
        credentials = grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)])
        return server.add_secure_port(address, credentials)

    def interceptors(
        self, refused: Callable[[str], None]
    ) -> list[grpc.ServerInterceptor[Any, Any]]:
        """The server side: refuse calls without the token, telling `refused` their service."""
        token = self.token
        return [] if token is None else [_RequireToken(token, refused)]


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise AuthError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None


def _tls_from_env(environ: Mapping[str, str]) -> Tls | None:
    ca, cert, key = (environ.get(n, "") for n in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV))
    if not (ca or cert or key):
        return None
    if not ca:
        raise AuthError(f"TLS needs {TLS_CA_ENV}: clients verify servers against it")
    if bool(cert) != bool(key):
        raise AuthError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}, or neither (clients)")
    return Tls(
        ca=_read(ca, "CA"),
        cert=_read(cert, "certificate") if cert else None,
        key=_read(key, "key") if key else None,
        server_name=environ.get(TLS_SERVER_NAME_ENV) or None,
    )


# grpc's interceptor classes are generic in its type stubs only.
if TYPE_CHECKING:
    _UnaryUnaryClientInterceptor = grpc.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamClientInterceptor = grpc.UnaryStreamClientInterceptor[Any, Any]
    _StreamStreamClientInterceptor = grpc.StreamStreamClientInterceptor[Any, Any]
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    _UnaryUnaryClientInterceptor = grpc.UnaryUnaryClientInterceptor
    _UnaryStreamClientInterceptor = grpc.UnaryStreamClientInterceptor
    _StreamStreamClientInterceptor = grpc.StreamStreamClientInterceptor
    _ServerInterceptor = grpc.ServerInterceptor


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(
        self, details: grpc.ClientCallDetails, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _PresentToken(
    _UnaryUnaryClientInterceptor, _UnaryStreamClientInterceptor, _StreamStreamClientInterceptor
):
    """Adds the token to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = (*(details.metadata or ()), (TOKEN_METADATA, self._token))
        return _ClientCallDetails(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _RequireToken(_ServerInterceptor):
    """Lets a call reach its handler only if its metadata carries the job's token."""

    def __init__(self, token: str, refused: Callable[[str], None]) -> None:
        self._token = token.encode()
        self._refused = refused

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        presented = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._token):
            return continuation(details)
        handler = continuation(details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED either way
            return None
        service = details.method.strip("/").partition("/")[0]
        self._refused(service)
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
