"""Every Kafka client rtrl makes (ingest, replay, lag, the event senders, the model-update
followers, topic creation) is built here from one `KafkaAccess`, so TLS and SASL reach all of
them, and a client that cannot connect fails with the reason and the setting to change.

kafka-python, left alone, answers a wrong password, an untrusted certificate or a TLS port
dialled in plain text the same way: it retries until its bootstrap timeout (30 s) and raises
"Unable to bootstrap", with the real cause only in a log line. So:

    1. build      the client with bootstrap_timeout_ms = kafka.connect_timeout_s, while a log
                  handler collects the exceptions kafka-python reports for its connections
    2. on failure diagnose, cheapest first: the TCP connection (kafka.bootstrap); the TLS
                  handshake with the client's own settings (kafka.security.ca_file, cert_file,
                  check_hostname, protocol); then what the broker said (SASL: username,
                  password, sasl_mechanism; a TLS port dialled in plain text: protocol)
    3. raise      KafkaAccessError (a KafkaError, so callers that survive a broker outage
                  survive this too) whose message names the setting -- KafkaRefusedError when
                  the broker was reached and refused the settings (no wait will help)

Secrets the clients are given are registered with pipeline/core/logs.py, which masks them in every
log line.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kafka import KafkaConsumer, KafkaProducer
from kafka import errors as kerrors
from kafka.admin import KafkaAdminClient

from pipeline.core import logs
from pipeline.core.kafka_config import KafkaAccess, KafkaSecretError

T = TypeVar("T")


class KafkaAccessError(kerrors.KafkaError):
    """No connection to the brokers; the message says why and which setting to change."""

    def __str__(self) -> str:  # KafkaError's prefixes the class name: the message is enough
        return str(self.args[0]) if self.args else "no connection to Kafka"


class KafkaRefusedError(KafkaAccessError):
    """The brokers are there but refuse these settings (credentials, certificates, protocol): no
    wait makes it work, so a producer tells its caller instead of spooling for an outage."""


# what a broker answers a client it will never serve: its login, or its rights (ACLs)
REFUSALS = (
    KafkaRefusedError,
    kerrors.SaslAuthenticationFailedError,
    kerrors.TopicAuthorizationFailedError,
    kerrors.ClusterAuthorizationFailedError,
    kerrors.TransactionalIdAuthorizationFailedError,
)


def consumer(access: KafkaAccess | str, **params: Any) -> KafkaConsumer:
    return _connect(KafkaConsumer, KafkaAccess.of(access), params)


def producer(access: KafkaAccess | str, **params: Any) -> KafkaProducer:
    access = KafkaAccess.of(access)
    return _connect(KafkaProducer, access, {"max_request_size": access.max_message_bytes, **params})


def admin(access: KafkaAccess | str, **params: Any) -> KafkaAdminClient:
    return _connect(KafkaAdminClient, KafkaAccess.of(access), params)


def _connect(factory: Callable[..., T], access: KafkaAccess, params: dict[str, Any]) -> T:
    try:
        settings = access.client_params()
    except KafkaSecretError as exc:
        raise KafkaAccessError(str(exc)) from None
    if settings.get("sasl_plain_password"):
        logs.mask(settings["sasl_plain_password"])
    if settings.get("ssl_password"):
        logs.mask(settings["ssl_password"])
    settings = {"bootstrap_timeout_ms": int(access.connect_timeout_s * 1000), **settings, **params}
    with _reported_errors() as seen:  # 1. build
        try:
            return factory(**settings)
        except kerrors.KafkaTimeoutError as exc:
            failure = exc
    reason = diagnose(access, seen, failure)  # 2., 3.
    if reason.startswith(("cannot reach", "no Kafka connection")):
        raise KafkaAccessError(reason) from None  # not there (yet): an outage
    raise KafkaRefusedError(reason) from None


@contextmanager
def _reported_errors() -> Iterator[list[BaseException | str]]:
    """What kafka-python reports while the block runs: the exceptions it passes to a log call,
    and the messages of errors logged without one (e.g. "socket disconnected")."""
    seen: list[BaseException | str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            args = record.args if isinstance(record.args, tuple) else ()
            excs = [a for a in args if isinstance(a, BaseException)]
            if excs:
                seen.extend(excs)
            elif record.levelno >= logging.ERROR:
                seen.append(record.getMessage())

    handler, kafka_log = Collect(logging.WARNING), logging.getLogger("kafka")
    kafka_log.addHandler(handler)
    try:
        yield seen
    finally:
        kafka_log.removeHandler(handler)


def diagnose(access: KafkaAccess, reported: list[BaseException | str], failure: BaseException | None = None) -> str:
    """Why no connection could be made, naming the setting to change (step 2 above)."""
    s, where = access.security, access.describe()
    host, _, port = access.servers[0].rpartition(":")
    timeout = min(access.connect_timeout_s, 5.0)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError) as exc:
        return (
            f"cannot reach the Kafka broker at {access.servers[0]} (kafka.bootstrap): "
            f"{getattr(exc, 'strerror', None) or exc}. "
            "Is it running (`rtrl kafka status`), and is kafka.bootstrap right?"
        )
    with sock:
        if s.tls:
            problem = _tls_problem(access, sock, host, timeout)
            if problem:
                return problem
        elif _speaks_tls(sock, host, timeout):
            return (
                f"the broker at {access.servers[0]} expects TLS but kafka.security.protocol is {s.protocol}: "
                f"set it to SSL or SASL_SSL (with ca_file)"
            )
    reported = [r for r in reported if not isinstance(r, kerrors.KafkaTimeoutError)]  # that is `failure`
    source = (
        f"kafka.security.password_file {s.password_file}"
        if s.password_file
        else "kafka.security.password (RTRL_KAFKA_PASSWORD)"
    )
    for said in reversed(reported):  # the newest first: what the broker said
        if isinstance(said, str):
            continue
        if isinstance(said, kerrors.SaslAuthenticationFailedError):
            return (
                f"the broker at {where} refused kafka.security.username {s.username!r} with "
                f"kafka.security.sasl_mechanism {s.sasl_mechanism}: check the user and {source}. "
                f"The broker said: {said}"
            )
        if isinstance(said, kerrors.UnsupportedSaslMechanismError):
            return (
                f"the broker at {access.bootstrap} does not offer kafka.security.sasl_mechanism "
                f"{s.sasl_mechanism}: {said}"
            )
    if s.sasl and any("disconnected" in str(r) for r in reported):
        # TCP and TLS are fine (checked above), so the connection ended in the SASL login: a
        # broker answers wrong credentials by closing it, often before the client reads why
        return (
            f"the broker at {where} closed the connection during the SASL login, as it does for wrong "
            f"credentials: check kafka.security.username {s.username!r}, {source} and "
            f"kafka.security.sasl_mechanism {s.sasl_mechanism}"
        )
    last = reported[-1] if reported else failure
    last = last if isinstance(last, str) else f"{type(last).__name__}: {last}"
    hint = (
        ""
        if s.sasl
        else (
            f"; kafka.security.protocol is {s.protocol}: if the brokers require a SASL login "
            f"(or TLS), set it to SASL_SSL (or SSL), with username and password"
        )
    )
    return (
        f"no Kafka connection to {where} within {access.connect_timeout_s:g}s (kafka.connect_timeout_s): {last}{hint}"
    )


def tls_context(access: KafkaAccess) -> ssl.SSLContext:
    """The TLS settings the clients use, as Python's ssl (which kafka-python uses) reads them."""
    s = access.security
    try:
        ctx = ssl.create_default_context(cafile=str(s.ca_file) if s.ca_file else None)
    except (ssl.SSLError, OSError) as exc:
        raise KafkaAccessError(f"kafka.security.ca_file {s.ca_file} is not a PEM CA certificate: {exc}") from None
    ctx.check_hostname = s.check_hostname
    if s.cert_file:
        try:
            ctx.load_cert_chain(
                str(s.cert_file),
                str(s.key_file) if s.key_file else None,
                s.key_password.get_secret_value() if s.key_password else None,
            )
        except (ssl.SSLError, OSError) as exc:
            raise KafkaAccessError(
                f"kafka.security.cert_file {s.cert_file} / key_file {s.key_file} cannot be "
                f"loaded (a PEM certificate and its key; key_password if encrypted): {exc}"
            ) from None
    return ctx


