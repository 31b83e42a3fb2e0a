"""What `rtrl kafka up --secure` gives the local broker: a CA, certificates and users, so the
suite and a developer meet the security a managed Kafka has (TLS, client certificates, SCRAM).

    <state>/kafka/tls/      ca.p12 ca.pem            a self-signed CA (keytool), its PEM for clients
                            broker.p12 truststore.p12 the broker's key and certificate (SAN 127.0.0.1,
                                                     localhost) signed by the CA; the CA it trusts
                            client.pem client.key    a client certificate (CN=rtrl) signed by the CA
    <state>/kafka/secrets/  store admin rtrl         keystore, inter-broker and client passwords (0600)
    <state>/kafka/secure                             the marker: written last, once all of the above is

The broker's SASL_SSL listener requires the client certificate, then a login: SCRAM-SHA-256 or
-512 (users written into the cluster metadata when the storage is formatted, with the broker's
own `StorageTool format --add-scram`) or PLAIN (users in the listener's JAAS config). User
`rtrl` is for clients; `admin` is the broker talking to itself.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

from pipeline.core.kafka_config import KafkaSecurityConfig

MARKER = "secure"
CLIENT_USER = "rtrl"
_VALID_DAYS = "3650"


class KafkaSecureError(RuntimeError):
    """The secure broker's material cannot be made; the message says what to do."""


def _tls(state: Path) -> Path:
    return state / "tls"


def _secret(state: Path, name: str) -> Path:
    return state / "secrets" / name


def client_security(state: Path) -> KafkaSecurityConfig:
    """The settings a client of this broker uses (what `rtrl kafka up --secure` prints)."""
    tls = _tls(state)
    return KafkaSecurityConfig(
        protocol="SASL_SSL",
        ca_file=tls / "ca.pem",
        cert_file=tls / "client.pem",
        key_file=tls / "client.key",
        sasl_mechanism="SCRAM-SHA-512",
        username=CLIENT_USER,
        password_file=_secret(state, CLIENT_USER),
    )


def make_material(state: Path) -> None:
    """Make the CA, the certificates and the passwords (replacing any half-made ones)."""
    if shutil.which("keytool") is None:
        raise KafkaSecureError("keytool (part of the JDK) is not on PATH: install a JDK 17+ to run a secure broker")
    tls, secret_dir = _tls(state), state / "secrets"
    for d in (tls, secret_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True, mode=0o700)
    for name in ("store", "admin", CLIENT_USER):
        path = _secret(state, name)
        path.write_text(secrets.token_urlsafe(24) + "\n")
        path.chmod(0o600)
    store_pw = _read(_secret(state, "store"))

    def keytool(*args: str) -> None:
        proc = subprocess.run(["keytool", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KafkaSecureError(f"keytool {args[0]} failed: {(proc.stdout + proc.stderr)[-1000:]}")

    def store(name: str) -> list[str]:
        return ["-keystore", str(tls / name), "-storetype", "PKCS12", "-storepass", store_pw]

    keytool(
        "-genkeypair",
        "-alias",
        "ca",
        "-keyalg",
        "RSA",
        "-keysize",
        "2048",
        "-dname",
        "CN=rtrl local CA",
        "-ext",
        "bc:c",
        "-validity",
        _VALID_DAYS,
        *store("ca.p12"),
    )
    keytool("-exportcert", "-rfc", "-alias", "ca", "-file", str(tls / "ca.pem"), *store("ca.p12"))
    keytool("-importcert", "-noprompt", "-alias", "ca", "-file", str(tls / "ca.pem"), *store("truststore.p12"))
    for name, dname, san in (
        ("broker", "CN=127.0.0.1", ["-ext", "SAN=IP:127.0.0.1,DNS:localhost"]),
        ("client", f"CN={CLIENT_USER}", []),
    ):
        keystore = store(f"{name}.p12")
        keytool(
            "-genkeypair",
            "-alias",
            name,
            "-keyalg",
            "RSA",
            "-keysize",
            "2048",
            "-dname",
            dname,
            "-validity",
            _VALID_DAYS,
            *keystore,
        )
        keytool("-certreq", "-alias", name, "-file", str(tls / f"{name}.csr"), *keystore)
        keytool(
            "-gencert",
            "-alias",
            "ca",
            "-infile",
            str(tls / f"{name}.csr"),
            "-outfile",
            str(tls / f"{name}.crt"),
            "-rfc",
            *san,
            "-ext",
            "ku:c=digitalSignature,keyEncipherment",
            "-ext",
            "eku=serverAuth,clientAuth",
            "-validity",
            _VALID_DAYS,
            *store("ca.p12"),
        )
        keytool("-importcert", "-noprompt", "-alias", "ca", "-file", str(tls / "ca.pem"), *keystore)
        keytool("-importcert", "-alias", name, "-file", str(tls / f"{name}.crt"), *keystore)
    _client_pem(tls, store_pw)
    (state / MARKER).write_text("SASL_SSL\n")


def _client_pem(tls: Path, password: str) -> None:
    """keytool writes no private key out; Python's ssl reads PEM: convert the client's PKCS12
    (with `cryptography`, which MLflow already depends on)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.serialization import pkcs12

    key, cert, _ = pkcs12.load_key_and_certificates((tls / "client.p12").read_bytes(), password.encode())
    (tls / "client.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = tls / "client.key"
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_file.chmod(0o600)


def _read(path: Path) -> str:
    return path.read_text().strip()


def broker_properties(state: Path) -> list[str]:
    """The SASL_SSL listener's lines of server.properties (the file is written 0600)."""
    tls, store_pw = _tls(state), _read(_secret(state, "store"))
    admin_pw, client_pw = _read(_secret(state, "admin")), _read(_secret(state, CLIENT_USER))
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule required"
    return [
        "ssl.keystore.type=PKCS12",
        f"ssl.keystore.location={tls / 'broker.p12'}",
        f"ssl.keystore.password={store_pw}",
        f"ssl.key.password={store_pw}",
        "ssl.truststore.type=PKCS12",
        f"ssl.truststore.location={tls / 'truststore.p12'}",
        f"ssl.truststore.password={store_pw}",
        # a SASL listener ignores the plain ssl.client.auth (KIP-684): only its own prefix counts
        "listener.name.sasl_ssl.ssl.client.auth=required",
        "sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
        f'listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config={scram} username="admin" password="{admin_pw}";',
        f"listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config={scram};",
        "listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule "
        f'required user_{CLIENT_USER}="{client_pw}";',
    ]


def scram_users(state: Path) -> list[str]:
    """StorageTool format's arguments that write the SCRAM users into the cluster metadata."""
    admin_pw, client_pw = _read(_secret(state, "admin")), _read(_secret(state, CLIENT_USER))
    users = [
        ("SCRAM-SHA-512", "admin", admin_pw),
        ("SCRAM-SHA-512", CLIENT_USER, client_pw),
        ("SCRAM-SHA-256", CLIENT_USER, client_pw),
    ]
    return [arg for mech, name, pw in users for arg in ("--add-scram", f"{mech}=[name={name},password={pw}]")]
