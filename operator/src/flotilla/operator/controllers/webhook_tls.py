"""TLS for the admission webhook: a CA the operator generates once and keeps in a Secret, and a serving
certificate signed by it.

kopf can generate a self-signed certificate itself, but through certbuilder/oscrypto, which fail on this
OpenSSL (FIELD-NOTES); `cryptography` does it here. The CA lives in a Secret so that every replica and
every restart serves a certificate the same caBundle verifies: the webhook configuration kopf writes
does not change under the API server's feet. The serving certificate is re-issued when it does not
cover the webhook's host or is about to expire.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SECRET_NAME = "flotilla-webhook-tls"
CA_DAYS, SERVING_DAYS, RENEW_DAYS = 3650, 365, 30


@dataclass(frozen=True)
class Material:
    ca_cert: bytes  # PEM
    ca_key: bytes
    cert: bytes
    key: bytes

    def to_secret_data(self) -> dict[str, str]:
        raw = {"ca.crt": self.ca_cert, "ca.key": self.ca_key, "tls.crt": self.cert, "tls.key": self.key}
        return {k: base64.b64encode(v).decode() for k, v in raw.items()}

    @classmethod
    def from_secret_data(cls, data: dict[str, str]) -> Material:
        raw = {k: base64.b64decode(v) for k, v in (data or {}).items()}
        return cls(raw["ca.crt"], raw["ca.key"], raw["tls.crt"], raw["tls.key"])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def new_ca(now: dt.datetime) -> tuple[bytes, bytes]:
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flotilla-webhook-ca")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def new_serving(ca_cert: bytes, ca_key: bytes, hosts: list[str], now: dt.datetime) -> tuple[bytes, bytes]:
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVING_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def serving_ok(material: Material, hosts: list[str], now: dt.datetime) -> bool:
    """The serving certificate covers every host, chains to the CA, and is not close to expiry."""
    cert = x509.load_pem_x509_certificate(material.cert)
    ca = x509.load_pem_x509_certificate(material.ca_cert)
    if cert.issuer != ca.subject or _expires_within(material.cert, now, RENEW_DAYS):
        return False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return all(_san(h) in names for h in hosts)


def ensure(existing: Material | None, hosts: list[str], now: dt.datetime) -> Material:
    """The material to serve: the existing one if still good; else a new serving cert from the same CA
    (a new CA only when there is none, or it expires before the serving cert would)."""
    if existing is not None and serving_ok(existing, hosts, now):
        return existing
    if existing is None or _expires_within(existing.ca_cert, now, SERVING_DAYS):
        ca_cert, ca_key = new_ca(now)
    else:
        ca_cert, ca_key = existing.ca_cert, existing.ca_key
    cert, key = new_serving(ca_cert, ca_key, hosts, now)
    return Material(ca_cert, ca_key, cert, key)


def _expires_within(pem: bytes, now: dt.datetime, days: int) -> bool:
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc - now < dt.timedelta(days=days)


def write_files(material: Material, directory: Path) -> tuple[Path, Path, Path]:
    """cafile, certfile, pkeyfile for kopf.WebhookServer (keys readable by the owner only)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    for path, data in zip(paths, (material.ca_cert, material.cert, material.key), strict=True):
        path.touch(mode=0o600)
        path.write_bytes(data)
    return paths


def mounted_files(directory: Path) -> tuple[Path | None, Path, Path]:
    """cafile (None when the Secret has no ca.crt), certfile, pkeyfile from a mounted TLS Secret.

    Fails at start with the missing path, rather than serving a webhook the API server cannot trust."""
    cert, key, ca = directory / "tls.crt", directory / "tls.key", directory / "ca.crt"
    missing = [str(p) for p in (cert, key) if not p.is_file()]
    if missing:
        raise SystemExit(f"flotilla operator: --webhook-tls-dir {directory}: missing {', '.join(missing)}")
    return (ca if ca.is_file() else None), cert, key
