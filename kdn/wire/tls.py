"""TLS for every KDN endpoint, declared once: which PEM files, when TLS is on, and the credentials.

The three roles keep their flat config keys (``tls_cert``/``tls_key``/``tls_ca`` on the edge,
origin and host client; ``upstream_tls_*`` on the edge), so config files and flags do not change;
what those keys mean lives here:

- a **server** serves TLS when it has a certificate; ``cert`` and ``key`` go together; ``ca`` makes
  it require client certificates signed by that CA (mTLS) and needs a certificate of its own;
- a **client** uses TLS when it names a CA to verify the server with or a certificate to present
  (mTLS); ``cert`` and ``key`` go together; with no CA the system roots verify the server.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TlsFiles"]


class TlsFiles(BaseModel):
    """PEM files for TLS. ``ca`` set on a server means clients must present a certificate (mTLS)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cert: Path | None = Field(None, description="PEM certificate chain this side presents")
    key: Path | None = Field(None, description="PEM private key of cert")
    ca: Path | None = Field(
        None, description="PEM CA: a server requires client certificates signed by it; a client verifies the server"
    )

    @model_validator(mode="after")
    def _pair(self) -> "TlsFiles":
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self

    @classmethod
    def for_server(cls, cert: str | Path | None, key: str | Path | None, ca: str | Path | None) -> "TlsFiles | None":
        """The server's TLS from its config keys; None = plaintext. ValueError names the bad key."""
        files = cls(cert=cert or None, key=key or None, ca=ca or None)
        if files.ca is not None and files.cert is None:
            raise ValueError("tls_ca (mTLS) needs tls_cert and tls_key")
        return files if files.cert is not None else None

    @classmethod
    def for_client(cls, cert: str | Path | None, key: str | Path | None, ca: str | Path | None) -> "TlsFiles | None":
        """A client's TLS from its config keys; None = plaintext. ValueError names the bad key."""
        files = cls(cert=cert or None, key=key or None, ca=ca or None)
        return files if files.ca is not None or files.cert is not None else None

    def check_server_files(self) -> None:
        """Refuse, with one ``ConfigError`` line that names the file, a certificate, key or CA
        that cannot be read, or a key that is not the certificate's (gRPC would only say that
        it failed to bind)."""
        import ssl

        from kdn.errors import ConfigError

        assert self.cert and self.key, "a TLS server needs cert and key"
        for what, path in (("tls_cert", self.cert), ("tls_key", self.key), ("tls_ca", self.ca)):
            if path is None:
                continue
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        except ssl.SSLError as exc:
            reason = "the TLS key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(exc) else \
                f"cannot load the TLS certificate/key: {exc.reason or exc}"
            raise ConfigError(f"{reason} (tls_cert={self.cert}, tls_key={self.key})") from None
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS certificate/key (tls_cert={self.cert}, tls_key={self.key}): "
                              f"{exc.strerror or exc}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert and self.key, "a TLS server needs cert and key"
        pair = [(self.key.read_bytes(), self.cert.read_bytes())]
        if self.ca:
            return grpc.ssl_server_credentials(pair, root_certificates=self.ca.read_bytes(), require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )
