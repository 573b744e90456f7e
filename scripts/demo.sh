#!/usr/bin/env bash
# Set-up command 1: install what is missing, build, run `kvcomp demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/install-torch.sh
bash scripts/build.sh
./build/cli/kvcomp demo "$@"
