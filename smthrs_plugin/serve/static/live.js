// The /projections WebSocket streams: one per pending item (its decision pushed as it commits), and the live run
// view (a run's journal events, node outcomes and status, drawn on its plan's node graph).
//
// Invariant: a stream resumes from the last cursor it received, so a reconnect neither skips nor repeats an event.

import { $, clear, clock, el, flash, json } from "./dom.js";
import { TERMINAL, cardOf, statusWord } from "./rpc.js";
import { drawGraph } from "./review.js";

function projectionsUrl(partition, cursor) {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  let url = proto + "//" + location.host + "/projections?run_id=" + encodeURIComponent(partition);
  if (cursor) url += "&after_cursor=" + encodeURIComponent(cursor);
  return url;
}

// -- decision streams: a decision made anywhere (the CLI, another page) is pushed to this page ----------------------

// One stream per pending item, on the journal partition its decision is written to: a plan card's `plan:<id>`, a
// node request's run. At most MAX_ITEM_STREAMS (the server caps streams); the others are settled by the poll.
const MAX_ITEM_STREAMS = 8;
const itemStreams = new Map(); // item key -> {socket, open, cursor, closed}

// hooks: {onLive(open): the stream opened or closed, onDecisionEvent(): an event that may decide the item}.
export function openItemStream(key, partition, hooks) {
  if (itemStreams.has(key) || itemStreams.size >= MAX_ITEM_STREAMS) return;
  const state = { socket: null, open: false, cursor: null, closed: false };
  itemStreams.set(key, state);
  connectItem(partition, state, hooks);
}

export function itemStreamOpen(key) {
  const state = itemStreams.get(key);
  return !!(state && state.open);
}

function connectItem(partition, state, hooks) {
  if (state.closed) return;
  const socket = new WebSocket(projectionsUrl(partition, state.cursor));
  state.socket = socket;
  socket.onopen = () => {
    state.open = true;
    hooks.onLive(true);
  };
  socket.onmessage = (msg) => {
    let ev;
    try {
      ev = JSON.parse(msg.data);
    } catch (err) {
      return;
    }
    if (!ev || ev.error) return;
    if (typeof ev.cursor === "string") state.cursor = ev.cursor;
    const kind = String(ev.kind || "");
    if (kind.startsWith("control.approval.") || kind.startsWith("control.run.") || kind === "run-settled") {
      hooks.onDecisionEvent();
    }
  };
  socket.onclose = () => {
    state.open = false;
    hooks.onLive(false);
    if (state.closed) return;
    setTimeout(() => connectItem(partition, state, hooks), 2000); // resumes after its cursor; the poll covers the gap
  };
}

export function closeItemStream(key) {
  const state = itemStreams.get(key);
  if (!state) return;
  itemStreams.delete(key);
  state.closed = true;
  state.open = false;
  if (state.socket) state.socket.close();
}

// -- the live view -------------------------------------------------------------------------------------------------

// The per-run part of the live view, fresh for every run watched.
function freshRun(runId, planId) {
  return {
    runId: runId,
    planId: planId,
    cursor: null,
    status: "",
    outcomes: new Map(),
    rows: new Map(),
    card: null,
    retryMs: 500,
    stopped: false,
    events: 0,
  };
}

const live = Object.assign({ socket: null }, freshRun(null, null));

// The run the live view shows (null before the first one).
export function watchedRunId() {
  return live.runId;
}

// No run is watched, or the one watched has ended: a newly started run may take the view over.
export function liveIdle() {
  return !live.runId || TERMINAL.has(live.status);
}

export function watchRun(runId, planId) {
  if (!runId) return;
  if (live.runId === runId && live.socket) return;
  stopLive();
  Object.assign(live, freshRun(runId, planId || null));
  $("live").hidden = false;
  $("live-run").textContent = runId;
  $("live-plan").textContent = planId || "";
  $("live-status").textContent = "";
  $("live-count").textContent = "0";
  clear($("live-outcomes"));
  clear($("live-events"));
  clear($("live-graph"));
  $("watch-input").value = runId;
  if (planId) loadLiveCard(planId);
  connect();
}

function stopLive() {
  live.stopped = true;
  if (live.socket) {
    const s = live.socket;
    live.socket = null;
    s.close();
  }
}

