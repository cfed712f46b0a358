"""The botocore configuration every boto3 baseline of the benchmarks uses (the suite's, the
checkpoint benchmark's, the peers' checks): a module of its own, so that the suite, its
targets and its worker processes share it without importing one another."""

from __future__ import annotations

from typing import Any


def s3_config(pool: int):  # noqa: ANN201
    """botocore Config of every boto3 baseline: path style, `pool` connections, no
    default request/response CRCs (botocore >= 1.36 computes them in Python per request)
    and unsigned payloads (no SHA-256 pass over every body): as lakefs-mount's client."""
    from botocore.config import Config

    kwargs: dict[str, Any] = {"max_pool_connections": pool, "s3": {"addressing_style": "path",
                                                                  "payload_signing_enabled": False}}
    if "request_checksum_calculation" in getattr(Config, "OPTION_DEFAULTS", {}):
        kwargs["request_checksum_calculation"] = "when_required"
        kwargs["response_checksum_validation"] = "when_required"
    return Config(**kwargs)
