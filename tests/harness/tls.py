"""A certificate authority of the test's own, and a ``redis-server`` that speaks TLS only.

`make_certificates` writes a CA and, signed by it, a server certificate for
``127.0.0.1`` and ``localhost`` and a client certificate, with the
``openssl`` command line (OpenSSL 1.1.1 or later): nothing to install. Every
key is an EC P-256 key, every certificate lives two days, and each carries
the extensions a strict verifier asks for (Python 3.13 sets
``VERIFY_X509_STRICT``). `TlsRedisServer` listens on a TLS port alone
(``--port 0``) and asks every client for a certificate of the same CA.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from pathlib import Path

    import redis.asyncio

    from tests.harness.support import AclUser

__all__ = ["Certificates", "TlsRedisServer", "find_openssl", "make_certificates"]

#: ``openssl`` configuration: the distinguished name comes from ``-subj``, the extensions from these sections.
_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = {hosts}
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""

#: Who the server certificate is for, unless told otherwise.
LOOPBACK = ("IP:127.0.0.1", "DNS:localhost")


def find_openssl() -> str | None:
    """The ``openssl`` command line on ``PATH``."""
    return shutil.which("openssl")


@dataclass(frozen=True, slots=True)
class Certificates:
    """Where `make_certificates` wrote each file (PEM)."""

    ca: Path
    server_certificate: Path
    server_key: Path
    client_certificate: Path
    client_key: Path


def _openssl(openssl: str, directory: Path, *arguments: str) -> None:
    subprocess.run(
        [openssl, *arguments], cwd=directory, check=True, capture_output=True, timeout=60
    )  # fmt: skip


def make_certificates(
    openssl: str, directory: Path, *, name: str = "aiosem test CA", hosts: tuple[str, ...] = LOOPBACK
) -> Certificates:
    """Write a CA, a server certificate for ``hosts`` and a client certificate into ``directory``.

    Args:
        openssl: The ``openssl`` binary.
        directory: Created if missing; the files are named after their role.
        name: The CA's common name: two CAs made with different names are
            strangers to each other.
        hosts: The server certificate's subject alternative names.

    Raises:
        subprocess.CalledProcessError: ``openssl`` failed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "openssl.cnf"
    config.write_text(_CONFIG.format(hosts=", ".join(hosts)))
    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        openssl, directory, "req", "-config", config.name, "-x509", *key, "-days", "2",
        "-subj", f"/CN={name}", "-extensions", "ca", "-keyout", "ca.key", "-out", "ca.crt",
    )  # fmt: skip
    for role, common_name in (("server", "localhost"), ("client", "aiosem test client")):
        _openssl(
            openssl, directory, "req", "-config", config.name, "-new", *key,
            "-subj", f"/CN={common_name}", "-keyout", f"{role}.key", "-out", f"{role}.csr",
        )  # fmt: skip
        _openssl(
            openssl, directory, "x509", "-req", "-in", f"{role}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", config.name, "-extensions", role, "-out", f"{role}.crt",
        )  # fmt: skip
    return Certificates(
        ca=directory / "ca.crt",
        server_certificate=directory / "server.crt",
        server_key=directory / "server.key",
        client_certificate=directory / "client.crt",
        client_key=directory / "client.key",
    )


class TlsRedisServer(RedisServer):
    """A ``redis-server`` that listens on a TLS port only and verifies its clients' certificates.

    `url` and `client` verify the server against the CA, host name
    included, and present the client certificate. The set-up's own
    connections (`admin_client`, the readiness probe) check the CA but not
    the host name: a test may give the server a certificate for another
    host on purpose.
    """

    scheme = "rediss"

    def __init__(self, binary: str, directory: Path, certificates: Certificates, user: AclUser | None = None) -> None:
        super().__init__(binary, directory, user=user)
        self.certificates = certificates

    def listen_arguments(self) -> tuple[str, ...]:
        certificates = self.certificates
        return (
            "--port", "0",
            "--tls-port", str(self.port),
            "--tls-cert-file", str(certificates.server_certificate),
            "--tls-key-file", str(certificates.server_key),
            "--tls-ca-cert-file", str(certificates.ca),
            "--tls-auth-clients", "yes",
        )  # fmt: skip

    def tls_options(self) -> dict[str, str]:
        """redis-py's options for a verified connection with the client certificate, as text."""
        return {
            "ssl_ca_certs": str(self.certificates.ca),
            "ssl_certfile": str(self.certificates.client_certificate),
            "ssl_keyfile": str(self.certificates.client_key),
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": "true",
        }

    def url_query(self) -> str:
        return "?" + urlencode(self.tls_options())

    def connection_options(self) -> dict[str, Any]:
        return {**self.tls_options(), "ssl": True, "ssl_check_hostname": False}

    def client(self, **options: object) -> redis.asyncio.Redis:
        return super().client(**{"ssl_check_hostname": True, **options})
