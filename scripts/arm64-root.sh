#!/usr/bin/env bash
# An arm64 Debian root with the capture-only Python stack, run under qemu-user on an x86_64 host.
#
#   scripts/arm64-root.sh [--root DIR] [build] [--install-tools]   build (or check) the root
#   scripts/arm64-root.sh [--root DIR] run CMD [ARG...]            run CMD inside it (qemu-aarch64-static)
#   scripts/arm64-root.sh [--root DIR] path                        print the root folder
#   scripts/arm64-root.sh tools                                    only install qemu-user-static, debootstrap, the keyring, CA certs (apt)
#
# build: `debootstrap --arch=arm64 --foreign --variant=minbase` (python3, python3-venv included), then every
# downloaded .deb unpacked with dpkg-deb + tar instead of debootstrap's emulated second stage (no maintainer
# scripts run: none is needed to run Python), the host CA bundle copied in, the root's own ld.so.cache, a
# fake ARM /proc/cpuinfo, and a venv at ROOT/venv with `pip install` of the aarch64 wheels of the core install
# (pyproject.toml's [project] dependencies: numpy, onnx, onnxruntime, h5py, rich, jsonschema). Idempotent: a
# stamp keyed by the suite, the mirror, the root's path and those specifiers; a rerun with the root up to date
# returns at once, a changed specifier rebuilds only the venv.
#
# run: chroot-free, no mount, no root needed. qemu-aarch64-static -L ROOT resolves every absolute path the
# program opens inside ROOT first and falls back to the host's file when ROOT has none; ROOT holds only the
# system (usr, etc, the venv) and proc/cpuinfo, so the host's /dev, /sys, /proc/self, your home and /tmp files
# stay visible, and relative paths are the host's current folder. The cpuinfo matters: ORT's cpuinfo library
# crashes importing onnxruntime when it reads the host's x86 /proc/cpuinfo (or an empty one), so ROOT/proc
# holds a fake cortex-a76 one. QEMU_CPU is cortex-a76 (the RK3588's big core: asimd dotprod + fp16, no i8mm,
# SVE or SME); qemu's default `max` takes ORT's SME path, which gave wrong dynamic-int8 MatMul results.
# Override with IVQ_QEMU_CPU. Without binfmt_misc, a guest program cannot exec another aarch64 program
# (pip building an sdist, subprocess of python): install wheels, or set PYTHONPATH to a checkout.
#
# Environment: IVQ_ARM64_ROOT (default ${XDG_CACHE_HOME:-~/.cache}/ivq-debug/arm64-root), IVQ_ARM64_SUITE
# (bookworm: Python 3.11, the project's floor), IVQ_ARM64_MIRROR, IVQ_QEMU_CPU, PYTHON (host python >= 3.11,
# reads pyproject.toml). Exit codes: 0 ok, 2 usage, 5 a required tool is missing, 1 anything else.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYPROJECT="$HERE/../pyproject.toml"
ROOT="${IVQ_ARM64_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/ivq-debug/arm64-root}"
SUITE="${IVQ_ARM64_SUITE:-bookworm}"
MIRROR="${IVQ_ARM64_MIRROR:-http://deb.debian.org/debian}"
QCPU="${IVQ_QEMU_CPU:-cortex-a76}"
HOSTPY="${PYTHON:-python3}"
STAMP_VERSION=1  # bump when the build steps change

die() { local code=$1; shift; echo "arm64-root: $*" >&2; exit "$code"; }
say() { echo "arm64-root: $*" >&2; }

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

need_qemu() {
  command -v qemu-aarch64-static >/dev/null 2>&1 \
    || die 5 "qemu-aarch64-static not found: install qemu-user-static (Debian/Ubuntu: apt-get install qemu-user-static)"
}