function connect() {
  const runId = live.runId;
  const url = projectionsUrl(runId, live.cursor);
  let socket;
  try {
    socket = new WebSocket(url);
  } catch (err) {
    setConn("cannot open the stream: " + err.message, "error");
    return;
  }
  live.socket = socket;
  live.stopped = false;
  setConn("connecting\u2026", "wait");
  socket.onopen = () => {
    if (live.socket === socket) {
      live.retryMs = 500;
      setConn("live", "ok");
    }
  };
  socket.onmessage = (msg) => {
    if (live.socket !== socket) return;
    let ev;
    try {
      ev = JSON.parse(msg.data);
    } catch (err) {
      setConn("unreadable message from the stream", "error");
      return;
    }
    if (ev && ev.error) {
      live.stopped = true; // a refused watch does not heal by reconnecting
      const e = ev.error;
      setConn("refused: " + (typeof e === "object" ? e.message || json(e) : String(e)), "error");
      return;
    }
    if (ev && typeof ev.cursor === "string") live.cursor = ev.cursor;
    applyEvent(ev);
  };
  socket.onclose = (event) => {
    if (live.socket !== socket) return;
    live.socket = null;
    if (live.stopped || live.runId !== runId) return;
    if (event.code === 1008) {
      live.stopped = true; // a policy refusal (e.g. an unknown run) does not heal by reconnecting
      setConn("refused: " + (event.reason || "the server refused this stream"), "error");
      return;
    }
    setConn("disconnected \u2014 reconnecting from the last event\u2026", "wait");
    const wait = live.retryMs;
    live.retryMs = Math.min(live.retryMs * 2, 8000);
    setTimeout(() => {
      if (!live.stopped && live.runId === runId && !live.socket) connect();
    }, wait);
  };
}

function setConn(text, kind) {
  $("live-conn").textContent = text;
  $("live-conn").className = "conn " + kind;
}

async function loadLiveCard(planId) {
  try {
    const card = await cardOf(planId);
    if (live.planId !== planId) return;
    live.card = card;
    $("live-plan").textContent = planId;
    redrawLive();
  } catch (err) {
    flash("Could not load the plan card " + planId + ": " + err.message, "error");
  }
}

function redrawLive() {
  if (live.card) drawGraph($("live-graph"), live.card.nodes, live.card.edges, { outcomes: live.outcomes });
}

function applyEvent(ev) {
  const p = (ev && ev.payload) || {};
  live.events += 1;
  $("live-count").textContent = String(live.events);
  const li = el("li");
  li.dataset.seq = String(ev.sequence);
  li.appendChild(el("span", "at", clock(ev.occurred_at_ms)));
  li.appendChild(el("span", "kind", ev.kind));
  const detail = [];
  if (p.node_id) detail.push(p.node_id);
  if (p.outcome) detail.push(p.outcome);
  if (p.fact && p.fact.observation && p.fact.observation.status) detail.push(statusWord(p.fact.observation.status));
  if (p.approvalTarget && p.approvalTarget.requestId) detail.push("request " + p.approvalTarget.requestId);
  li.appendChild(el("span", "detail", detail.join(" \u00b7 ")));
  $("live-events").appendChild(li);

  if (ev.kind === "control.run.accepted" && p.planId && !live.planId) {
    live.planId = String(p.planId);
    loadLiveCard(live.planId);
  }
  if (p.fact && p.fact.observation && p.fact.observation.status) {
    live.status = statusWord(p.fact.observation.status);
    const s = $("live-status");
    s.textContent = live.status;
    s.className = "status s-" + live.status.replace(/[^a-z-]/g, "");
  }
  if (ev.kind === "node-scheduled" && p.node_id) setOutcome(p.node_id, "running", p.attempt, ev.occurred_at_ms);
  if (ev.kind === "control.approval.requested" && p.approvalTarget && live.card) {
    const gated = live.card.nodes.find((n) => n.approval && (n.approval.request || n.id) === p.approvalTarget.requestId);
    if (gated) setOutcome(gated.id, "waiting", null, ev.occurred_at_ms);
  }
  if (ev.kind === "node-settled" && p.node_id) setOutcome(p.node_id, String(p.outcome), p.attempts, ev.occurred_at_ms);
}

function setOutcome(nodeId, outcome, attempts, at) {
  live.outcomes.set(nodeId, outcome);
  let tr = live.rows.get(nodeId);
  if (!tr) {
    tr = el("tr");
    tr.dataset.node = nodeId;
    for (let i = 0; i < 4; i++) tr.appendChild(el("td"));
    tr.children[0].className = "mono";
    live.rows.set(nodeId, tr);
    $("live-outcomes").appendChild(tr);
  }
  tr.children[0].textContent = nodeId;
  tr.children[1].textContent = outcome;
  tr.children[1].className = "outcome o-" + outcome.replace(/[^a-z-]/g, "");
  tr.children[2].textContent = attempts === null || attempts === undefined ? "" : String(attempts);
  tr.children[3].textContent = clock(at);
  redrawLive();
}
