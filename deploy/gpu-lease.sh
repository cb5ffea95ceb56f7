#!/usr/bin/env bash
# One short GPU lease towards the CUDA acceptance (issue 17). The machine keeps its own torch; what
# else the course needs comes from a folder of wheels made where there is network:
#     python -m autograder acceptance --download-wheels .whl --have FREEZE   (FREEZE: the machine's pip freeze)
# Then, on the GPU machine, in the repository's root:
#     deploy/gpu-lease.sh [WHEELS] [BUDGET_SECONDS]      (NO_BENCHMARKS=1: grade only)
# grades the lessons not yet accepted on CUDA (benchmarks/results/acceptance-cuda.json), as many as
# their recorded costs fit in the budget, and merges the results there; commit them afterwards.
# Successive leases complete the acceptance lesson by lesson. With $OUT set (a lease tool's folder
# that comes back), a copy of the results and the grading logs goes there too.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.whl}
budget=${2:-420}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
"$python" -m autograder acceptance --prepare --wheels "$wheels" || exit 3
# The budget plans from recorded costs, which can be short (a lesson that failed early); the timeout makes
# it a wall: a lesson cut midway keeps its streamed log, and what finished is already recorded.
left=$(( budget - ($(date +%s) - start) ))
timeout -k 10 "$left" "$python" -m autograder acceptance --device cuda --record --missing-only --budget "$left" \
  --jobs 3 ${NO_BENCHMARKS:+--no-benchmarks} --out /tmp/acceptance-lease
code=$?
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/acceptance-lease.tgz" benchmarks/results /tmp/acceptance-lease/grading/*.log 2>/dev/null
  cp benchmarks/results/acceptance-cuda.md "$OUT/" 2>/dev/null
fi
exit $code
