"""How rtrl reaches Kafka: the `[kafka]` and `[kafka.security]` config sections, and
`KafkaAccess`, the one value every Kafka client rtrl makes is built from.

    [kafka]            bootstrap = "broker-1:9093,broker-2:9093", connect_timeout_s = 10
    [kafka.security]   protocol = "SASL_SSL"           PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
                       ca_file = "/etc/rtrl/kafka-ca.pem"       the CA that signed the brokers
                       cert_file, key_file                      a client certificate (mutual TLS)
                       sasl_mechanism = "SCRAM-SHA-512"         PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
                       username = "rtrl"
                       password_file = "/run/secrets/kafka"     or RTRL_KAFKA_PASSWORD

Secrets (the SASL password, a client key's password) come from the environment or a file,
never from the config file: a config file is copied, committed and pasted into tickets. They are
`SecretStr` here, so a printed or logged config shows `**********`, and are read out only when
a client is built (`KafkaAccess.client_params`). This module imports no Kafka library
(pipeline/core/kafka_client.py builds the clients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from pipeline.core.config_section import Section as _Section

SECRET_FIELDS = ("password", "key_password")  # refused in a config file (pipeline/core/config.py)


class KafkaSecurityConfig(_Section):
    protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="PLAINTEXT (the local broker), SSL, SASL_PLAINTEXT or SASL_SSL (managed Kafka)"
    )
    ca_file: Path | None = Field(
        default=None, description="PEM file of the CA that signed the brokers' certificates; default: the system's CAs"
    )
    cert_file: Path | None = Field(default=None, description="PEM client certificate, for brokers that require one")
    key_file: Path | None = Field(default=None, description="PEM private key of cert_file (if not inside it)")
    key_password: SecretStr | None = Field(
        default=None, description="password of key_file: only from RTRL_KAFKA__SECURITY__KEY_PASSWORD"
    )
    check_hostname: bool = Field(default=True, description="the broker's certificate must name the host dialled")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="SCRAM-SHA-512", description="with SASL_PLAINTEXT or SASL_SSL"
    )
    username: str | None = Field(
        default=None, min_length=1, description="the SASL user (its password: RTRL_KAFKA_PASSWORD or password_file)"
    )
    password: SecretStr | None = Field(
        default=None, description="only from the environment: RTRL_KAFKA_PASSWORD (or use password_file)"
    )
    password_file: Path | None = Field(
        default=None, description="a file holding the SASL password (one line), e.g. a mounted secret"
    )

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurityConfig:
        for name in ("ca_file", "cert_file", "key_file", "password_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"kafka.security.{name}: {path} is not a readable file")
        if not self.tls and (self.ca_file or self.cert_file):
            raise ValueError(
                f"kafka.security.ca_file/cert_file need protocol SSL or SASL_SSL (protocol is {self.protocol})"
            )
        if self.key_file and not self.cert_file:
            raise ValueError("kafka.security.key_file needs cert_file (the certificate it belongs to)")
        if self.sasl:
            if not self.username:
                raise ValueError(f"protocol {self.protocol} needs kafka.security.username")
            if (self.password is None) == (self.password_file is None):
                raise ValueError(
                    f"protocol {self.protocol} needs exactly one of RTRL_KAFKA_PASSWORD "
                    "(kafka.security.password) and kafka.security.password_file"
                )
        elif self.username or self.password or self.password_file:
            raise ValueError(
                f"kafka.security.username/password are for SASL_SSL or SASL_PLAINTEXT (protocol is {self.protocol})"
            )
        return self


class KafkaConfig(_Section):
    bootstrap: str | None = Field(
        default=None, description="host:port list; default: the local broker `rtrl kafka up` runs"
    )
    connect_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="how long a client tries to reach the brokers before failing with the reason",
    )
    port: int = Field(default=19092, ge=1024, le=65535, description="local broker client port")
    controller_port: int = Field(
        default=19093, ge=1024, le=65535, description="the local broker's KRaft controller port"
    )
    version: str = Field(default="4.3.1", description="org.apache.kafka:kafka_2.13 version")
    heap: str = Field(default="512m", description="JVM heap of the local broker")
    partitions: int = Field(default=4, ge=1, le=1024, description="default partitions per topic")
    interactions_topic: str = Field(default="rtrl.interactions", description="what serving produced")
    feedback_topic: str = Field(default="rtrl.feedback", description="what users did next")
    model_updates_topic: str = Field(default="rtrl.model-updates", description="alias moves, announced to serving")
    max_message_bytes: int = Field(
        default=1 << 20,
        ge=1 << 16,
        le=1 << 30,
        description=(
            "the largest event a producer sends (kafka-python's max_request_size) and the max.message.bytes of the "
            "topics rtrl creates: match it to your topics'. An event over it, or one the broker refuses as too "
            "large, is set aside (<spool>/set-aside.jsonl, counted) instead of blocking the events behind it"
        ),
    )
    security: KafkaSecurityConfig = KafkaSecurityConfig()

    @model_validator(mode="after")
    def _ports_differ(self) -> KafkaConfig:
        if self.port == self.controller_port:
            raise ValueError("kafka.port and kafka.controller_port must differ")
        return self


class KafkaSecretError(ValueError):
    """A secret the security settings name cannot be read; the message names the setting."""


@dataclass(frozen=True)
class KafkaAccess:
    """Where the brokers are and how to authenticate: what every client is built from."""

    bootstrap: str
    security: KafkaSecurityConfig = field(default_factory=KafkaSecurityConfig)
    connect_timeout_s: float = 10.0
    max_message_bytes: int = 1 << 20  # kafka.max_message_bytes: producers' max_request_size, topics' max.message.bytes

    @classmethod
    def of(cls, access: KafkaAccess | str) -> KafkaAccess:
        """A bare "host:port" means a plaintext broker (the local one, tests, benchmarks)."""
        return access if isinstance(access, KafkaAccess) else cls(access)

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]

    def describe(self) -> str:
        """For messages and `rtrl status`: never a secret."""
        s = self.security
        how = s.protocol + (f", {s.sasl_mechanism} as {s.username}" if s.sasl else "")
        return f"{self.bootstrap} ({how})"

    def password(self) -> str | None:
        s = self.security
        if not s.sasl:
            return None
        if s.password is not None:
            return s.password.get_secret_value()
        if s.password_file is None:  # the section's validator refuses SASL without one of the two
            raise KafkaSecretError("kafka.security: SASL needs password (RTRL_KAFKA_PASSWORD) or password_file")
        try:
            value = s.password_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise KafkaSecretError(
                f"kafka.security.password_file {s.password_file} cannot be read: {exc.strerror}"
            ) from None
        if not value:
            raise KafkaSecretError(f"kafka.security.password_file {s.password_file} is empty")
        return value

    def client_params(self) -> dict[str, Any]:
        """kafka-python's connection settings (the same for consumers, producers and admins)."""
        s = self.security
        params: dict[str, Any] = {"bootstrap_servers": self.servers, "security_protocol": s.protocol}
        if s.tls:
            params.update(
                ssl_check_hostname=s.check_hostname,
                ssl_cafile=str(s.ca_file) if s.ca_file else None,
                ssl_certfile=str(s.cert_file) if s.cert_file else None,
                ssl_keyfile=str(s.key_file) if s.key_file else None,
                ssl_password=s.key_password.get_secret_value() if s.key_password else None,
            )
        if s.sasl:
            params.update(
                sasl_mechanism=s.sasl_mechanism, sasl_plain_username=s.username, sasl_plain_password=self.password()
            )
        return params


def security_env(security: KafkaSecurityConfig, with_secrets: bool = False) -> dict[str, str]:
    """The RTRL_* variables that give a process these settings (a password only when
    `with_secrets`: for a child process's environment, never for printing)."""
    env = {}
    for name, value in security.model_dump(exclude_defaults=True).items():
        if name in SECRET_FIELDS:
            continue
        env[f"RTRL_KAFKA__SECURITY__{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    if security.protocol != "PLAINTEXT":
        env["RTRL_KAFKA__SECURITY__PROTOCOL"] = security.protocol
    if with_secrets:
        if security.password is not None:
            env["RTRL_KAFKA_PASSWORD"] = security.password.get_secret_value()
        if security.key_password is not None:
            env["RTRL_KAFKA__SECURITY__KEY_PASSWORD"] = security.key_password.get_secret_value()
    return env
