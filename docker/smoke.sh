#!/usr/bin/env bash
# Build docker/Dockerfile and run the image on this machine, without a Docker engine:
# buildah (chroot isolation, vfs storage) and a Debian bookworm base made by debootstrap.
#
#   sudo docker/smoke.sh            # needs root, buildah, debootstrap; ~10 minutes cold
#
# 1. debootstrap --variant=minbase bookworm with python3, python3-venv and python3-pip,
#    imported FROM scratch as localhost/optiremat-base:bookworm (kept and reused);
# 2. buildah bud docker/Dockerfile with that BASE_IMAGE, the host CA bundle mounted so
#    pip can reach the package index;
# 3. buildah run the image: the embedded API answers /healthz and a solve on loopback;
#    with redis-server on this machine, the API and a worker also run in cluster mode;
# 4. print the image's size.
#
# Environment: SMOKE_WORK (scratch directory, default /var/tmp/optiremat-smoke),
# DEBIAN_MIRROR (default: this machine's apt sources), SMOKE_PORT (default 18000), and PIP_INDEX_URL, passed to the build when
# set.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${SMOKE_WORK:-/var/tmp/optiremat-smoke}
# The Debian mirror debootstrap fetches from: DEBIAN_MIRROR, else the first archive this
# machine's own apt sources name (deb822 .sources or one-line sources.list), never a
# default host of ours.
# APT_DIR (default /etc/apt) is where to look; a missing file is no error (a Debian 12
# install has only deb822 files), and no mirror at all is said on stderr, status 1.
apt_mirror() {
    local dir=${1:-/etc/apt} file mirror
    mirror=$({
        for file in "$dir"/sources.list.d/*.sources; do
            if [ -f "$file" ]; then
                awk 'tolower($1) == "uris:" {for (i = 2; i <= NF; i++) print $i}' "$file"
            fi
        done
        for file in "$dir"/sources.list "$dir"/sources.list.d/*.list; do
            if [ -f "$file" ]; then
                awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; break}}' \
                    "$file"
            fi
        done
    } | awk '!/-security/ && !found {print; found = 1}')  # reads all: no SIGPIPE
    if [ -z "$mirror" ]; then
        echo "smoke: no Debian mirror in $dir/sources.list, $dir/sources.list.d/*.list or" \
             "*.sources; set DEBIAN_MIRROR" >&2
        return 1
    fi
    echo "$mirror"
}
MIRROR=${DEBIAN_MIRROR:-}
if [ -z "$MIRROR" ]; then
    MIRROR=$(apt_mirror "${APT_DIR:-/etc/apt}") || exit 2
fi
PORT=${SMOKE_PORT:-18000}
BASE=localhost/optiremat-base:bookworm
IMAGE=localhost/optiremat:smoke
CA=/etc/ssl/certs/ca-certificates.crt
buildah() { command buildah --storage-driver vfs "$@"; }

for tool in buildah debootstrap curl python3 pgrep; do
    command -v "$tool" >/dev/null || { echo "smoke: install $tool (apt-get install $tool)" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "smoke: run as root (debootstrap, buildah chroot)" >&2; exit 2; }
mkdir -p "$WORK"
step() { printf '\n== %s\n' "$*"; }

# ---- 1. the base image ------------------------------------------------------------
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    step "debootstrap bookworm (minbase + python3, venv, pip) -> $BASE"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip \
        bookworm "$WORK/rootfs" "$MIRROR"
    chroot "$WORK/rootfs" apt-get clean
    rm -rf "$WORK/rootfs/var/lib/apt/lists/"* "$WORK/rootfs/var/cache/apt/"*.bin
    tar -C "$WORK/rootfs" --numeric-owner -czf "$WORK/rootfs.tar.gz" .
    rm -rf "$WORK/rootfs"
    printf 'FROM scratch\nADD rootfs.tar.gz /\nCMD ["python3"]\n' > "$WORK/Containerfile"
    buildah bud --isolation chroot -f "$WORK/Containerfile" -t "$BASE" "$WORK"
fi

# ---- 2. the image -------------------------------------------------------------------
step "buildah bud docker/Dockerfile (BASE_IMAGE=$BASE)"
args=(--build-arg "BASE_IMAGE=$BASE")
[ -n "${PIP_INDEX_URL:-}" ] && args+=(--build-arg "PIP_INDEX_URL=$PIP_INDEX_URL")
# docker format: the OCI image config has no place for HEALTHCHECK
buildah bud --isolation chroot --format docker --layers=false "${args[@]}" \
    -v "$CA:$CA:ro" -f docker/Dockerfile -t "$IMAGE" .

step "image config"
buildah inspect --type image --format \
    'user={{.OCIv1.Config.User}} entrypoint={{.OCIv1.Config.Entrypoint}} cmd={{.OCIv1.Config.Cmd}}' \
    "$IMAGE"
buildah inspect --type image --format '{{.Docker.Config.Healthcheck}}' "$IMAGE" | grep -q healthz \
    || { echo "smoke: the image has no healthcheck" >&2; exit 1; }
[ "$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")" != "" ] \
    || { echo "smoke: the image runs as root" >&2; exit 1; }

# ---- 3. run it ----------------------------------------------------------------------
containers=() pids=()
# buildah run does not pass SIGTERM on to the container's process: stop the whole tree.
kill_tree() {
    local child
    for child in $(pgrep -P "$1"); do kill_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
cleanup() {
    for pid in "${pids[@]}"; do kill_tree "$pid"; done
    wait 2>/dev/null || true
    for ctr in "${containers[@]}"; do buildah rm "$ctr" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

# buildah run <env...> -- <command...> in a fresh container, in the background
start() {
    local ctr env=()
    ctr=$(buildah from "$IMAGE")
    containers+=("$ctr")
    while [ "$1" != -- ]; do env+=(--env "$1"); shift; done
    shift
    buildah run --isolation chroot "${env[@]}" "$ctr" -- "$@" >"$WORK/$ctr.log" 2>&1 &
    pids+=($!)
}

wait_ready() {
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$1/readyz" >/dev/null && return 0
        sleep 0.5
    done
    echo "smoke: no /readyz on port $1" >&2
    tail -n 20 "$WORK"/*.log >&2
    return 1
}

# The request in the API's own documentation (openapi.json): x -> sin -> tanh.
example_request() {
    curl -sf "http://127.0.0.1:$1/openapi.json" | python3 -c \
        'import json, sys; doc = json.load(sys.stdin)
print(json.dumps(doc["components"]["schemas"]["SolveRequest"]["examples"][0]))'
}

solve_on() {
    local answer
    answer=$(example_request "$1" | curl -sf -H 'Content-Type: application/json' \
        --data-binary @- "http://127.0.0.1:$1/v1/solve")
    echo "$answer" | grep -q '"status":"optimal"' \
        || { echo "smoke: unexpected answer: $answer" >&2; return 1; }
    echo "solve on :$1 -> ${answer:0:160}..."
}

step "embedded: optiremat serve in the container, on 127.0.0.1:$PORT"
start OPTIREMAT_WORKERS=1 -- optiremat serve --host 127.0.0.1 --port "$PORT"
wait_ready "$PORT"
echo "healthz -> $(curl -sf "http://127.0.0.1:$PORT/healthz")"
solve_on "$PORT"

if command -v redis-server >/dev/null; then
    step "cluster: redis-server on the host, API and worker in containers"
    redis_port=$((PORT + 1)) api_port=$((PORT + 2))
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        >"$WORK/redis.log" 2>&1 &
    pids+=($!)
    url="OPTIREMAT_REDIS_URL=redis://127.0.0.1:$redis_port/0"
    start "$url" -- optiremat worker
    start "$url" -- optiremat serve --host 127.0.0.1 --port "$api_port"
    wait_ready "$api_port"
    solve_on "$api_port"
    grep -q '"task finished"' "$WORK"/*.log && echo "the containerised worker solved it"
fi

# ---- 4. size ------------------------------------------------------------------------
step "image size"
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$BASE"
echo "smoke: OK"
