"""Off loopback the control surface serves TLS or nothing (#46 finding 5): bearer tokens and
`kv:forget` credentials never cross the network in clear. A real certificate made in the test
with `cryptography`, real uvicorn serving it, a real httpx client verifying it."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvci_plugin.api.client import ControlCallError, ControlClient
from kvci_plugin.api.schema import ENDPOINT
from kvci_plugin.api.server import start_control_server
from kvci_plugin.connector.config import KVCIConfig

OPERATOR_FILE = "control-operator.token"


def make_certificate(folder: Path, name: str = "kvci test") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = (
        folder / f"{name.replace(' ', '-')}.crt",
        folder / f"{name.replace(' ', '-')}.key",
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


def test_off_loopback_without_tls_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "operator.token"
    token.write_text("s3cret-control-token-0123456789\n")
    token.chmod(0o600)
    for host in ("0.0.0.0", "10.1.2.3", "kvci.example"):
        with pytest.raises(ValueError, match="TLS") as refused:
            KVCIConfig(
                control_host=host, control_port=0, control_token_file=token, state_dir=tmp_path
            )
        assert "control_tls_cert_file" in str(refused.value)
    cert, key = make_certificate(tmp_path)
    with pytest.raises(ValueError, match="together"):
        KVCIConfig(control_port=0, control_tls_cert_file=cert, state_dir=tmp_path)


def test_tls_serving_with_a_test_certificate(world: Any, tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    state = tmp_path / "state"
    server = start_control_server(world.side, KVCIConfig(
        control_host="0.0.0.0", control_port=0, control_tls_cert_file=cert,
        control_tls_key_file=key, state_dir=state))
    url = f"https://127.0.0.1:{server.port}"
    try:
        assert server.url.startswith("https://")
        with ControlClient(url, token_file=state / OPERATOR_FILE, ca_file=cert) as client:
            assert client.call({"action": "ram_stats"})["action"] == "ram_stats"
        # Plain HTTP to the TLS port gets no answer from the surface.
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{server.port}{ENDPOINT}", json={"action": "ram_stats"},
                       timeout=5)
        # A certificate the client does not trust: no call goes out.
        other, _ = make_certificate(tmp_path, "someone else")
        with ControlClient(url, token_file=state / OPERATOR_FILE, ca_file=other) as client, \
                pytest.raises(ControlCallError) as untrusted:
            client.call({"action": "ram_stats"})
        assert untrusted.value.code == "unreachable"
        assert (
            "CERTIFICATE_VERIFY_FAILED" in untrusted.value.message
            or isinstance(untrusted.value.__cause__, ssl.SSLError)
            or "certificate" in untrusted.value.message.lower()
        )
    finally:
        server.stop()
