"""Test certificates (cryptography): a CA, server and client certificates it signed, and a rogue CA
with a client certificate of its own."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path  # another CA, and a client certificate it signed
    rogue_cert: Path
    rogue_key: Path


def _name(cn: str):
    from cryptography.x509.oid import NameOID
    from cryptography import x509

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(cn: str, issuer=None, ca: bool = False):
    """(key, cert): self-signed when issuer is None, else signed by issuer=(key, cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(cn))
         .issuer_name(_name(cn) if issuer is None else issuer[1].subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = (b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
    signer = key if issuer is None else issuer[0]
    return key, b.sign(signer, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    """A CA, a server and a client certificate it signed, and a rogue CA with its own client cert."""
    ca = _issue("specmesh-test-ca", ca=True)
    rogue = _issue("rogue-ca", ca=True)
    for name, pair in (("ca", ca), ("rogue-ca", rogue), ("server", _issue("localhost", ca)),
                       ("client", _issue("client", ca)), ("rogue", _issue("rogue", rogue))):
        _write(directory / name, *pair)
    d = directory
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
               d / "rogue-ca.crt", d / "rogue.crt", d / "rogue.key")
