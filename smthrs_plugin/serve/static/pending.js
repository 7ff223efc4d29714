// The pending items (plan cards, node requests): shown while the server lists them, decided with Approve / Deny,
// and moved to the Decided section once decided — here, by the poll, or by their decision stream (a decision made
// by the CLI or another page is pushed as it commits).
//
// Invariant: a decision names what was reviewed: the card's digest (a request's node key) rides along as `digest`,
// so a card that changed between rendering and clicking is refused by the server instead of approved blind.

import { $, el, flash } from "./dom.js";
import { TERMINAL, cardOf, rpc, showTokenState } from "./rpc.js";
import { buildCard } from "./review.js";
import { requestDecision, showHistory } from "./history.js";
import { closeItemStream, itemStreamOpen, openItemStream, watchRun } from "./live.js";
import { expectRunOf } from "./runs.js";

const rendered = new Map(); // item key -> article element
const itemOf = new Map(); // item key -> {kind, item}: what a pending article shows
const settled = new Set(); // item keys moved to the history (never shown as pending again)
// Item keys this page is deciding right now: their own decision's journal event must not settle them as decided
// elsewhere before the page's answer arrives (the WebSocket can be faster than the RPC reply).
const deciding = new Set();

// The page's refresh (app.js owns the poll and imports this module, so it hands the refresh in: imports go one way).
let refresh = () => {};

export function setRefresh(fn) {
  refresh = fn;
}

function keyOfItem(kind, item) {
  return kind === "plan" ? item.plan_id : item.run_id + "/" + item.request;
}

async function decide(verb, kind, item, article) {
  const result = article.querySelector(".result");
  const buttons = article.querySelectorAll(".actions button.approve, .actions button.deny");
  const params =
    kind === "plan"
      ? { ident: item.plan_id, digest: item.digest }
      : { ident: item.run_id, request: item.request, digest: item.key };
  const key = kind + ":" + keyOfItem(kind, item);
  result.className = "result pending";
  result.textContent = verb === "approve" ? "approving\u2026" : "denying\u2026";
  buttons.forEach((b) => (b.disabled = true));
  deciding.add(key);
  try {
    const answer = await rpc(verb, params, true);
    const tag = answer && answer.receipt ? answer.receipt._tag : "done";
    const what = kind === "plan" ? "plan " + item.plan_id : "request " + item.request + " of run " + item.run_id;
    const done = verb === "approve" ? "Approved " : "Denied ";
    result.className = "result ok";
    result.textContent = done + "(" + tag + ")";
    flash(done + what + " \u2014 receipt " + tag + ".", "ok");
    if (kind === "plan" && verb === "approve") expectRunOf(item);
    if (kind === "request") watchRun(item.run_id, item.plan_id);
    settle(key, "page");
    refresh();
  } catch (err) {
    deciding.delete(key);
    result.className = "result error";
    result.textContent = err.message;
    flash(err.message, "error");
    buttons.forEach((b) => (b.disabled = false));
  }
}

// Shows the `items` of `kind` the server lists as pending, and settles the shown ones it no longer lists.
export function reconcile(containerId, countId, kind, items, keyOf) {
  const container = $(containerId);
  const keys = new Set();
  for (const item of items) {
    const key = kind + ":" + keyOf(item);
    keys.add(key);
    if (rendered.has(key) || settled.has(key)) continue;
    rendered.set(key, null); // reserved while the card loads
    itemOf.set(key, { kind: kind, item: item });
    const planId = item.plan_id;
    const load = planId ? cardOf(planId) : Promise.resolve(null);
    load
      .then((card) => {
        if (!rendered.has(key)) return; // decided meanwhile
        const article = buildCard(kind, item, card, { decide: decide, watchRun: watchRun });
        rendered.set(key, article);
        container.appendChild(article);
        watchDecision(key);
        showTokenState();
        empty(container, false);
      })
      .catch((err) => {
        rendered.delete(key);
        flash("Could not load card " + planId + ": " + err.message, "error");
      });
  }
  for (const [key, article] of [...rendered]) {
    if (!key.startsWith(kind + ":") || keys.has(key)) continue;
    if (!article) {
      rendered.delete(key);
      continue;
    }
    // An item with an open decision stream is settled by that stream (it pushes the decision as it commits);
    // the poll settles the others.
    if (itemStreamOpen(key)) continue;
    settle(key, "poll");
  }
  const shown = [...rendered.keys()].filter((k) => k.startsWith(kind + ":")).length;
  $(countId).textContent = "(" + shown + ")";
  empty(container, shown === 0);
}

