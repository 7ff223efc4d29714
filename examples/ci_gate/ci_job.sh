#!/usr/bin/env bash
# Plays the CI job of examples/ci_gate/pipeline.yaml: plan, run (parks 75 on the plan approval), approve, run
# again with the same key (parks 75 on the deploy node's approval), approve the node, run again → done (0).
# In a real pipeline the two `approve` lines are a human (or a delegated bot) acting between two CI retries; the
# retries are the same command with the same --key, so a retry never runs anything twice.
#
#   SMTHRS             the command line (default: smthrs)
#   CI_GATE_WORKSPACE  where to build (default: a fresh temporary directory)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
SMTHRS="${SMTHRS:-smthrs}"
ws="${CI_GATE_WORKSPACE:-$(mktemp -d)}"
mkdir -p "$ws/src"
echo "release 1.4.0" > "$ws/src/app.txt"
cp "$here/pipeline.yaml" "$ws/pipeline.yaml"
cd "$ws"
export SMTHRS_WORKSPACE="$ws"
KEY="deploy:v1.4.0"
field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

# 1. Plan: the reviewable card (plan id, digest, node graph).
plan_id="$($SMTHRS plan pipeline.yaml --json | field "['plan_id']")"
echo "planned $plan_id"

# 2. The CI job runs it: the plan needs an approval, so the run parks (75) and records nothing.
set +e; $SMTHRS run pipeline.yaml --key "$KEY" >/dev/null; code=$?; set -e
[ "$code" -eq 75 ] || { echo "expected 75, got $code"; exit 1; }
echo "run exited 75 (parked: plan approval)"

# 3. Someone with approval authority approves the card they reviewed (default: only local/operator may).
$SMTHRS approve "$plan_id" >/dev/null
echo "approved plan $plan_id"

# 4. The CI retry (same command, same key): build and test run, the deploy node asks for its own approval.
set +e; out="$($SMTHRS run pipeline.yaml --key "$KEY" --json)"; code=$?; set -e
[ "$code" -eq 75 ] || { echo "expected 75, got $code: $out"; exit 1; }
run_id="$(echo "$out" | field "['run_id']")"
echo "run exited 75 (parked: deploy approval) — run $run_id waits for request 'ship'"

# 5. Approve the deploy; the decision records a resume delegation and wakes the run.
$SMTHRS approve "$run_id" --request ship >/dev/null
echo "approved request ship of $run_id"

# 6. The CI retry again: the woken run is driven on (build and test replay clean), deploy runs, exit 0.
$SMTHRS run pipeline.yaml --key "$KEY"
# 7. And once more: nothing runs twice (AlreadyApplied, exit 0).
$SMTHRS run pipeline.yaml --key "$KEY" --json | field "['receipt']['_tag']"
test -f deployed/app.txt && echo "deployed: $(cat deployed/app.txt)"
