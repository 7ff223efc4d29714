// The Recent runs table: the newest runs of the catalog, each with Watch (the live view) and History (the Decided
// section); after a plan approval, the run its retry starts is watched as soon as it appears.

import { $, clear, clock, el } from "./dom.js";
import { rpc } from "./rpc.js";
import { showRunHistory } from "./history.js";
import { liveIdle, watchRun } from "./live.js";

let expecting = null; // {flow, known: Set(run ids)} after a plan approval: watch the run its retry starts
let knownRuns = new Set();

export function expectRunOf(item) {
  expecting = { flow: item.flow, planId: item.plan_id, known: new Set(knownRuns) };
}

export function renderRuns(runs) {
  const tbody = $("runs");
  clear(tbody);
  const list = (runs || []).slice().reverse();
  for (const r of list) {
    const tr = el("tr");
    tr.appendChild(el("td", "mono", r.run_id));
    tr.appendChild(el("td", "", r.flow));
    tr.appendChild(el("td", "status s-" + String(r.status).replace(/[^a-z-]/g, ""), r.status));
    tr.appendChild(el("td", "", clock(r.created_at_ms)));
    const td = el("td");
    const b = el("button", "quiet", "Watch");
    b.type = "button";
    b.addEventListener("click", () => watchRun(r.run_id, null));
    td.appendChild(b);
    const hb = el("button", "quiet history-run", "History");
    hb.type = "button";
    hb.addEventListener("click", () => showRunHistory(r.run_id));
    td.appendChild(hb);
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
  if (list.length === 0) {
    const tr = el("tr");
    const td = el("td", "muted", "No runs yet.");
    td.colSpan = 5;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
  if (expecting) {
    const fresh = (runs || []).find((r) => !expecting.known.has(r.run_id) && r.flow === expecting.flow);
    if (fresh) {
      const planId = expecting.planId;
      expecting = null;
      if (liveIdle()) watchRun(fresh.run_id, planId);
    }
  }
  knownRuns = new Set((runs || []).map((r) => r.run_id));
}

// The catalog lists runs oldest first, a page at a time (keyset cursors). The first load pages to the end once;
// later polls start from the cursor two pages before the end, so they read the newest runs (with their current
// status) and any run created since, never the whole catalog again.
const RECENT = 12;
const RUNS_PAGE = 50;
let runsAnchor = null;

export async function recentRuns() {
  let cursor = runsAnchor;
  const starts = [];
  let all = [];
  for (;;) {
    const page = await rpc("runs", cursor ? { limit: RUNS_PAGE, cursor: cursor } : { limit: RUNS_PAGE });
    starts.push(cursor);
    all = all.concat((page && page.runs) || []).slice(-2 * RUNS_PAGE);
    cursor = page && page.cursor;
    if (!cursor) break;
  }
  runsAnchor = starts.length >= 2 ? starts[starts.length - 2] : starts[0];
  return all.slice(-RECENT);
}
