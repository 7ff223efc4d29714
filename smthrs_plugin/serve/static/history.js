// The Decided section: cards and requests decided while the page is open (here, by the CLI or by another page),
// and any run's history on demand — who decided, when, with which scope, digest and receipt, and what happens next.

import { $, clear, el, flash, when } from "./dom.js";
import { TERMINAL, rpc } from "./rpc.js";

const MAX_HISTORY = 20;
const historyEntries = new Map(); // history key -> {ident, request, source, node}

// A run history's decision of node request `request` (null while none is journaled).
export function requestDecision(h, request) {
  return (h.decisions || []).find((d) => d.request === request) || null;
}

// `h` (a review.history answer) as the entry `key` of the Decided section: newest first, at most MAX_HISTORY.
export function showHistory(key, h, request, source) {
  const box = $("history");
  let rec = historyEntries.get(key);
  if (!rec) {
    rec = { node: el("article", "history-entry"), request: request, ident: h.kind === "plan" ? h.plan_id : h.run_id };
    historyEntries.set(key, rec);
    box.insertBefore(rec.node, box.firstChild);
    while (historyEntries.size > MAX_HISTORY) {
      const [oldest, old] = historyEntries.entries().next().value;
      historyEntries.delete(oldest);
      old.node.remove();
    }
  }
  rec.source = source || rec.source;
  rec.done = h.kind === "plan" ? !!(h.decision && h.decision.state !== "pending") : TERMINAL.has(h.status);
  renderHistory(rec, h);
  const note = box.querySelector(":scope > .empty");
  if (note) note.remove();
}

function decisionLine(d) {
  const line = el("div", "decision");
  const state = d.state || "pending";
  line.appendChild(el("span", "state st-" + state.replace(/[^a-z-]/g, ""), state));
  const fact = (label, value, cls) => {
    if (value === undefined || value === null || value === "") return;
    line.appendChild(el("span", "label", label));
    line.appendChild(el("code", cls, value));
  };
  if (d.kind === "Node") fact("request", d.request, "h-request");
  fact("by", d.principal, "h-principal");
  if (typeof d.decided_at_ms === "number") fact("at", when(d.decided_at_ms), "h-at");
  fact("scope", d.scope, "h-scope");
  fact("digest", d.kind === "Node" ? d.key : d.digest, "h-digest");
  fact("receipt", d.receipt || (d.state !== "pending" ? (d.via_grant ? "none: decided by grant " + d.via_grant : "under the decider's own key") : ""), "h-receipt");
  return line;
}

function renderHistory(rec, h) {
  const node = rec.node;
  clear(node);
  node.dataset.ident = rec.ident;
  node.dataset.source = rec.source || "";
  if (rec.request) node.dataset.request = rec.request;
  const head = el("header", "history-head");
  if (h.kind === "plan") {
    head.appendChild(el("span", "label", "plan"));
    head.appendChild(el("code", "h-ident", h.plan_id));
  } else {
    head.appendChild(el("span", "label", "run"));
    head.appendChild(el("code", "h-ident", h.run_id));
    head.appendChild(el("span", "label", "status"));
    head.appendChild(el("span", "status s-" + String(h.status).replace(/[^a-z-]/g, ""), h.status));
    if (h.plan_id) {
      head.appendChild(el("span", "label", "plan"));
      head.appendChild(el("code", "h-plan", h.plan_id));
    }
  }
  head.appendChild(el("span", "label", "flow"));
  head.appendChild(el("span", "", h.flow));
  node.appendChild(head);
  if (h.kind === "plan") {
    if (h.decision) node.appendChild(decisionLine(h.decision));
    else node.appendChild(el("div", "muted", "This card needs no approval."));
  } else {
    if (h.plan_decision) {
      const p = decisionLine(h.plan_decision);
      p.insertBefore(el("span", "label", "plan card"), p.firstChild);
      node.appendChild(p);
    }
    const shown = rec.request ? (h.decisions || []).filter((d) => d.request === rec.request) : h.decisions || [];
    for (const d of shown) node.appendChild(decisionLine(d));
    if (h.omitted) node.appendChild(el("div", "muted", h.omitted + " earlier decisions not listed"));
  }
  const next = h.next || {};
  const nx = el("div", "next next-" + String(next.state || "").replace(/[^a-z-]/g, ""));
  nx.appendChild(el("span", "label", "next"));
  if (next.state === "woken") nx.appendChild(el("strong", "woken", "woken"));
  nx.appendChild(el("span", "next-text", next.text || ""));
  if (next.command) {
    const cmd = el("div", "next-command-row");
    cmd.appendChild(el("code", "next-command", next.command));
    nx.appendChild(cmd);
  }
  node.appendChild(nx);
  const pf = h.prefect;
  if (pf) {
    const line = el("div", "prefect");
    line.appendChild(el("span", "label", "prefect flow run"));
    if (typeof pf.url === "string" && /^https?:\/\//.test(pf.url)) {
      const a = el("a", "prefect-link", pf.flow_run_id);
      a.href = pf.url;
      a.target = "_blank";
      a.rel = "noopener noreferrer";
      line.appendChild(a);
    } else {
      line.appendChild(el("code", "", pf.flow_run_id));
      line.appendChild(el("span", "muted", " (set PREFECT_UI_URL for a link)"));
    }
    node.appendChild(line);
  }
}

// Runs in the history keep moving (woken, resumed, settled): their entries are read again on each poll.
export async function refreshHistory() {
  for (const [key, rec] of [...historyEntries]) {
    if (rec.done || key.startsWith("plan:")) continue; // a plan card's decision is final once made
    try {
      renderHistory(rec, await rpc("review.history", { ident: rec.ident }));
    } catch (err) {
      flash("Could not refresh the history of " + rec.ident + ": " + err.message, "error");
    }
  }
}

export async function showRunHistory(runId) {
  try {
    showHistory("run:" + runId, await rpc("review.history", { ident: runId }), null, "asked");
    $("history").scrollIntoView({ block: "nearest" });
  } catch (err) {
    flash("Could not read the history of run " + runId + ": " + err.message, "error");
  }
}
