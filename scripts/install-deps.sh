#!/usr/bin/env bash
# Installs what kvcomp needs to build and test on Debian 12 (as root, or with sudo available): the
# packages named in scripts/debian-packages.txt, plus cmake when no cmake is on PATH, then oneDNN from
# PyPI (scripts/install-onednn.sh, into a prefix under ~/.cache). Skips what is present.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t packages < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/debian-packages.txt | grep -v '^$')
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

bash scripts/install-onednn.sh >/dev/null
