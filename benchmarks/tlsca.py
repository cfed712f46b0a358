"""A certificate authority made for one run: its CA certificate (what the mount is told
to trust, through AWS_CA_BUNDLE or a profile's ca_bundle) and a server certificate it
signed for 127.0.0.1 (what the S3 server presents). Made with the `openssl` command;
nothing is ever trusted machine-wide."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_DAYS = "2"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_SERVER_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
authorityKeyIdentifier = keyid
subjectKeyIdentifier = hash
"""


class TlsError(RuntimeError):
    """openssl is missing or failed."""


@dataclass(frozen=True)
class TlsFiles:
    ca: Path  # the CA certificate: the bundle to trust
    cert: Path  # the server's certificate, for 127.0.0.1
    key: Path  # its private key (0600)


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True,
                       text=True, timeout=60)
    except FileNotFoundError as exc:
        raise TlsError("the `openssl` command is needed (apt-get install openssl)") from exc
    except subprocess.CalledProcessError as exc:
        raise TlsError(f"openssl {args[0]} failed: {exc.stderr.strip()}") from exc


def make_ca(directory: Path) -> TlsFiles:
    """A fresh CA and a server certificate for 127.0.0.1 in `directory` (made 0700)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    _openssl("req", "-x509", *_KEY, "-days", _DAYS, "-subj", "/CN=lakefs-mount test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)
    _openssl("req", *_KEY, "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr", cwd=directory)
    (directory / "server.ext").write_text(_SERVER_EXTENSIONS)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", _DAYS, "-extfile", "server.ext",
             "-out", "server.pem", cwd=directory)
    for name in ("ca.key", "server.key"):
        (directory / name).chmod(0o600)
    return TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
