#!/usr/bin/env bash
# Idempotent set-up for `make demo` / `make test`: system packages, kernel headers, tracefs, virtualenv.
# Every step is skipped when already done; each problem is reported in one line with its fix.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
STAMP="$VENV/.prism-installed"
KERNEL=$(uname -r)

say() { printf 'prism-setup: %s\n' "$*"; }

is_root() { [ "$(id -u)" = 0 ]; }

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${missing[*]} (apt)"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
        say "apt-get could not install ${missing[*]}; what needs them (the eBPF probe, nft, the nginx tests) stays off"
        return 1
    fi
}

kernel_headers() {
    local mods="/lib/modules/$KERNEL"
    if [ -e "$mods/build/Makefile" ] && [ -e "$mods/source/include/linux/kconfig.h" ]; then return 0; fi
    if apt-get install -y -qq --no-install-recommends "linux-headers-$KERNEL" >/dev/null 2>&1; then return 0; fi
    apt_install linux-headers-amd64 || return 0
    local build common
    build=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$build" ] || [ -z "$common" ]; then
        say "no kernel headers for $KERNEL and no linux-headers-amd64 to link; the eBPF probe stays off"
        return 0
    fi
    mkdir -p "$mods"
    ln -sfn "$build" "$mods/build"
    ln -sfn "$common" "$mods/source"
    say "linked $mods/{build,source} to packaged headers $(basename "$build") (no headers for $KERNEL are packaged)"
}

mount_tracefs() {
    mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
    mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug 2>/dev/null || true
    if [ ! -d /sys/kernel/tracing/events/syscalls ]; then
        say "tracefs has no syscall events on this kernel; the eBPF probe stays off"
    fi
}

system_setup() {
    if ! is_root; then
        say "not root: skipping apt, kernel headers and tracefs; the eBPF probe stays off (run as root to enable it)"
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        say "no apt-get: install bcc (python3-bpfcc), kernel headers and nftables yourself; the eBPF probe may stay off"
        return 0
    fi
    apt_install python3-bpfcc bpfcc-tools gcc nftables iproute2 python3-venv systemd || true
    apt_install nginx || true  # apart: the peer for the nginx tests, not worth failing the rest for
    kernel_headers
    mount_tracefs
}

venv_setup() {
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    local want
    want=$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/router/_fastroute.c" | sha256sum | cut -d' ' -f1)
    if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
        say "installing the project into $VENV (pip, pinned versions)"
        "$VENV/bin/pip" install -q --no-compile --disable-pip-version-check -e "$ROOT[test]" 2> >(grep -v "is ignored: it is neither" >&2)
        echo "$want" >"$STAMP"
    fi
    expose_bcc
}

# bcc's Python module comes from Debian's python3-bpfcc (dist-packages). Expose only the `bcc` package to
# the virtualenv: a .pth file names a folder that holds one link to it.
expose_bcc() {
    local dist=/usr/lib/python3/dist-packages/bcc
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ -d "$dist" ]; then
        mkdir -p "$VENV/bcc-only"
        ln -sfn "$dist" "$VENV/bcc-only/bcc"
        echo "$VENV/bcc-only" >"$site/prism-bcc.pth"
    else
        rm -f "$site/prism-bcc.pth"
        say "bcc (python3-bpfcc) is not installed: the eBPF probe stays off"
    fi
}

system_setup
venv_setup
