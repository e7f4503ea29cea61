"""The cluster's certificates: a CA made at first start, the API server's serving certificate, client
certificates for each component, and the service-account signing key."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)
API_SERVER_SANS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
API_SERVER_IPS = ("127.0.0.1", "10.0.0.1")


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate: CN is the user name, O entries are groups."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
NODE_AGENT = ClientIdentity("node-agent", "flotilla:node-agent", ("system:masters",))
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, NODE_AGENT)


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
    )


def _new_key():
    return ec.generate_private_key(ec.SECP256R1())


def _issue(
    pki_dir: Path, stem: str, subject: x509.Name, usage, sans: list[x509.GeneralName] | None = None
) -> None:
    """A key and a certificate signed by the CA in pki_dir, unless stem.crt exists."""
    if (pki_dir / f"{stem}.crt").exists():
        return
    ca_key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((pki_dir / "ca.crt").read_bytes())
    key = _new_key()
    builder = _builder(subject, ca_cert.subject, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    _write_key(pki_dir / f"{stem}.key", key)
    _write_cert(pki_dir / f"{stem}.crt", builder.sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]


def node_identities(node_name: str) -> tuple[ClientIdentity, ClientIdentity]:
    """A kubelet node's clients: the kubelet (the Node authorizer's system:node:NAME in system:nodes) and
    its kube-proxy (system:kube-proxy, which the default system:node-proxier binding grants)."""
    return (
        ClientIdentity(f"kubelet-{node_name}", f"system:node:{node_name}", ("system:nodes",)),
        ClientIdentity("kube-proxy", "system:kube-proxy"),
    )


def ensure_node_pki(pki_dir: Path, node_name: str, node_ip: str) -> None:
    """The certificates a kubelet node needs: its clients' and the kubelet's serving certificate (the API
    server reaches it at node_ip for logs and exec)."""
    for client in node_identities(node_name):
        _issue(pki_dir, client.file_stem, _name(client.user, client.groups), ExtendedKeyUsageOID.CLIENT_AUTH)
    sans: list[x509.GeneralName] = [x509.DNSName(node_name), x509.IPAddress(ipaddress.ip_address(node_ip))]
    _issue(pki_dir, f"kubelet-serving-{node_name}", _name(node_name), ExtendedKeyUsageOID.SERVER_AUTH, sans)


def _cert_ips(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def ensure_pki(pki_dir: Path, extra_server_ips: tuple[str, ...] = ()) -> None:
    """Creates whatever is missing; existing keys and certificates are kept so restarts reuse them.
    extra_server_ips: more addresses the API server is reached at (a kubelet node's bridge address); its
    certificate is issued again when it lacks one."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    ca_key_path, ca_cert_path = pki_dir / "ca.key", pki_dir / "ca.crt"
    if not ca_cert_path.exists():
        key = _new_key()
        name = _name("flotilla-local-ca")
        cert = (
            _builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        _write_key(ca_key_path, key)
        _write_cert(ca_cert_path, cert)

    server_ips = list(dict.fromkeys((*API_SERVER_IPS, *extra_server_ips)))
    apiserver_crt = pki_dir / "apiserver.crt"
    if apiserver_crt.exists() and not set(server_ips) <= _cert_ips(apiserver_crt):
        apiserver_crt.unlink()
    sans = [x509.DNSName(n) for n in API_SERVER_SANS] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips
    ]
    _issue(pki_dir, "apiserver", _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    for client in CLIENTS:
        _issue(pki_dir, client.file_stem, _name(client.user, client.groups), ExtendedKeyUsageOID.CLIENT_AUTH)

    if not (pki_dir / "sa.key").exists():
        sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(pki_dir / "sa.key", sa_key)
        (pki_dir / "sa.pub").write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def kubeconfig_text(
    server: str, pki_dir: Path, client: ClientIdentity, cluster_name: str = "flotilla-local"
) -> str:
    """A kubeconfig that points at files in pki_dir (absolute paths, so it works from any folder)."""
    pki = pki_dir.resolve()
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: {cluster_name}\n  cluster:\n    server: {server}\n"
        f"    certificate-authority: {pki / 'ca.crt'}\n"
        f"users:\n- name: {client.user}\n  user:\n"
        f"    client-certificate: {pki / (client.file_stem + '.crt')}\n"
        f"    client-key: {pki / (client.file_stem + '.key')}\n"
        f"contexts:\n- name: {cluster_name}\n  context:\n    cluster: {cluster_name}\n    user: {client.user}\n"
        f"current-context: {cluster_name}\n"
    )