def _speaks_tls(sock: socket.socket, host: str, timeout: float) -> bool:
    """Whether the port completes a TLS handshake (any certificate: this only tells the protocols apart)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    sock.settimeout(timeout)
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            return True
    except (ssl.SSLError, OSError):
        return False


def _tls_problem(access: KafkaAccess, sock: socket.socket, host: str, timeout: float) -> str | None:
    """What is wrong with the TLS handshake on `sock`, in terms of the settings; None if nothing."""
    s, endpoint = access.security, access.servers[0]
    try:
        ctx = tls_context(access)
    except KafkaAccessError as exc:
        return str(exc)
    sock.settimeout(timeout)
    try:
        with ctx.wrap_socket(sock, server_hostname=host) as tls:
            # A broker that requires a client certificate says so after the handshake (TLS 1.3):
            # wait briefly for its alert. Silence is what a healthy broker does.
            tls.settimeout(0.5)
            try:
                tls.recv(1)
            except TimeoutError:
                pass
            except ssl.SSLError as exc:
                if "CERTIFICATE_REQUIRED" in str(exc).upper() or "BAD_CERTIFICATE" in str(exc).upper():
                    return (
                        f"the broker at {endpoint} requires a client certificate it trusts: set "
                        f"kafka.security.cert_file and key_file ({exc.reason or exc})"
                    )
                raise
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
            return (
                f"the certificate of the broker at {endpoint} does not name {host} ({exc.verify_message}): "
                f"dial a name it carries (kafka.bootstrap) or set kafka.security.check_hostname = false"
            )
        ca = s.ca_file or "unset, so the system's CAs"
        return (
            f"the certificate of the broker at {endpoint} is not trusted ({exc.verify_message}): "
            f"kafka.security.ca_file ({ca}) must be the PEM certificate of the CA that signed it"
        )
    except (ssl.SSLError, ConnectionError, OSError) as exc:
        return (
            f"no TLS handshake with the broker at {endpoint} ({exc}): kafka.security.protocol is "
            f"{s.protocol}; does that port speak TLS, or should the protocol be PLAINTEXT/SASL_PLAINTEXT?"
        )
    return None
