"""`--log-format json`: one JSON object per line for log shippers, secrets scrubbed, a line
for each failed S3 request; and `--version`."""

from __future__ import annotations

import json
import logging
import time
from importlib.metadata import version

from lakefs_mount.logsetup import setup_logging
from tests.mounting import cli as run_cli

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
ERROR_WAIT = 60.0


def _json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_lines_carry_time_level_logger_message_fields_and_traceback(tmp_path):
    log_file = tmp_path / "log"
    setup_logging("INFO", log_file, foreground=False, log_format="json")
    try:
        log = logging.getLogger("lakefs_mount.test")
        log.warning("PUT %s failed", "step_1/model.bin",
                    extra={"s3_op": "PutObject", "attempt": 3, "detail": f"key {SECRET}"})
        try:
            raise RuntimeError(f"signature {SECRET}")
        except RuntimeError:
            log.exception("upload failed")
    finally:
        setup_logging("INFO", None, foreground=False)
    first, second = _json_lines(log_file)
    assert first["level"] == "WARNING" and first["logger"] == "lakefs_mount.test"
    assert first["message"] == "PUT step_1/model.bin failed"
    assert (first["s3_op"], first["attempt"]) == ("PutObject", 3)
    assert first["time"].endswith("Z") and first["time"][10] == "T"
    assert second["exception"].startswith("Traceback") and "RuntimeError" in second["exception"]
    assert SECRET not in log_file.read_text()


def test_version_names_the_installed_distribution():
    proc = run_cli("--version", check=True)
    assert proc.stdout.strip() == f"lakefs-mount, version {version('lakefs-mount')}"


def test_a_mount_with_json_logs_writes_only_json_and_a_line_per_failed_request(
        mount_factory, fault_proxy):
    m = mount_factory("--log-format", "json", "--commit-delay", "3",
                      endpoint_url=fault_proxy.endpoint_url)
    (m.path / "a.bin").write_bytes(b"x" * 4096)
    fault_proxy.fail = True  # before the commit, which waits 3 s after the close
    deadline = time.monotonic() + ERROR_WAIT
    while m.counters().get("errors", 0) == 0:
        assert time.monotonic() < deadline, m.log_tail()
        time.sleep(0.2)
    fault_proxy.fail = False
    assert m.flush().returncode == 0
    lines = _json_lines(m.log_file)
    failed = [e for e in lines if e["level"] in ("WARNING", "ERROR") and "failed" in e["message"]
              and "a.bin" in e["message"]]
    assert failed, lines[-20:]
    structured = [e for e in lines if e.get("s3_op") == "PutObject" and e.get("key") == "a.bin"]
    assert structured and structured[0]["attempt"] == 1, lines[-20:]
    assert {"status", "s3_error_code", "seconds"} <= set(structured[0])  # None: no answer
    assert any(e["message"].startswith("mounted s3://") for e in lines)
    assert "lmdummysecretkey" not in m.log_file.read_text()
