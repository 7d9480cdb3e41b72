#!/usr/bin/env bash
# Set-up steps of `make simulate` and `make test` (see the Makefile); each says what it does.
#
#   scripts/setup.sh venv VENV EXTRA   create or update VENV with pagedkv[EXTRA] (editable); for
#                                      an extra that pulls torch, a CPU build where no NVIDIA GPU is
#   scripts/setup.sh redis             make sure redis-server is installed (apt-get), or say why not
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*"; }
fail() { echo "setup: error: $*" >&2; exit 1; }

# The torch release pinned for CPU-only machines; a local wheel of it is used when pip's own
# configuration offers one (find-links), else the PyTorch CPU index is asked.
TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

install_cpu_torch() {
    local pip=("$1/bin/python" -m pip install -q)
    if "$1/bin/python" -c "import torch" >/dev/null 2>&1; then
        say "torch $("$1/bin/python" -c 'import torch; print(torch.__version__)') is already installed"
        return
    fi
    if has_nvidia_gpu; then
        say "NVIDIA GPU found: torch comes from the extra's requirement (a CUDA build)"
        return
    fi
    # Without a GPU a plain `pip install torch` downloads a CUDA build and several GB of nvidia
    # wheels; a CPU build does everything the tests need. Its dependencies come with the extra.
    if "${pip[@]}" --no-index --no-deps "torch==$TORCH_VERSION" >/dev/null 2>&1; then
        say "no NVIDIA GPU: installed torch $TORCH_VERSION (CPU build) from a local wheel"
    else
        say "no NVIDIA GPU: installing a CPU build of torch from $TORCH_CPU_INDEX"
        "${pip[@]}" torch --index-url "$TORCH_CPU_INDEX" ||
            fail "could not install a CPU build of torch (is $TORCH_CPU_INDEX reachable?)"
    fi
}

setup_venv() {
    local venv=$1 extra=$2 python=${PYTHON:-python3}
    command -v "$python" >/dev/null 2>&1 || fail "$python not found (set PYTHON=/path/to/python3.11+)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        fail "pagedkv needs Python >= 3.11; $python is $("$python" --version 2>&1) (set PYTHON=...)"
    if [ ! -x "$venv/bin/python" ]; then
        say "creating the virtual environment $venv ($("$python" --version 2>&1))"
        "$python" -m venv "$venv" ||
            fail "$python -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    fi
    case $extra in
        dev | torch) install_cpu_torch "$venv" ;;
    esac
    say "installing pagedkv[$extra] (editable) and its requirements into $venv"
    "$venv/bin/python" -m pip install -q -e ".[$extra]"
    touch "$venv/.pagedkv-$extra"
    say "$venv is ready for pagedkv[$extra]"
}

setup_redis() {
    if command -v redis-server >/dev/null 2>&1; then
        return
    fi
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
    if command -v apt-get >/dev/null 2>&1 && "${sudo[@]}" true >/dev/null 2>&1; then
        say "redis-server is missing (the router's Redis tests start one): installing it with apt-get"
        "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq redis-server >/dev/null
        command -v redis-server >/dev/null 2>&1 && return
    fi
    echo "setup: WARNING: redis-server is not installed and could not be installed here (needs" \
        "apt-get as root or passwordless sudo); the Redis tests will FAIL. Install it" \
        "(apt-get install redis-server, dnf install redis, brew install redis) and rerun." >&2
}

case ${1:-} in
    venv) [ $# -eq 3 ] || fail "usage: $0 venv VENV EXTRA"; setup_venv "$2" "$3" ;;
    redis) setup_redis ;;
    *) fail "usage: $0 venv VENV EXTRA | $0 redis" ;;
esac