function empty(container, isEmpty) {
  let note = container.querySelector(":scope > .empty");
  if (isEmpty && !note) {
    note = el("p", "empty muted", "Nothing is waiting.");
    container.appendChild(note);
  } else if (!isEmpty && note) {
    note.remove();
  }
}

// -- decision streams ----------------------------------------------------------------------------------------------

// The journal partition an item's decision is written to: a plan card's `plan:<id>`, a node request's run.
function partitionOf(key) {
  const entry = itemOf.get(key);
  if (!entry) return null;
  return entry.kind === "plan" ? "plan:" + entry.item.plan_id : entry.item.run_id;
}

function watchDecision(key) {
  const partition = partitionOf(key);
  if (!partition || settled.has(key)) return;
  const check = { checking: false, again: false };
  openItemStream(key, partition, {
    onLive: (open) => {
      const article = rendered.get(key);
      if (article) article.dataset.live = open ? "1" : "";
    },
    onDecisionEvent: () => checkItem(key, check),
  });
}

// Something was journaled where the item's decision is written: ask the server whether it is still pending.
async function checkItem(key, state) {
  if (deciding.has(key)) return; // this page's own decision: decide() settles it with its answer
  if (state.checking) {
    state.again = true;
    return;
  }
  state.checking = true;
  try {
    do {
      state.again = false;
      const h = await historyOf(key);
      if (h && !stillPending(key, h) && !deciding.has(key)) {
        settle(key, "live", h);
        return;
      }
    } while (state.again);
  } catch (err) {
    flash("Could not read the history of " + key.slice(key.indexOf(":") + 1) + ": " + err.message, "error");
  } finally {
    state.checking = false;
  }
}

function historyOf(key) {
  const entry = itemOf.get(key);
  if (!entry) return Promise.resolve(null);
  return rpc("review.history", { ident: entry.kind === "plan" ? entry.item.plan_id : entry.item.run_id });
}

function stillPending(key, h) {
  const entry = itemOf.get(key);
  if (h.kind === "plan") return !h.decision || h.decision.state === "pending";
  if (TERMINAL.has(h.status)) return false;
  const d = requestDecision(h, entry.item.request);
  return !d || d.state === "pending";
}

// -- settling: a decided item leaves the pending lists for the Decided section ---------------------------------------

async function settle(key, source, known) {
  if (settled.has(key)) return;
  settled.add(key);
  closeItemStream(key);
  const article = rendered.get(key);
  rendered.delete(key);
  if (article) article.remove();
  const entry = itemOf.get(key);
  for (const [containerId, countId, kind] of [["plans", "plans-count", "plan"], ["requests", "requests-count", "request"]]) {
    const shown = [...rendered.keys()].filter((k) => k.startsWith(kind + ":")).length;
    $(countId).textContent = "(" + shown + ")";
    empty($(containerId), shown === 0);
  }
  if (!entry) return;
  const ident = entry.kind === "plan" ? entry.item.plan_id : entry.item.run_id;
  try {
    const h = known || (await rpc("review.history", { ident: ident }));
    showHistory(key, h, entry.kind === "plan" ? null : entry.item.request, source);
    if (source === "live") {
      const d = entry.kind === "plan" ? h.decision : requestDecision(h, entry.item.request);
      const what = entry.kind === "plan" ? "plan " + ident : "request " + entry.item.request + " of run " + ident;
      const state = d ? d.state : h.status;
      flash("Decided elsewhere: " + what + " " + state + (d && d.principal ? " by " + d.principal : "") + ".", "info");
    }
  } catch (err) {
    flash("Could not read the history of " + ident + ": " + err.message, "error");
  }
}
