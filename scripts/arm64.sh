#!/usr/bin/env bash
# `make test-arm64`: the tests marked `arm64` on a real aarch64 userland (Debian bookworm arm64, Python 3.11)
# through QEMU user-mode emulation, once per emulated CPU: a Graviton2-like and a Graviton3-like one.
# Emulation checks correctness, not speed (docs/graviton.md says which claims that verifies).
#
#   scripts/arm64.sh [PYTEST ARGS]   default: -m arm64 (ARGS replace it)
#   scripts/arm64.sh --check         exit 0 where this machine can run it, else one line and exit 77
#   scripts/arm64.sh --build         build the cache (rootfs and wheels) and stop: CI starts it in the
#                                    background, so the downloads overlap the host's test stages
#
# Needs root: binfmt_misc, chroot and bind mounts. Built once and cached outside the clone, by a hash of
# its inputs (this script, scripts/arm64-requirements.txt, constraints.txt):
#   ${TORCHKILN_ARM64_CACHE:-~/.cache/torchkiln/arm64}/<hash>/{rootfs,.ready}
# Everything runs in a private mount namespace (unshare): its mounts vanish when it ends, however it ends;
# the EXIT trap also unmounts them and removes the binfmt_misc entry if this run added it.
# Knobs: ARM64_CPUS (QEMU_CPU models, space-separated), ARM64_MIRROR (Debian mirror; default: the host's),
# ARM64_PARALLEL (1, the default where the host has 2+ cores: the CPU models' runs side by side, each an
# emulated process on a core of its own; 0: one after the other), ARM64_PLAN (1: print each CPU model's
# `python -m core.device` table before its tests).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
SRC=$PWD
SKIP=77

cannot() {  # the one line, then exit SKIP (CI reads it as "skipped")
  echo "arm64: skipped: $*" >&2
  exit "$SKIP"
}

check() {
  [ "$(id -u)" = 0 ] || cannot "needs root (binfmt_misc, chroot, bind mounts); run as root: make test-arm64"
  [ "$(uname -s)" = Linux ] || cannot "needs Linux (binfmt_misc)"
  if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    # mountable here? (in a throwaway namespace, so nothing stays mounted)
    unshare --mount --propagation private \
      sh -c 'mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc' 2>/dev/null \
      || cannot "binfmt_misc cannot be mounted here (unprivileged container?)"
  fi
  if ! { [ -x /usr/bin/qemu-aarch64-static ] && command -v mmdebstrap >/dev/null; }; then
    command -v apt-get >/dev/null || cannot "needs qemu-user-static and mmdebstrap (or apt-get to install them)"
  fi
}

check
[ "${1:-}" = --check ] && exit 0

# Re-enter in a private mount namespace: no mount made below can outlive this script.
if [ -z "${_ARM64_UNSHARED:-}" ]; then
  _ARM64_UNSHARED=1 exec unshare --mount --propagation private "$SELF" "$@"
fi
# (after the re-entry, which passes the arguments on as given)
BUILD_ONLY=""
if [ "${1:-}" = --build ]; then
  BUILD_ONLY=1
  shift
fi

log() { echo "[arm64 $(date +%T)] $*" >&2; }
LOW="nice -n 10"

SUITE=bookworm
# extract: packages unpacked by the host's dpkg, no maintainer script run under emulation (30 s, not 10 min)
PACKAGES=python3,python3-venv,dash,coreutils,libstdc++6
PY_TAGS="--python-version 3.11 --implementation cp --abi cp311"
PLATFORMS="manylinux_2_36 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27
  manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014"
# hydra's parser has no wheel: built from its (pure-Python) sdist
SDISTS="antlr4-python3-runtime==4.9.3"
CPUS=${ARM64_CPUS:-neoverse-n1 max,sve-default-vector-length=32}

# any edit of this script builds afresh (2-3 min): simpler than knowing which lines shape the build
key=$(cat "$SELF" scripts/arm64-requirements.txt constraints.txt | sha256sum | cut -c1-16)
BASE=${TORCHKILN_ARM64_CACHE:-$HOME/.cache/torchkiln/arm64}
DIR=$BASE/$key
ROOT=$DIR/rootfs
mkdir -p "$BASE"
# one run at a time on this host: the binfmt_misc entry and its removal are host-wide
mkdir -p /run/lock
exec 9>/run/lock/torchkiln-arm64.lock
flock 9

