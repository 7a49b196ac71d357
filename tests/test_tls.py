"""TLS, mutual TLS and the Inference API key, with real certificates made here (a CA, a server certificate
for localhost, a client certificate): the Python client, the CLI and grpc-js connect; plaintext, missing
certificates and missing or wrong keys are refused with UNAVAILABLE or UNAUTHENTICATED."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmgate.client import Client, Tls
from lmgate.client.cli import main
from lmgate.engine.config import EngineConfig
from lmgate.service.server import TlsFiles
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc
from tests.serving import ServerThread
from tests.test_sleep import code_of

API_KEY = "k3y-for-tests"
JS_DIR = Path(__file__).parent / "js"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str, key, issuer_cert, issuer_key, *, ca: bool = False, hosts: tuple[str, ...] = ()
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_cert.subject if issuer_cert else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM files: a CA, a server certificate for localhost and 127.0.0.1, and a client certificate."""
    root = tmp_path_factory.mktemp("pki")
    files = {}

    def write(name: str, data: bytes) -> None:
        files[name] = str(root / name)
        (root / name).write_bytes(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("lmgate test CA", ca_key, None, None, ca=True)
    write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for who, hosts in (("server", ("localhost", "127.0.0.1")), ("client", ())):
        key = ec.generate_private_key(ec.SECP256R1())
        write(
            f"{who}.pem",
            _issue(f"lmgate test {who}", key, ca, ca_key, hosts=hosts).public_bytes(serialization.Encoding.PEM),
        )
        write(
            f"{who}-key.pem",
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
    return files


@pytest.fixture(scope="module")
def tls_server(checkpoint, pki):
    """TLS and an API key on the Inference service."""
    s = ServerThread(
        EngineConfig(dtype="float32", kv_cache_tokens=1024),
        checkpoint,
        tls=TlsFiles(pki["server.pem"], pki["server-key.pem"]),
        api_key=API_KEY,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mtls_server(checkpoint, pki):
    s = ServerThread(
        EngineConfig(dtype="float32", kv_cache_tokens=1024),
        checkpoint,
        tls=TlsFiles(pki["server.pem"], pki["server-key.pem"], client_ca=pki["ca.pem"]),
    )
    yield s
    s.stop()


def target(server) -> str:
    return f"localhost:{server.server.port}"


def generate(client: Client) -> list[int]:
    return [t for d in client.generate("Hello", max_new_tokens=4, ignore_eos=True) for t in d.token_ids]


def test_tls_with_api_key_accepts_the_key_and_refuses_the_rest(tls_server, pki, caplog):
    """A Generate the key refuses is counted and logged, as every refused Generate is."""
    tls = Tls(ca=pki["ca.pem"])
    with Client(target(tls_server), tls=tls, api_key=API_KEY, timeout=60) as client:
        assert len(generate(client)) == 4 and client.info().model
    refusals = tls_server.server.metrics.refusals.labels(tls_server.server.metrics.model_name, "UNAUTHENTICATED")
    before = refusals._value.get()
    with caplog.at_level(logging.INFO, logger="lmgate.access"):
        for key in (None, "wrong"):
            with Client(target(tls_server), tls=tls, api_key=key, timeout=60) as client:
                assert code_of(lambda: generate(client)) == grpc.StatusCode.UNAUTHENTICATED
                assert code_of(client.info) == grpc.StatusCode.UNAUTHENTICATED
                assert code_of(client.start) == grpc.StatusCode.UNAUTHENTICATED
    assert refusals._value.get() == before + 2
    assert [r.fields["outcome"] for r in caplog.records if r.name == "lmgate.access"] == ["UNAUTHENTICATED"] * 2
    with grpc.secure_channel(target(tls_server), tls.credentials()) as channel:  # health needs no key
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        info = pb_grpc.InferenceStub(channel).Info
        assert info(pb.InfoRequest(), metadata=[("authorization", f"BEARER {API_KEY}")]).model  # the scheme in any case
    with Client(target(tls_server), api_key=API_KEY, timeout=10) as plaintext:
        assert code_of(plaintext.info) == grpc.StatusCode.UNAVAILABLE


def test_a_list_of_replicas_over_tls_verifies_the_name_their_certificate_carries(tls_server, pki):
    """A ring-hash channel's authority is its whole list of addresses, which no certificate names: the
    replicas' shared name is given as server_name, and it is the name verified."""
    replicas = [f"127.0.0.1:{tls_server.server.port}"] * 2
    with pytest.raises(ValueError, match="server_name"):
        Client(replicas, tls=Tls(ca=pki["ca.pem"]))
    with Client(replicas, tls=Tls(ca=pki["ca.pem"], server_name="localhost"), api_key=API_KEY, timeout=60) as client:
        assert len(generate(client)) == 4
    with Client(
        replicas, tls=Tls(ca=pki["ca.pem"], server_name="elsewhere.example"), api_key=API_KEY, timeout=10
    ) as client:
        assert code_of(client.info) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate(mtls_server, pki):
    with Client(
        target(mtls_server), tls=Tls(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"]), timeout=60
    ) as client:
        assert len(generate(client)) == 4
    with Client(target(mtls_server), tls=Tls(pki["ca.pem"]), timeout=10) as anonymous:
        assert code_of(anonymous.info) == grpc.StatusCode.UNAVAILABLE


def test_cli_over_tls_with_api_key(tls_server, pki, capsys):
    base = ["--target", target(tls_server), "--tls-ca", pki["ca.pem"]]
    assert main(["generate", "Hello", "--max-new-tokens", "3", "--ignore-eos", "--api-key", API_KEY, *base]) == 0
    assert "finish_reason=length" in capsys.readouterr().err
    assert main(["info", *base]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_grpc_js_client_over_tls_with_api_key(tls_server, pki):
    def run(key: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "LMGATE_API_KEY"}
        env.update({"LMGATE_TLS_CA": pki["ca.pem"], **({"LMGATE_API_KEY": key} if key else {})})
        return subprocess.run(
            ["node", str(JS_DIR / "generate.js"), target(tls_server), "Hello"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    ok = run(API_KEY)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["usage"]["completion_tokens"] == 16
    refused = run(None)
    assert refused.returncode == 1 and "error: 16" in refused.stderr  # 16: UNAUTHENTICATED
