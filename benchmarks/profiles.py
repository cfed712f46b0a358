"""Network profiles: S3 as users have it, on this machine.

- `lan`: SeaweedFS on 127.0.0.1 over plain http, answering in well under a millisecond
  (the setup every figure before these profiles came from).
- `region`: https with a CA made for the run, 10 ms round trip, 1 Gbit/s per direction
  (a bucket in the training cluster's own region).
- `wan`: https, 40 ms round trip, 400 Mbit/s (a bucket a continent away).

`start(profile, directory)` starts the embedded SeaweedFS for a profile, behind a
`netlink.Link` when the profile has a round trip or a bandwidth, and gives the endpoint
and the CA bundle to trust (`Served.stop()` ends both). Over https SeaweedFS requires
signatures (without keys it refuses aws-chunked uploads over https), so a TLS profile's
server has keys, as real S3.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netlink import Link
from benchmarks.tlsca import make_ca
from lakefs_mount.s3.embedded import EmbeddedS3


@dataclass(frozen=True)
class Profile:
    name: str
    tls: bool
    rtt_s: float
    bits_per_s: float | None  # per direction; None: loopback's own

    def __str__(self) -> str:
        scheme = "https" if self.tls else "http"
        rate = "" if self.bits_per_s is None else f", {self.bits_per_s / 1e6:g} Mbit/s"
        return f"{self.name} ({scheme}, {self.rtt_s * 1000:g} ms round trip{rate})"


PROFILES = {p.name: p for p in (
    Profile("lan", tls=False, rtt_s=0.0, bits_per_s=None),
    Profile("region", tls=True, rtt_s=0.010, bits_per_s=1e9),
    Profile("wan", tls=True, rtt_s=0.040, bits_per_s=400e6),
)}


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=PROFILES, default="lan",
                        help="the network between the mounts and S3: " + "; ".join(
                            str(p) for p in PROFILES.values()) + " (default lan)")


@dataclass
class Served:
    """A running S3 server as one profile reaches it."""

    profile: Profile
    server: EmbeddedS3
    endpoint_url: str  # for the mount and every client
    ca_bundle: Path | None  # the CA to trust (AWS_CA_BUNDLE), with TLS
    link: Link | None

    @property
    def pid(self) -> int | None:
        """The server's process."""
        return self.server.pid

    def client_env(self) -> dict[str, str]:
        """What a client's environment needs to reach the endpoint: the CA to trust, for
        botocore (AWS_CA_BUNDLE) and for OpenSSL and Go clients (SSL_CERT_FILE); the
        server's keys when it has them."""
        env: dict[str, str] = {}
        if self.ca_bundle is not None:
            env.update(AWS_CA_BUNDLE=str(self.ca_bundle), SSL_CERT_FILE=str(self.ca_bundle))
        if self.server.access_key is not None and self.server.secret_key is not None:
            env.update(AWS_ACCESS_KEY_ID=self.server.access_key,
                       AWS_SECRET_ACCESS_KEY=self.server.secret_key)
        return env

    def stop(self, timeout: float = 15.0) -> None:
        if self.link is not None:
            self.link.close()
        self.server.stop(timeout=timeout)


def start(profile: Profile, directory: Path, *, access_key: str | None = None,
          secret_key: str | None = None, timeout: float = 120) -> Served:
    """The embedded SeaweedFS in `directory`, reached the way `profile` says. Keys are
    required with TLS (see the module's docstring)."""
    if profile.tls and access_key is None:
        raise ValueError(f"profile {profile.name}: an https server needs keys")
    tls = make_ca(directory / "tls") if profile.tls else None
    server = EmbeddedS3(directory / "s3", access_key=access_key, secret_key=secret_key,
                        tls=None if tls is None else (tls.cert, tls.key))
    server.start(timeout=timeout)
    port = server.https_port if tls is not None else server.port
    link = None
    if profile.rtt_s or profile.bits_per_s:
        link = Link(port, rtt_s=profile.rtt_s,
                    bytes_per_s=None if profile.bits_per_s is None else profile.bits_per_s / 8)
        port = link.port
    scheme = "https" if tls is not None else "http"
    return Served(profile, server, f"{scheme}://127.0.0.1:{port}",
                  None if tls is None else tls.ca, link)
