"""The TLS files a client presents and trusts, as plain paths (picklable: Ray actors receive them),
and the channel they make. Used by `specmesh generate/health/keys/admin` and by health probes."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


def read_pem(path: str | None) -> bytes | None:
    """The file's bytes (None for None). Servers read them once at start; a ClientTls reads them
    each time it makes a channel (a probe then sees rotated files)."""
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class ClientTls:
    root_file: str | None = None  # CA to trust (None with a client cert: the system roots)
    cert_file: str | None = None  # client certificate, when the server requires one
    key_file: str | None = None
    server_name: str | None = None  # name expected in the server certificate (default: the address)

    @property
    def enabled(self) -> bool:
        return self.root_file is not None or self.cert_file is not None

    def channel(self, address: str) -> grpc.Channel:
        """A TLS channel to address when enabled, else plaintext."""
        if not self.enabled:
            return grpc.insecure_channel(address)
        creds = grpc.ssl_channel_credentials(root_certificates=read_pem(self.root_file),
                                             private_key=read_pem(self.key_file),
                                             certificate_chain=read_pem(self.cert_file))
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, creds, options=options)
