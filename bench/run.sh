#!/usr/bin/env bash
# The benchmark run: starts a throwaway redis-server (installing it with
# apt-get if missing), runs every scenario, stops the server, writes
# bench/results/<date>.json, the plot, and BENCHMARKS.md at the repo root.
#   bash bench/run.sh            # the full run (-full), about 25 minutes
#   bash bench/run.sh -quick     # 2-second scenarios, a subset
set -euo pipefail
cd "$(dirname "$0")"
if [ $# -eq 0 ]; then set -- -full; fi
exec go run . "$@"
