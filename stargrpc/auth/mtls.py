"""TLS serving and mutual TLS: server credentials from settings, and the principal named by
a verified client certificate."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from stargrpc.errors import AuthConfigError, CredentialsRejected
from stargrpc.file_trust import others_may_write
from stargrpc.principal import MAX_PRINCIPAL_CHARS, Principal
from stargrpc.settings import Settings


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials for the listening port, or None to serve plaintext.

    With ``tls_client_ca_file`` every client must present a certificate signed by that CA
    (grpcio offers no "optional client certificate" mode).

    Raises:
        OSError: A certificate or key file cannot be read.
        AuthConfigError: The client CA file is one any user may write, or another user
            owns: they could have put a CA of their own in it, and sign any principal.
    """
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    pair = (settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())
    client_ca = None
    if settings.tls_client_ca_file is not None:
        with settings.tls_client_ca_file.open("rb") as file:
            others = others_may_write(os.fstat(file.fileno()))
            if others is not None:
                raise AuthConfigError(
                    f"tls_client_ca_file {settings.tls_client_ca_file} {others}, who could "
                    "have put a CA of their own in it: refused (make it the server's "
                    "user's, mode 600 or 644)")
            client_ca = file.read()
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class CertificateIdentity:
    """Maps the client certificate gRPC verified to a :class:`Principal` (method "mtls").

    The principal id is the subject's common name, or the whole subject (RFC 4514) when it
    has none; a subject with two common names names nobody (refused). Roles come from
    ``mtls_roles`` (by principal id, plus the ``"*"`` entry).
    """

    def __init__(self, roles: Mapping[str, Sequence[str]]) -> None:
        self._roles = {name: frozenset(given) for name, given in roles.items()}

    def principal(self, auth_context: Mapping[str, Sequence[bytes]]) -> Principal | None:
        """The principal of the verified client certificate, if the peer presented one.

        Raises:
            CredentialsRejected: Its subject has more than one common name, or does not
                read (a common name that is not UTF-8).
        """
        pem = auth_context.get("x509_pem_cert")
        if not pem:
            return None
        try:
            subject = x509.load_pem_x509_certificate(pem[0]).subject
            names = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            principal_id = (str(names[0].value) if len(names) == 1
                            else "" if names else subject.rfc4514_string())
        except ValueError as exc:
            # TLS verified it, but its subject does not read (a common name that is not
            # UTF-8, say): it names nobody, and the caller is told as any refused one is.
            raise CredentialsRejected("certificate_unreadable") from exc
        if len(names) > 1:
            # Which one names the holder is the reader's guess (the first here, the last in
            # Go's crypto/x509, which many CAs check): an identity is never a guess.
            raise CredentialsRejected("certificate_two_common_names")
        if not principal_id:
            return None
        if len(principal_id) > MAX_PRINCIPAL_CHARS:
            # A subject of many long attributes and no common name (its RFC 4514 string).
            raise CredentialsRejected("certificate_subject_too_long")
        roles = self._roles.get(principal_id, frozenset()) | self._roles.get("*", frozenset())
        return Principal(id=principal_id, roles=roles, method="mtls")
