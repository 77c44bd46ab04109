"""Certificates for TLS tests, made fresh with ``cryptography``: a CA, a server certificate
for 127.0.0.1/localhost and client certificates, all as PEM bytes."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCA:
    """A throwaway certificate authority."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "stargrpc test CA") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256()))

    @property
    def cert(self) -> bytes:
        """The CA certificate."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, subject: x509.Name, *, server: bool) -> Issued:
        """A leaf certificate: for 127.0.0.1/localhost when ``server``, else a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self._name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def client(self, common_name: str | None, organization: str = "stargrpc tests") -> Issued:
        """A client certificate; without a common name the subject has only the O."""
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization)]
        if common_name is not None:
            attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        return self.issue(x509.Name(attributes), server=False)

    def server_files(self, folder: Path) -> dict[str, Path]:
        """Server certificate, key and this CA written to ``folder``, as the TLS settings
        name them."""
        issued = self.issue(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]),
                            server=True)
        paths = {"tls_cert_file": folder / "server.pem", "tls_key_file": folder / "server.key",
                 "tls_client_ca_file": folder / "ca.pem"}
        paths["tls_cert_file"].write_bytes(issued.cert)
        paths["tls_key_file"].write_bytes(issued.key)
        paths["tls_client_ca_file"].write_bytes(self.cert)
        return paths
