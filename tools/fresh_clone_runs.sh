#!/usr/bin/env bash
# Runs the README's test command (.ci/run) from fresh clones, several times in
# a row, in folders whose names have tripped tests before ("bps_tf", a name
# with a space), optionally with a busy loop on every core during one run.
#
#   tools/fresh_clone_runs.sh [RUNS] [HOG_RUN]
#     RUNS     how many runs (default 5), alternating the two folder names
#     HOG_RUN  which run (1-based) gets a CPU hog on every core (default 3; 0: none)
#
# Each run clones HEAD of this repository into a new folder under
# ${FRESH_ROOT:-/tmp/bps_fresh}, so uncommitted changes are not tested.
# Prints one line per run and exits non-zero if any run failed.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
RUNS="${1:-5}"
HOG_RUN="${2:-3}"
ROOT="${FRESH_ROOT:-/tmp/bps_fresh}"
NAMES=("bps_tf" "x y")
mkdir -p "$ROOT"
failed=0
for ((i = 1; i <= RUNS; i++)); do
    dir="$ROOT/run$i/${NAMES[$(((i - 1) % 2))]}"
    rm -rf "$ROOT/run$i" && mkdir -p "$(dirname "$dir")"
    git clone -q "$REPO" "$dir"
    hogs=()
    if [[ "$i" == "$HOG_RUN" ]]; then
        for ((c = 0; c < $(nproc); c++)); do
            ( while :; do :; done ) &
            hogs+=($!)
        done
    fi
    start=$(date +%s)
    (cd "$dir" && bash .ci/run) > "$ROOT/run$i.log" 2>&1
    rc=$?
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    wait "${hogs[@]}" 2>/dev/null
    summary=$(grep -E "passed|failed" "$ROOT/run$i.log" | tail -1)
    echo "run $i in '$dir'$([[ ${#hogs[@]} -gt 0 ]] && echo ' (CPU hog)'): rc=$rc, $(( $(date +%s) - start )) s: $summary"
    [[ $rc -ne 0 ]] && failed=1
done
exit $failed
