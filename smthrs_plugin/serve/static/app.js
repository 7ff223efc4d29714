// The review page of `smthrs serve`: pending plan cards and node requests, Approve / Deny with the session's
// approval token, the Decided section, and a live run view fed by the WebSocket projection stream.
//
// The entry module (the page's only <script>, type="module"): it wires the forms and runs the poll. Each module
// below imports only modules listed after it (no cycles; what a lower module must call above it is handed in):
//   pending.js  the pending lists, Approve / Deny, and settling decided items into the Decided section
//   runs.js     the Recent runs table
//   live.js     the /projections WebSocket streams: decision streams and the live run view
//   history.js  the Decided section: who decided, when, with which receipt, and what happens next
//   review.js   a card: envelope, node graph and declarations, gates, changes since the last approved card
//   rpc.js      JSON-RPC, the approval token, the JSON vocabulary's words, the plan card cache
//   dom.js      text-only element helpers (every server value is inserted as text, never as markup)

import { $, clock, flash } from "./dom.js";
import { forgetToken, keepToken, rpc, showTokenState } from "./rpc.js";
import { refreshHistory } from "./history.js";
import { watchRun, watchedRunId } from "./live.js";
import { recentRuns, renderRuns } from "./runs.js";
import { reconcile, setRefresh } from "./pending.js";

const POLL_MS = 3000;

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = $("token-input").value.trim();
  $("token-input").value = "";
  if (value === "") {
    flash("Paste the token printed by `smthrs serve` (the line `smthrs serve: approval token: …`).", "warn");
    return;
  }
  keepToken(value);
  showTokenState();
  flash("Token kept for this tab. Approve and Deny now act as the server's operator.", "info");
});

$("token-forget").addEventListener("click", () => {
  forgetToken();
  showTokenState();
  flash("Token forgotten: the page is read-only again.", "info");
});

$("watch-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const runId = $("watch-input").value.trim();
  if (runId) watchRun(runId, null);
});

// -- polling -------------------------------------------------------------------------------------------------------

let busy = false;
let refreshFailed = null; // the message a failed refresh flashed (cleared by the next good one)

async function refresh() {
  if (busy) return;
  busy = true;
  try {
    const pending = await rpc("review.pending", {});
    reconcile("plans", "plans-count", "plan", pending.plans || [], (p) => p.plan_id);
    reconcile("requests", "requests-count", "request", pending.requests || [], (r) => r.run_id + "/" + r.request);
    if (!watchedRunId() && (pending.requests || []).length) {
      const r = pending.requests[0];
      watchRun(r.run_id, r.plan_id);
    }
    renderRuns(await recentRuns());
    await refreshHistory();
    $("updated").textContent = "Updated " + clock(Date.now()) + ".";
    if (refreshFailed && $("flash").textContent === refreshFailed) $("flash").hidden = true;
    refreshFailed = null;
  } catch (err) {
    refreshFailed = "Could not refresh: " + err.message;
    flash(refreshFailed, "error");
  } finally {
    busy = false;
  }
}

setRefresh(refresh);
showTokenState();
refresh();
setInterval(refresh, POLL_MS);
