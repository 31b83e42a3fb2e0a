"""A real single-node Apache Kafka (KRaft) on 127.0.0.1, for development, the demo and tests.

    jars     Maven Central, org.apache.kafka:kafka_2.13 + slf4j-api 1.7.36 + slf4j-simple
             (a 1.x binding), copied once into <cache>/kafka-<version>/libs by `mvn`
    storage  kafka.tools.StorageTool format --standalone  (once, into <state>/kafka/data)
    broker   java -Xmx<heap> kafka.Kafka server.properties, detached, pid in broker.pid
    ready    the log says "Kafka Server started" and the client port accepts connections

`--secure` (decided when the storage is formatted, kept for its life): the client port is a
SASL_SSL listener that requires a client certificate and a SCRAM or PLAIN login, the way a
managed Kafka is set up (pipeline/kafka_secure.py makes the CA, the certificates and the users).
The controller port stays plaintext, on 127.0.0.1 like everything here.

Everything lives under the state folder, so `rtrl kafka down` and deleting the folder is a
full reset. Nothing here listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline import kafka_secure
from pipeline.core.config import Config
from pipeline.core.kafka_config import KafkaAccess

SLF4J_VERSION = "1.7.36"


class KafkaLocalError(RuntimeError):
    """The local broker cannot be set up or started; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("RTRL_CACHE_DIR", Path.home() / ".cache" / "rtrl"))


