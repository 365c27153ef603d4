"""TLS for the gRPC server: a certificate and key, and optionally a CA whose client certificates
the server demands (mutual TLS).

Files are read (and checked) once at start-up, so a typo fails `raypaged launch` with a message
naming the file, not the first handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str  # PEM: the server's certificate chain
    key_file: str  # PEM: its private key
    client_ca_file: str | None = None  # PEM: set → clients must present a certificate it signed

    @property
    def requires_client_certificates(self) -> bool:
        return self.client_ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert = _read_pem(self.cert_file, "certificate", b"CERTIFICATE")
        key = _read_pem(self.key_file, "private key", b"PRIVATE KEY")
        client_ca = None
        if self.client_ca_file is not None:
            client_ca = _read_pem(self.client_ca_file, "client CA certificate", b"CERTIFICATE")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)


def _read_pem(path: str, what: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {e.strerror or e}") from None
    # "BEGIN CERTIFICATE", "BEGIN PRIVATE KEY", "BEGIN RSA PRIVATE KEY", "BEGIN EC PRIVATE KEY"
    if b"-----BEGIN " not in data or marker not in data:
        raise ValueError(f"the TLS {what} {path!r} is not a PEM file holding a {marker.decode().lower()}")
    return data