added_binfmt=""
pids=()  # the CPU models' runs side by side (step 5): they end with this script, however it ends
cleanup() {
  set +e
  for p in "${pids[@]}"; do
    pkill -P "$p"
    kill "$p"
  done 2>/dev/null
  for m in "$ROOT/src" "$ROOT/dev" "$ROOT/sys" "$ROOT/proc"; do
    mountpoint -q "$m" && umount -R -l "$m"
  done
  [ -n "$added_binfmt" ] && echo -1 >/proc/sys/fs/binfmt_misc/qemu-aarch64
  mountpoint -q /proc/sys/fs/binfmt_misc && umount /proc/sys/fs/binfmt_misc 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. host tools
need=()
[ -x /usr/bin/qemu-aarch64-static ] || need+=(qemu-user-static)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $LOW apt-get install -y -q "${need[@]}" >/dev/null
fi

# 2. binfmt_misc: F (fix binary) opens the interpreter now, so it runs inside the chroot without a copy there
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
  conf=$(cat /usr/lib/binfmt.d/qemu-aarch64.conf 2>/dev/null || true)
  [ -n "$conf" ] || conf=$(printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:FOC')
  echo "$conf" >/proc/sys/fs/binfmt_misc/register
  added_binfmt=1
fi
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64

# 3. the rootfs and its venv, built into a scratch folder and renamed: a half-built cache is never used
if [ ! -e "$DIR/.ready" ]; then
  t0=$SECONDS
  mirror=${ARM64_MIRROR:-$( { cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } \
    | grep -oE '^(URIs:[[:space:]]*|deb[[:space:]]+)[^[:space:]]+/debian([[:space:]]|$)' | head -1 \
    | awk '{print $NF}' || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  tmp=$DIR.tmp
  rm -rf --one-file-system "$tmp" "$DIR"
  mkdir -p "$tmp"
  log "building the arm64 rootfs ($SUITE, from $mirror) in $DIR"
  $LOW mmdebstrap --quiet --arch=arm64 --variant=extract --include="$PACKAGES" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$SUITE" "$tmp/rootfs" "deb $mirror $SUITE main" "deb $mirror $SUITE-updates main"
  # what base-passwd's maintainer script would have made: a root user (getpass and the compile caches
  # look it up)
  mkdir -p "$tmp/rootfs/root" "$tmp/rootfs/tmp"
  chmod 1777 "$tmp/rootfs/tmp"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$tmp/rootfs/etc/passwd"
  echo 'root:x:0:' >"$tmp/rootfs/etc/group"
  log "rootfs in $((SECONDS - t0)) s; creating the venv"
  chroot "$tmp/rootfs" /usr/bin/python3 -m venv --without-pip /opt/venv
  site=$tmp/rootfs/opt/venv/lib/python3.11/site-packages
  # The host's pip unpacks the aarch64 wheels at native speed (the emulated one takes minutes); --no-deps
  # because pip would evaluate markers for this x86 host: the requirements file is the whole closure.
  plat=$(for p in $PLATFORMS; do printf -- '--platform %s_aarch64 ' "$p"; done)
  # shellcheck disable=SC2086
  export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
  $LOW "${PYTHON:-python3}" -m pip install -q --no-deps --only-binary=:all: $PY_TAGS $plat \
    --target "$site" -r scripts/arm64-requirements.txt
  # shellcheck disable=SC2086
  $LOW "${PYTHON:-python3}" -m pip install -q --no-deps --upgrade --target "$site" $SDISTS
  rm -rf "$site/bin"  # x86 console scripts; the tests run `python -m pytest`
  mv "$tmp" "$DIR"
  touch "$DIR/.ready"
  log "cold build: $((SECONDS - t0)) s ($(du -sh "$DIR" | cut -f1))"
fi
if [ -n "$BUILD_ONLY" ]; then
  log "cache ready in $DIR"
  exit 0
fi

# 4. mounts (private namespace; undone by the EXIT trap too)
mkdir -p "$ROOT/src" "$ROOT/proc" "$ROOT/sys" "$ROOT/dev"
for d in proc sys dev; do
  mount --rbind "/$d" "$ROOT/$d"
  mount --make-rslave "$ROOT/$d"
done
mount --bind "$SRC" "$ROOT/src"

inside() {  # inside SLOT QEMU_CPU CMD...: run CMD in the arm64 userland on that emulated CPU
  local slot=$1 cpu=$2
  shift 2
  # QEMU_CPU is read by the emulator of every aarch64 process, children included; the venv's bytecode was
  # compiled at build time, and none is written into the checkout. Each CPU model's run has a home and a
  # temporary folder of its own (SLOT), so two side by side share no cache, probe or pytest folder.
  mkdir -p "$ROOT/root/$slot" "$ROOT/tmp/$slot"
  QEMU_CPU="$cpu" $LOW chroot "$ROOT" /usr/bin/env -i HOME="/root/$slot" LANG=C.UTF-8 QEMU_CPU="$cpu" \
    PATH=/opt/venv/bin:/usr/bin:/bin PYTHONPATH=/src PYTHONDONTWRITEBYTECODE=1 TMPDIR="/tmp/$slot" \
    /bin/sh -c 'cd /src && exec "$@"' sh "$@"
}

one_cpu() {  # one_cpu SLOT QEMU_CPU PYTEST_ARGS...: the tests (with ARM64_PLAN=1, the device plan first)
  local slot=$1 cpu=$2 rc=0 t0=$SECONDS
  shift 2
  # the plan's table is a start of its own (2-3 emulated minutes); test_live_plan_is_the_graviton_plan
  # already checks the plan a live aarch64 process gets
  if [ "${ARM64_PLAN:-0}" = 1 ]; then
    log "QEMU_CPU=$cpu: python -m core.device"
    inside "$slot" "$cpu" python -m core.device || rc=1
  fi
  log "QEMU_CPU=$cpu: pytest $*"
  inside "$slot" "$cpu" python -m pytest -q -p no:cacheprovider "$@" || rc=1
  log "QEMU_CPU=$cpu: tests took $((SECONDS - t0)) s"
  return $rc
}

# 5. per CPU model: only the files that hold marked tests (collecting the rest would import all of it under
# emulation). Side by side, each run's output is held in a file and printed whole when it ends, in order.
[ $# -gt 0 ] || set -- -m arm64 $(grep -rl --include='test_*.py' 'mark.arm64' tests | sort)
parallel=${ARM64_PARALLEL:-$([ "$(nproc)" -ge 2 ] && echo 1 || echo 0)}
rc=0
slot=0
outs=$(mktemp -d)
for cpu in $CPUS; do
  slot=$((slot + 1))
  if [ "$parallel" = 1 ]; then
    one_cpu "cpu$slot" "$cpu" "$@" >"$outs/$slot" 2>&1 &
    pids+=($!)
  else
    one_cpu "cpu$slot" "$cpu" "$@" || rc=1
  fi
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || rc=1
  cat "$outs/$((i + 1))"
done
rm -rf "$outs"
exit $rc
