#!/usr/bin/env bash
# Installs what kvcomp needs to build and test on Debian 12 (as root, or with
# sudo available). Skips the package manager when everything is present.
set -euo pipefail

packages=(g++ make ninja-build pkg-config libdnnl-dev libgtest-dev libgmock-dev libbenchmark-dev
          nlohmann-json3-dev libcli11-dev clang libclang-rt-14-dev libomp-14-dev)
command -v cmake >/dev/null 2>&1 || packages+=(cmake)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "[kvcomp] installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
