"""The lean path to S3: GET, HEAD and PUT of one object and listings, signed and sent by
`wire` (or a botocore HTTP session where a proxy or client certificate is needed) instead of
through botocore's request pipeline. `store` decides which requests take it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import boto3
import botocore.exceptions as bce
import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.httpsession import URLLib3Session, get_cert_path
from botocore.utils import get_environ_proxies

from lakefs_mount.filespan import FileSpan
from lakefs_mount.s3.objectstore import ObjectInfo, PiecewiseBody
from lakefs_mount.s3.replies import ErrorReply, parse_listing_page, read_body
from lakefs_mount.s3.timeouts import RequestTimeouts
from lakefs_mount.s3.wire import Keys, WirePool, canonical_query, sign


class LeanTransport:
    """GET, HEAD and PUT of one object and listings, signed and sent without botocore's
    pipeline.

    These are the requests whose number grows with the number of files (small-file
    reads, `ls -l`, small-file commits, listing pages of thousands of keys). botocore's
    `get_object` spends most of its CPU on parameter validation, endpoint rules, event
    hooks and response parsing, all under the daemon's one GIL; signed and sent by
    `wire` the same request costs a small fraction of that. So `wire` carries them, with
    the client's endpoint,
    addressing style, credentials (refreshed as botocore refreshes them), timeouts and
    TLS verification; where botocore would go through a proxy or present a client
    certificate, they take a botocore HTTP session set up as botocore sets up its own
    (public settings only: the client's config, the session's `ca_bundle`, the
    environment's proxies). One attempt per request, as
    for botocore's calls (`retry` decides about more). Unlike botocore it does not follow
    S3's redirects to a bucket's region: `check_bucket` goes this way too, so a wrong
    region fails at mount time, naming the right one.
    """

    def __init__(self, session: boto3.session.Session, settings: botocore.session.Session,
                 client: Any, bucket: str, region: str | None, max_pool: int,
                 timeouts: RequestTimeouts) -> None:
        self._credentials = session.get_credentials()
        self._client = client
        self._bucket = bucket
        self._region = region or "us-east-1"
        self._config = client.meta.config
        # The CA bundle botocore's client verifies with (AWS_CA_BUNDLE, the profile's
        # ca_bundle, then REQUESTS_CA_BUNDLE), read where botocore reads it.
        self._verify: bool | str = (settings.get_config_variable("ca_bundle")
                                    or os.environ.get("REQUESTS_CA_BUNDLE") or True)
        self._http: URLLib3Session | None = None  # through a proxy or with a client cert
        self._max_idle = max_pool
        self.timeouts = timeouts
        self._origin = ""  # scheme://host[:port] and the bucket's path, as botocore
        self._prefix = ""  # addresses it (path or virtual-host style): set on first use
        self._wire: WirePool | None = None

    def _address(self) -> None:
        probe = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": "k"}, ExpiresIn=60)
        parts = urlsplit(probe)
        origin = f"{parts.scheme}://{parts.netloc}"
        self._prefix = parts.path[:-1]
        proxies = self._config.proxies or get_environ_proxies(probe)
        if proxies.get(parts.scheme) or self._config.client_cert:
            self._http = URLLib3Session(  # (its read timeout bounds each wait for a byte)
                verify=self._verify, proxies=proxies,
                timeout=(self.timeouts.connect, self.timeouts.base),
                max_pool_connections=self._max_idle, client_cert=self._config.client_cert,
                proxies_config=self._config.proxies_config)
        else:
            verify = self._verify
            self._wire = WirePool(origin, verify=verify if verify is False
                                  else get_cert_path(verify), max_idle=self._max_idle,
                                  connect_timeout=self.timeouts.connect,
                                  read_timeout=self.timeouts.base)
        self._origin = origin  # last: threads that see it see the rest too

    @property
    def plain(self) -> bool:
        """Whether requests go out on wire's plain TCP connections (no TLS), which can
        send a body by sendfile."""
        return self.direct and self._wire is not None and self._wire.plain

    @property
    def direct(self) -> bool:
        """Whether requests go out on wire's connections (no proxy, no client
        certificate), which take a PiecewiseBody."""
        if not self._origin:
            self._address()
        return self._wire is not None

    def send(self, op: str, method: str, key: str, headers: dict[str, str] | None = None,
             body: bytes | PiecewiseBody = b"", query: dict[str, str] | None = None,
             timeout: float | None = None, span: FileSpan | None = None) -> Any:
        """One signed request; raises ErrorReply for non-2xx, WireError for a failed
        connection or one that took longer than `timeout` (`timeouts.small()` if None;
        an answer's body gets time for its bytes on top). `span`: the body's bytes
        for the kernel to send from their file (`WirePool.request`).
        The response has `status_code`, `headers` and the body stream as `raw`."""
        if self._credentials is None:
            raise bce.NoCredentialsError()
        if not self._origin:
            self._address()
        target = self._prefix + quote(key, safe="/~")
        if query:  # SigV4 signs the query string as sent: escape it the way it wants
            target += "?" + canonical_query(query)
        response = self._send_once(method, target, headers or {}, body,
                                   self.timeouts.small() if timeout is None else timeout,
                                   span)
        if response.status_code < 300:
            return response
        content = b"" if method == "HEAD" else response.raw.read()
        response.raw.release_conn()
        raise ErrorReply.parse(response.status_code, content,
                               response.headers.get("x-amz-bucket-region"))

    def _send_once(self, method: str, target: str, headers: dict[str, str],
                   body: bytes | PiecewiseBody, timeout: float, span: FileSpan | None) -> Any:
        frozen = self._credentials.get_frozen_credentials()
        if self._wire is None:
            assert isinstance(body, bytes) and self._http is not None
            request = AWSRequest(method=method, url=self._origin + target,
                                 headers=dict(headers), data=body, stream_output=True)
            request.context["client_config"] = self._config
            S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
            return self._http.send(request.prepare())
        path, _, query = target.partition("?")
        signed = sign(method, self._wire.host, path, query, headers,
                      Keys(frozen.access_key, frozen.secret_key, frozen.token),
                      self._region)
        return self._wire.request(method, target, signed, body, timeout=timeout,
                                  per_byte=self.timeouts.per_byte(), span=span)


def listing_pages(lean: LeanTransport, prefix: str, delimiter: str | None
                   ) -> Iterator[tuple[list[ObjectInfo], list[str]]]:
    """ListObjectsV2 page by page: (objects, common prefixes) of each page."""
    query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
    if delimiter:
        query["delimiter"] = delimiter
    while True:
        response = lean.send("ListObjectsV2", "GET", "", query=query)
        objects, prefixes, token = parse_listing_page(b"".join(read_body(response)), prefix)
        yield objects, prefixes
        if token is None:
            return
        query["continuation-token"] = token