install_tools() {
  local missing=()
  command -v qemu-aarch64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
  # the CA bundle `build` copies into the root: Debian's pip there reads it for PyPI over HTTPS
  [ -f /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die 5 "no apt-get here: install ${missing[*]} yourself"
  [ "$(id -u)" -eq 0 ] || die 5 "installing ${missing[*]} needs root: sudo apt-get install ${missing[*]}"
  say "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mtime -1 2>/dev/null | head -n 1)" ]; then
    apt-get update -q >&2
  fi
  apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

# The core install's requirement specifiers: pyproject.toml's [project] dependencies (e.g. onnxruntime==1.32.0).
read_specs() {
  [ -f "$PYPROJECT" ] || die 1 "no pyproject.toml at $PYPROJECT"
  "$HOSTPY" - "$PYPROJECT" <<'EOF' || die 1 "cannot read the requirement specifiers from $PYPROJECT (host $HOSTPY needs Python >= 3.11)"
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
if any(";" in d for d in deps):
    sys.exit("arm64-root: a core dependency has an environment marker; this script installs plain specifiers only")
print(" ".join(d.replace(" ", "") for d in deps))
EOF
}

# A fake /proc/cpuinfo of cortex-a76 cores (CPU part 0xd0b), one entry per host CPU; Features are the HWCAPs
# qemu reports for -cpu cortex-a76 (getauxval(AT_HWCAP) = 0x119ffb).
fake_cpuinfo() {
  local n i
  n=$(nproc 2>/dev/null || echo 1)
  for ((i = 0; i < n; i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 48.00\n' "$i"
    printf 'Features\t: fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\n'
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n'
  done
}

write_cpuinfo() {
  local want
  want=$(fake_cpuinfo)
  [ -f "$ROOT/proc/cpuinfo" ] && [ "$(cat "$ROOT/proc/cpuinfo")" = "$want" ] && return 0
  printf '%s\n' "$want" > "$ROOT/proc/cpuinfo.tmp.$$" && mv -f "$ROOT/proc/cpuinfo.tmp.$$" "$ROOT/proc/cpuinfo"
}

guest() {  # run an aarch64 program of the root: guest PROGRAM ARG...
  QEMU_CPU="$QCPU" qemu-aarch64-static -L "$ROOT" "$@"
}

build_base() {
  local key=$1 debs="$ROOT.debs"
  [ "$(id -u)" -eq 0 ] || die 5 "building the root needs root (debootstrap); run it once with sudo, or point IVQ_ARM64_ROOT at a root built elsewhere"
  command -v debootstrap >/dev/null 2>&1 \
    || die 5 "debootstrap not found: install it (Debian/Ubuntu: apt-get install debootstrap), or rerun with --install-tools"
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] \
    || die 5 "no /usr/share/keyrings/debian-archive-keyring.gpg: install debian-archive-keyring"
  if [ -e "$ROOT" ] && [ ! -e "$ROOT/.ivq-arm64-root" ] && [ -n "$(ls -A "$ROOT" 2>/dev/null)" ]; then
    die 2 "$ROOT exists and is not an arm64 root this script made: refusing to replace it"
  fi
  say "building the base root in $ROOT ($SUITE arm64 from $MIRROR)"
  rm -rf "$ROOT"
  mkdir -p "$ROOT" "$debs"
  : > "$ROOT/.ivq-arm64-root"
  debootstrap --arch=arm64 --foreign --variant=minbase --include=python3,python3-venv \
    --cache-dir="$debs" "$SUITE" "$ROOT" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1 \
    || die 1 "debootstrap failed (last lines of $ROOT.debootstrap.log: $(tail -n 3 "$ROOT.debootstrap.log" | tr '\n' ' '))"
  # the second stage, without emulation: unpack every package. tar --keep-directory-symlink keeps the
  # merged-/usr links (bin, lib, sbin -> usr/...) that a plain `dpkg -x` replaces with directories.
  local d
  for d in "$ROOT"/var/cache/apt/archives/*.deb; do
    dpkg-deb --fsys-tarfile "$d" | tar -x --keep-directory-symlink -C "$ROOT" \
      || die 1 "cannot unpack $(basename "$d")"
  done
  rm -f "$ROOT"/var/cache/apt/archives/*.deb
  rm -rf "$ROOT"/usr/share/doc "$ROOT"/usr/share/man "$ROOT"/usr/share/info "$ROOT"/usr/share/locale
  # debootstrap in a container makes proc a symlink to the host's /proc; device nodes and sys are the host's
  # under qemu -L anyway (a missing path falls back to the host's): keep empty folders for a chroot user
  rm -rf "$ROOT/proc" "$ROOT/sys" "$ROOT/dev"
  mkdir -p "$ROOT/proc" "$ROOT/sys" "$ROOT/dev"
  write_cpuinfo
  mkdir -p "$ROOT/etc/ssl/certs"
  if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  else
    say "warning: no host /etc/ssl/certs/ca-certificates.crt to copy in (pip over HTTPS may fail)"
  fi
  # the root's own loader cache (host-style paths so nothing outside ROOT is written)
  guest "$ROOT/sbin/ldconfig" -X -C "$ROOT/etc/ld.so.cache" -f "$ROOT/etc/ld.so.conf" \
    || die 1 "ldconfig of the root failed"
  guest "$ROOT/usr/bin/python3" -c "import ssl, venv" || die 1 "the root's python3 does not run under qemu"
  printf '%s\n' "$key" > "$ROOT/.ivq-base.stamp"
}

build_venv() {
  local key=$1 specs=$2 wheel
  say "creating $ROOT/venv: pip install $specs (aarch64 wheels, emulated pip)"
  rm -rf "$ROOT/venv"
  guest "$ROOT/usr/bin/python3" -m venv --without-pip "$ROOT/venv" || die 1 "venv creation failed"
  wheel=$(ls "$ROOT"/usr/share/python-wheels/pip-*.whl | head -n 1)
  # pip runs from Debian's bundled wheel (no ensurepip: it would exec an aarch64 subprocess); wheels only,
  # since building an sdist needs a subprocess too. Its cache stays beside the root, not in the host's.
  # shellcheck disable=SC2086
  PIP_CACHE_DIR="$ROOT.pip-cache" PIP_DISABLE_PIP_VERSION_CHECK=1 \
    guest "$ROOT/venv/bin/python3" "$wheel/pip" install --quiet --only-binary=:all: "$wheel" $specs \
    || die 1 "pip install in the root failed"
  guest "$ROOT/venv/bin/python3" -m pip freeze > "$ROOT/venv/freeze.txt"
  printf '%s\n' "$key" > "$ROOT/.ivq-venv.stamp"
}

cmd_build() {
  need_qemu
  local specs base_key venv_key t0 lock
  specs=$(read_specs)
  base_key="v$STAMP_VERSION suite=$SUITE mirror=$MIRROR root=$ROOT"
  venv_key="$base_key specs=$specs"
  mkdir -p "$(dirname "$ROOT")"
  { exec 9> "$ROOT.lock"; } 2>/dev/null || die 1 "cannot write $ROOT.lock (is $(dirname "$ROOT") writable?)"
  flock 9 || die 1 "cannot lock $ROOT.lock"
  t0=$(date +%s)
  if [ "$(cat "$ROOT/.ivq-base.stamp" 2>/dev/null)" != "$base_key" ]; then
    rm -f "$ROOT/.ivq-venv.stamp"
    build_base "$base_key"
    say "base root in $(( $(date +%s) - t0 )) s"
  fi
  if [ "$(cat "$ROOT/.ivq-venv.stamp" 2>/dev/null)" != "$venv_key" ]; then
    build_venv "$venv_key" "$specs"
    say "built in $(( $(date +%s) - t0 )) s: $(du -sh "$ROOT" | cut -f1) on disk (+ $(du -sh "$ROOT.debs" 2>/dev/null | cut -f1) of cached .debs beside it)"
  else
    write_cpuinfo
    say "up to date: $ROOT ($specs)"
  fi
}

# run CMD: CMD without a slash is looked up in the root's venv/bin, usr/bin, usr/sbin
cmd_run() {
  [ $# -ge 1 ] || usage
  need_qemu
  [ -f "$ROOT/.ivq-venv.stamp" ] || die 1 "no arm64 root at $ROOT: run scripts/arm64-root.sh build first"
  local prog=$1 d; shift
  if [[ "$prog" != */* ]]; then
    for d in venv/bin usr/bin usr/sbin; do
      if [ -e "$ROOT/$d/$prog" ]; then prog="$ROOT/$d/$prog"; break; fi
    done
    [[ "$prog" == */* ]] || die 2 "no $prog in $ROOT/{venv/bin,usr/bin,usr/sbin}"
  fi
  [ -f "$prog" ] || die 2 "no such program: $prog"
  local interp=()
  if [ "$(head -c 2 "$prog")" = "#!" ]; then  # a script (venv/bin/ivq, pip): qemu runs ELF files only
    read -r -a interp < <(head -n 1 "$prog" | cut -c3-)
    [ ${#interp[@]} -gt 0 ] && [ -e "$ROOT${interp[0]}" ] && interp[0]="$ROOT${interp[0]}"
  fi
  [ "$QCPU" = max ] && say "warning: QEMU_CPU=max takes ORT's SME kernels, which gave wrong dynamic-int8 MatMul results"
  write_cpuinfo
  VIRTUAL_ENV="$ROOT/venv" QEMU_CPU="$QCPU" exec qemu-aarch64-static -L "$ROOT" "${interp[@]}" "$prog" "$@"
}

mode=build
install=0
parse_opts() {  # options before the mode, and after `build`
  while [ $# -gt 0 ]; do
    case "$1" in
      --root) [ $# -ge 2 ] || usage; ROOT=$2; shift 2 ;;
      --install-tools) install=1; shift ;;
      -h|--help) usage ;;
      *) break ;;
    esac
  done
  rest=("$@")
}
parse_opts "$@"; set -- "${rest[@]}"
if [ $# -gt 0 ]; then
  case "$1" in
    build|run|path|tools) mode=$1; shift ;;
    *) usage ;;
  esac
fi
if [ "$mode" = build ]; then
  parse_opts "$@"; set -- "${rest[@]}"
  [ $# -eq 0 ] || usage
  [ "$install" -eq 0 ] || install_tools
fi
case "$ROOT" in /*) ;; *) ROOT="$PWD/$ROOT" ;; esac
case "$mode" in
  build) cmd_build ;;
  run) cmd_run "$@" ;;
  path) echo "$ROOT" ;;
  tools) [ $# -eq 0 ] || usage; install_tools ;;
esac
