"""Throw-away certificates for the suite's mTLS mesh: a CA, one certificate it signed (server and
client use, valid for localhost and 127.0.0.1), and a rogue CA with a client certificate of its
own. Needs the `cryptography` package (the test extra)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SuitePki:
    ca: Path
    cert: Path  # signed by ca: every service's certificate and the suite's client certificate
    key: Path
    rogue_ca: Path
    rogue_cert: Path  # signed by rogue_ca
    rogue_key: Path


def _issue(cn: str, issuer=None, ca: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(name if issuer is None else issuer[1].subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    return key, builder.sign(key if issuer is None else issuer[0], hashes.SHA256())


def _write(path: Path, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_suite_pki(directory: Path) -> SuitePki:
    directory.mkdir(parents=True, exist_ok=True)
    ca, rogue_ca = _issue("specmesh-suite-ca", ca=True), _issue("rogue-ca", ca=True)
    for name, pair in (("ca", ca), ("rogue-ca", rogue_ca), ("mesh", _issue("localhost", ca)),
                       ("rogue", _issue("rogue", rogue_ca))):
        _write(directory / name, *pair)
    d = directory
    return SuitePki(d / "ca.crt", d / "mesh.crt", d / "mesh.key", d / "rogue-ca.crt", d / "rogue.crt", d / "rogue.key")
