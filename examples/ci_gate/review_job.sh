#!/usr/bin/env bash
# The CI job of examples/ci_gate/pipeline.yaml with a person approving in the browser (docs/tutorials/ci-pipelines.md, "Approve from a
# browser"): plan, run with a key (parks, exit 75), print the review page's URL, then retry the SAME command with
# the SAME key every REVIEW_POLL_S seconds while it exits 75. Each approval in the page (the plan card, then the
# deploy node's request `ship`) lets the next retry go further; the job exits 0 once the run completed. A retry
# never runs anything twice (receipts), so the loop is safe however often it turns.
#
#   SMTHRS             the command line (default: smthrs)
#   CI_GATE_WORKSPACE  where to build (default: a fresh temporary directory)
#   SMTHRS_SERVE_URL   the review server to point the person at (a `smthrs serve` on this job's database, e.g. one
#                      the team runs with SMTHRS_SERVE_TOKEN on a network address). Unset: the job starts
#                      `smthrs serve` on 127.0.0.1 itself and writes its stderr — the approval token is on it — to
#                      $SMTHRS_WORKSPACE/.smthrs/serve.log (mode 600; the token is never printed to the job's log).
#   REVIEW_DEADLINE_S  give up after this many seconds without completing (default 3600): exit 75, still parked —
#                      re-run the job later with the same key and it continues where it stopped
#   REVIEW_POLL_S      seconds between retries (default 10)
#
# Exit: 0 completed · 75 still waiting for a decision at the deadline · anything else: the run's own failure
# (a denied plan or request, a failed node) as `smthrs run` reports it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
SMTHRS="${SMTHRS:-smthrs}"
REVIEW_DEADLINE_S="${REVIEW_DEADLINE_S:-3600}"
REVIEW_POLL_S="${REVIEW_POLL_S:-10}"
ws="${CI_GATE_WORKSPACE:-$(mktemp -d)}"
mkdir -p "$ws/src" "$ws/.smthrs"
echo "release 1.4.0" > "$ws/src/app.txt"
cp "$here/pipeline.yaml" "$ws/pipeline.yaml"
cd "$ws"
export SMTHRS_WORKSPACE="$ws"
KEY="deploy:v1.4.0"
field() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# 1. The review server: the one given, or our own on loopback (stopped when the job ends, by its pid only).
serve_pid=""
cleanup() { if [ -n "$serve_pid" ]; then kill "$serve_pid" 2>/dev/null || true; wait "$serve_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
url="${SMTHRS_SERVE_URL:-}"
if [ -z "$url" ]; then
  log="$ws/.smthrs/serve.log"
  (umask 077 && : > "$log")
  $SMTHRS serve --host 127.0.0.1 --port 0 2> "$log" &
  serve_pid=$!
  for _ in $(seq 1 600); do  # up to 60 s for the server to bind (a busy CI machine)
    url="$(sed -n 's/^smthrs serve: listening on \(http[^ ]*\).*/\1/p' "$log" | head -n 1)"
    [ -n "$url" ] && break
    kill -0 "$serve_pid" 2>/dev/null || { echo "smthrs serve exited:"; grep -v 'approval token' "$log"; exit 1; }
    sleep 0.1
  done
  [ -n "$url" ] || { echo "smthrs serve did not report its address within 60 s"; exit 1; }
  echo "started smthrs serve at $url (approval token: the 'approval token' line of $log)"
fi

# 2. Plan: the reviewable card.
plan_id="$($SMTHRS plan pipeline.yaml --json | field "d['plan_id']")"
echo "planned $plan_id"
echo "review and approve at: $url"

# 3. Run, and retry the same command while it parks (75) until it completes or the deadline passes.
deadline=$((SECONDS + REVIEW_DEADLINE_S))
last=""
while :; do
  set +e; out="$($SMTHRS run pipeline.yaml --key "$KEY" --json)"; code=$?; set -e
  if [ "$code" -eq 0 ]; then
    echo "run completed: $(echo "$out" | field "d['run_id'] + ' ' + d['status']")"
    break
  fi
  if [ "$code" -ne 75 ]; then
    echo "run stopped (exit $code): $out"
    exit "$code"
  fi
  waiting="$(echo "$out" | python3 -c '
import json, sys
d = json.load(sys.stdin)
asked = [r["request_id"] for r in d.get("requests") or [] if r.get("state") == "pending"]
if d.get("run_id") is None:
    print("plan " + str(d.get("plan_id")) + " waits for its approval")
elif asked:
    print("run " + d["run_id"] + " waits for request " + ", ".join(asked))
else:
    print("run " + d["run_id"] + " is " + str(d.get("status")))
')"
  if [ "$waiting" != "$last" ]; then
    echo "parked (75): $waiting — approve at $url"
    last="$waiting"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "no decision within ${REVIEW_DEADLINE_S}s; still parked — re-run this job (same key) to continue"
    exit 75
  fi
  sleep "$REVIEW_POLL_S"
done
test -f deployed/app.txt && echo "deployed: $(cat deployed/app.txt)"
