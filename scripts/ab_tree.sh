#!/usr/bin/env bash
# Put the packages of an earlier revision in ab_before/ (ignored through .git/info/exclude), for
# an A/B of two trees inside one device call: `bash bench/h200_session.sh overhead-ab` runs the
# tracer-cost bench from ab_before/ and from the working tree, alternated (carry ab_before/).
# Usage: bash scripts/ab_tree.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/ab_tree.sh REV}
rm -rf ab_before && mkdir ab_before
git archive "$rev" engine instrument analysis stepscope tracekit bench | tar -x -C ab_before
exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qx "ab_before/" "$exclude" 2>/dev/null || echo "ab_before/" >> "$exclude"
echo "ab_before/ = $(git rev-parse --short "$rev") ($(du -sh ab_before | cut -f1))"
