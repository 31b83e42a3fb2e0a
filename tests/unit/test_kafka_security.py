"""Kafka security settings: `[kafka.security]` reaches every client's parameters, the password
comes from the environment and is never shown, every wrong setting is refused at load naming
the field, and masked secrets never reach a log line."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest

from pipeline.core import kafka_client
from pipeline.core.config import ConfigError, load_config
from pipeline.core.kafka_config import KafkaAccess, KafkaSecurityConfig, security_env
from pipeline.core.logs import JsonFormatter


def test_client_params_carry_tls_and_sasl(tmp_path):
    ca, pw = tmp_path / "ca.pem", tmp_path / "pw"
    ca.write_text("x")
    pw.write_text("s3cret-from-file\n")
    sec = KafkaSecurityConfig(
        protocol="SASL_SSL", ca_file=ca, sasl_mechanism="SCRAM-SHA-256", username="u", password_file=pw
    )
    params = KafkaAccess("b1:9093, b2:9093", sec).client_params()
    assert params == {
        "bootstrap_servers": ["b1:9093", "b2:9093"],
        "security_protocol": "SASL_SSL",
        "ssl_check_hostname": True,
        "ssl_cafile": str(ca),
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_password": None,
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "u",
        "sasl_plain_password": "s3cret-from-file",
    }
    assert KafkaAccess("b:1").client_params() == {"bootstrap_servers": ["b:1"], "security_protocol": "PLAINTEXT"}


def test_the_password_comes_from_the_environment_and_is_never_shown(tmp_path):
    cfg = load_config(
        environ={
            "RTRL_KAFKA__SECURITY__PROTOCOL": "SASL_SSL",
            "RTRL_KAFKA__SECURITY__USERNAME": "u",
            "RTRL_KAFKA_PASSWORD": "hunter2-hunter2",
        }
    )
    assert cfg.kafka_access.client_params()["sasl_plain_password"] == "hunter2-hunter2"
    for shown in (
        repr(cfg),
        str(cfg.model_dump()),
        cfg.model_dump_json(),
        cfg.kafka_access.describe(),
        json.dumps(security_env(cfg.kafka.security)),
    ):
        assert "hunter2" not in shown
    assert security_env(cfg.kafka.security, with_secrets=True)["RTRL_KAFKA_PASSWORD"] == "hunter2-hunter2"


@pytest.mark.parametrize(
    "section, env, named",
    [
        ('password = "x"', {}, "kafka.security.password must not be written in the config file"),
        ('key_password = "x"', {}, "kafka.security.key_password must not be written"),
        ('protocol = "SASL_SSL"', {}, "needs kafka.security.username"),
        ('protocol = "SASL_SSL"\nusername = "u"', {}, "needs exactly one of RTRL_KAFKA_PASSWORD"),
        ('protocol = "SSL"\nca_file = "/nonexistent/ca.pem"', {}, "kafka.security.ca_file: /nonexistent/ca.pem is not"),
        ('ca_file = "/etc/hostname"', {}, "need protocol SSL or SASL_SSL"),
        ('username = "u"', {"RTRL_KAFKA_PASSWORD": "x"}, "are for SASL_SSL or SASL_PLAINTEXT"),
    ],
)
def test_bad_security_settings_are_refused_at_load_naming_the_field(tmp_path, section, env, named):
    path = tmp_path / "rtrl.toml"
    path.write_text(f"[kafka.security]\n{section}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ=env)
    assert named in str(err.value)


def test_masked_secrets_never_reach_a_log_line():
    kafka_client.logs.mask('p@ss"word-123')
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger(f"test.mask.{uuid.uuid4().hex}")
    log.addHandler(handler)
    log.warning("config %s", {"sasl_plain_password": 'p@ss"word-123'}, extra={"pw": 'p@ss"word-123'})
    assert "word-123" not in out.getvalue() and out.getvalue().count("***") == 2
