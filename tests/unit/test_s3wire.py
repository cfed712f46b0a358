"""s3/wire signs exactly as botocore does: the signatures are compared with botocore's own
`S3SigV4Auth` on the same request and clock. The connection pool against SeaweedFS:
tests/s3/test_s3wire.py."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from lakefs_mount.s3.embedded import free_port
from lakefs_mount.s3.wire import (
    ConnectFailed,
    Keys,
    WirePool,
    canonical_query,
    sign,
)

UNSIGNED = Config(s3={"payload_signing_enabled": False})

REQUESTS = [  # method, path, query, headers
    ("GET", "/bkt/plain.bin", {}, {}),
    ("GET", "/bkt/" + quote("dir with space/ünï ✓;,'()*$@!+=&.pt", safe="/~"), {},
     {"Range": "bytes=0-99"}),
    ("HEAD", "/bkt/k", {}, {}),
    ("PUT", "/bkt/meta", {}, {"x-amz-meta-mode": "33188",
                              "x-amz-meta-note": "  runs   of  spaces "}),
    ("GET", "/bkt/", {"list-type": "2", "prefix": "a b/ü", "delimiter": "/",
                      "encoding-type": "url", "continuation-token": "x+y/z=="}, {}),
]


@pytest.mark.parametrize("token", [None, "session-token/with+chars=="])
@pytest.mark.parametrize("method,path,query,headers", REQUESTS)
def test_signatures_match_botocore(method: str, path: str, query: dict[str, str],
                                   headers: dict[str, str], token: str | None) -> None:
    host = "127.0.0.1:8333"
    target = path + ("?" + canonical_query(query) if query else "")
    request = AWSRequest(method=method, url=f"http://{host}{target}", headers=dict(headers),
                         data=b"body" if method == "PUT" else b"")
    request.context["client_config"] = UNSIGNED
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret/key+x", token), "s3",
                "eu-west-3").add_auth(request)
    ours = sign(method, host, path, canonical_query(query), headers,
                Keys("AKIDEXAMPLE", "secret/key+x", token), "eu-west-3",
                amz_date=request.headers["X-Amz-Date"])
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours.get("x-amz-security-token") == request.headers.get("X-Amz-Security-Token")


def test_nothing_listening_is_a_connect_failure() -> None:
    pool = WirePool(f"http://127.0.0.1:{free_port()}", max_idle=1, connect_timeout=2,
                    read_timeout=2)
    with pytest.raises(ConnectFailed, match="could not connect"):
        pool.request("GET", "/b/k", {})