@dataclass(frozen=True)
class LocalBroker:
    state: Path  # <state>/kafka
    libs: Path
    port: int
    controller_port: int
    heap: str
    partitions: int

    @classmethod
    def from_config(cls, cfg: Config) -> LocalBroker:
        k = cfg.kafka
        return cls(
            state=cfg.state_dir / "kafka",
            libs=cache_dir() / f"kafka-{k.version}" / "libs",
            port=k.port,
            controller_port=k.controller_port,
            heap=k.heap,
            partitions=k.partitions,
        )

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.state / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.state / "broker.pid"

    def pid(self) -> int | None:
        """The broker's pid if it is alive."""
        try:
            pid = int(self.pid_file.read_text().strip())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        # a zombie (exited, unreaped child) is not a running broker
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return None
        except (FileNotFoundError, IndexError):
            pass
        return pid

    @property
    def secure(self) -> bool:
        """Formatted with --secure: SASL_SSL on the client port."""
        return (self.state / kafka_secure.MARKER).exists()

    def access(self) -> KafkaAccess:
        """How a client reaches this broker (its own users and CA when it is secure)."""
        if not self.secure:
            return KafkaAccess(self.bootstrap)
        return KafkaAccess(self.bootstrap, kafka_secure.client_security(self.state))

    def accepting(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0


def ensure_jars(broker: LocalBroker, version: str, progress=print) -> None:
    """Fetch the broker jars with Maven once; later calls are free."""
    marker = broker.libs / ".complete"
    if marker.exists():
        return
    if shutil.which("mvn") is None:
        raise KafkaLocalError(
            "Maven (mvn) is not installed: install it (apt-get install maven) to fetch the Kafka broker"
        )
    progress(f"fetching org.apache.kafka:kafka_2.13:{version} from Maven Central into {broker.libs} ...")
    pom = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>rtrl</groupId><artifactId>kafka-broker</artifactId><version>1</version><packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{version}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>{SLF4J_VERSION}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-simple</artifactId><version>{SLF4J_VERSION}</version></dependency>
  </dependencies>
</project>"""
    broker.libs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pom.xml").write_text(pom)
        proc = subprocess.run(
            [
                "mvn",
                "-q",
                "-B",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={broker.libs}",
                "-DincludeScope=runtime",
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise KafkaLocalError(f"mvn could not fetch the Kafka broker:\n{(proc.stdout + proc.stderr)[-2000:]}")
    marker.write_text(version)


def _properties(broker: LocalBroker) -> str:
    data = broker.state / "data"
    client = "SASL_SSL" if broker.secure else "PLAINTEXT"
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"listeners={client}://127.0.0.1:{broker.port},CONTROLLER://127.0.0.1:{broker.controller_port}",
            f"advertised.listeners={client}://127.0.0.1:{broker.port},CONTROLLER://127.0.0.1:{broker.controller_port}",
            "controller.listener.names=CONTROLLER",
            f"inter.broker.listener.name={client}",
            f"listener.security.protocol.map=CONTROLLER:PLAINTEXT,{client}:{client}",
            f"controller.quorum.bootstrap.servers=127.0.0.1:{broker.controller_port}",
            f"log.dirs={data}",
            f"num.partitions={broker.partitions}",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=4",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true",
            *(kafka_secure.broker_properties(broker.state) if broker.secure else []),
            "",
        ]
    )


def _java(broker: LocalBroker, main: str, *args: str, heap: str | None = None) -> list[str]:
    cmd = ["java"]
    if heap:
        cmd += [f"-Xmx{heap}", f"-Xms{heap}"]
    return cmd + [
        "-XX:+UseSerialGC",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
        "-cp",
        f"{broker.libs}/*",
        main,
        *args,
    ]


def up(cfg: Config, progress=print, timeout_s: float = 120.0, secure: bool = False) -> LocalBroker:
    """Start the broker (fetching and formatting first if needed); return once it serves.
    `secure` applies when the storage is formatted; a broker formatted plaintext stays so."""
    broker = LocalBroker.from_config(cfg)
    formatted = (broker.state / "data" / "meta.properties").exists()
    if secure and formatted and not broker.secure:
        raise KafkaLocalError(
            f"the broker under {broker.state} was set up without --secure, and stays so: to start it secure, "
            f"`rtrl kafka down`, delete {broker.state} (its topics go with it) and `rtrl kafka up --secure`"
        )
    if broker.pid() is not None and broker.accepting():
        progress(
            f"kafka already running on {broker.bootstrap} (pid {broker.pid()}{', SASL_SSL' if broker.secure else ''})"
        )
        return broker
    if shutil.which("java") is None:
        raise KafkaLocalError(
            "Java is not installed: install a JDK 17+ (apt-get install openjdk-17-jre-headless) "
            "to run the local Kafka broker"
        )
    ensure_jars(broker, cfg.kafka.version, progress)
    for port in (cfg.kafka.port, cfg.kafka.controller_port):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise KafkaLocalError(
                    f"port {port} on 127.0.0.1 is taken (a broker started with another state folder?): stop it with "
                    f"`RTRL_STATE_DIR=<its folder> rtrl kafka down`, or set kafka.port / kafka.controller_port"
                )
    broker.state.mkdir(parents=True, exist_ok=True)
    if secure and not formatted:
        progress("making a CA, the broker's and a client's certificates (keytool) and SCRAM users")
        kafka_secure.make_material(broker.state)
    props = broker.state / "server.properties"
    props.write_text(_properties(broker))
    props.chmod(0o600)  # a secure broker's holds its keystore and admin passwords
    if not formatted:
        cluster_id = _cluster_id()
        users = kafka_secure.scram_users(broker.state) if broker.secure else []
        fmt = subprocess.run(
            _java(
                broker, "kafka.tools.StorageTool", "format", "--standalone", "-t", cluster_id, "-c", str(props), *users
            ),
            capture_output=True,
            text=True,
        )
        if fmt.returncode != 0:
            raise KafkaLocalError(f"formatting Kafka storage failed:\n{(fmt.stdout + fmt.stderr)[-2000:]}")
    progress(
        f"starting kafka {cfg.kafka.version} on {broker.bootstrap}{' (SASL_SSL)' if broker.secure else ''} "
        f"(logs: {broker.log_file})"
    )
    with open(broker.log_file, "ab") as logf:
        proc = subprocess.Popen(
            _java(broker, "kafka.Kafka", str(props), heap=broker.heap),
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    broker.pid_file.write_text(str(proc.pid))
    start_offset = broker.log_file.stat().st_size if broker.log_file.exists() else 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KafkaLocalError(
                f"kafka exited with code {proc.returncode}; last log lines:\n{_tail(broker.log_file)}"
            )
        if broker.accepting() and _log_says_started(broker.log_file, start_offset):
            return broker
        time.sleep(0.2)
    raise KafkaLocalError(f"kafka did not become ready in {timeout_s:.0f}s; see {broker.log_file}")


def _cluster_id() -> str:
    """A Kafka cluster id (base64url UUID). Like Kafka's own Uuid.randomUuid(), never one that
    starts with '-': the storage tool would read it as an option."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _log_says_started(log_file: Path, since: int) -> bool:
    """True once this start (the log after byte `since`) reports the server started."""
    with open(log_file, "rb") as f:
        f.seek(since)
        return b"Kafka Server started" in f.read()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def down(cfg: Config, timeout_s: float = 30.0) -> bool:
    """Stop the broker gracefully (SIGTERM, then SIGKILL after the timeout). False if not running."""
    broker = LocalBroker.from_config(cfg)
    pid = broker.pid()
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and broker.pid() is not None:
        time.sleep(0.2)
    if broker.pid() is not None:
        os.kill(pid, signal.SIGKILL)
    broker.pid_file.unlink(missing_ok=True)
    return True


def ensure_topics(access: KafkaAccess | str, topics: list[str], partitions: int) -> None:
    """Create the topics if they do not exist (idempotent), taking records up to the access's
    max_message_bytes."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    from pipeline.core import kafka_client

    admin = kafka_client.admin(access, client_id="rtrl-admin")
    try:
        existing = set(admin.list_topics())
        limit = {"max.message.bytes": str(KafkaAccess.of(access).max_message_bytes)}  # what producers send
        new = [NewTopic(t, partitions, 1, topic_configs=limit) for t in topics if t not in existing]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
