#!/usr/bin/env bash
# Install dataplane from this checkout, with every backend this machine can run.
#
#   DATAPLANE_EXTRAS   pip extras to install (default: all = tq, mooncake, ray, dev)
#   DATAPLANE_TORCH    torch requirement used only when no torch is installed (default: torch==2.13.0)
#   DATAPLANE_TORCH_INDEX  optional index for that torch, e.g. https://download.pytorch.org/whl/cpu
#
# An installed torch (CPU or CUDA build) is kept as it is. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python || command -v python3)}
EXTRAS=${DATAPLANE_EXTRAS:-all}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Mooncake's CPU wheel links Debian's libibverbs1, libnuma1 and libcurl4.
if [[ ",$EXTRAS," == *",all,"* || ",$EXTRAS," == *"mooncake"* || ",$EXTRAS," == *",tq,"* ]]; then
  need=()
  for pkg in libibverbs1 libnuma1 libcurl4; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      echo "setup.sh: please install ${need[*]} (Debian/Ubuntu: sudo apt-get install ${need[*]})" >&2
      exit 1
    fi
  fi
fi

# Keep the user's torch; otherwise install a CPU build, never pull a multi-GB CUDA build by accident.
# torch's version is read from its metadata, never by importing it: before the install below brings
# numpy, `import torch` prints "Failed to initialize NumPy" (a torch wheel does not require numpy).
torch_version() { "$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
if ! torch_version >/dev/null; then
  "$PY" -m pip install -q "${DATAPLANE_TORCH:-torch==2.13.0}" ${DATAPLANE_TORCH_INDEX:+--index-url "$DATAPLANE_TORCH_INDEX"}
fi
torch_full=$(torch_version)
torch_req="torch==${torch_full%%+*}"

# The constraint stops any backend's requirements from swapping the installed torch for another build.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_full" >"$constraints"
"$PY" -m pip install -q -c "$constraints" -e ".[${EXTRAS}]"
echo "setup.sh: dataplane installed with [${EXTRAS}] (${torch_req})"
