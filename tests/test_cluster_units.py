"""Cluster-mode pieces that need no Redis: settings, timeouts, the CLI. (The outcome codec
both stores share is tested in test_service_core.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from optiremat.service.core.config import Settings, redact_url
from optiremat.service.core.redis_store import JOB_TIMEOUT_MARGIN_S, job_timeout_s, queue_name
from optiremat.service.core.tasks import solver_version
from tests.service_harness import REPO


def test_the_queue_outlasts_the_solver_time_limit() -> None:
    settings = Settings(redis_url="redis://localhost:6379/0")
    for limit in (0.5, settings.sync_time_limit_s, settings.job_time_limit_s):
        assert job_timeout_s(limit) >= limit + JOB_TIMEOUT_MARGIN_S
    assert solver_version() in queue_name()  # workers take only what their solver hashes


def test_cluster_settings_come_from_optiremat_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTIREMAT_REDIS_URL", "redis://:secret@redis:6379/2")
    monkeypatch.setenv("OPTIREMAT_RESULT_TTL_S", "3600")  # the TTL's first name still counts
    monkeypatch.setenv("OPTIREMAT_JOB_RETRIES", "0")
    settings = Settings()
    assert settings.redis_url == "redis://:secret@redis:6379/2"
    assert (settings.store_ttl_s, settings.job_retries, settings.worker_heartbeat_s) == (
        3600, 0, 5)
    monkeypatch.setenv("OPTIREMAT_STORE_TTL_S", "7200")
    assert Settings().store_ttl_s == 7200
    assert redact_url(settings.redis_url) == "redis://:***@redis:6379/2"
    monkeypatch.delenv("OPTIREMAT_REDIS_URL")
    assert Settings().redis_url is None  # embedded by default


def test_optiremat_worker_without_redis_says_what_to_set() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTIREMAT_")}
    done = subprocess.run([sys.executable, "-m", "optiremat", "worker"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "OPTIREMAT_REDIS_URL" in done.stderr
