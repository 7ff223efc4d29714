// The review page of `smthrs serve`: pending plan cards and node requests, Approve / Deny with the session's
// approval token, and a live run view fed by the WebSocket projection stream.
//
// Invariants
// - Every value from the server is inserted as TEXT (textContent, createTextNode, SVG text nodes): plan ids,
//   commands, paths and envelopes are attacker-controlled strings. Nothing here uses innerHTML with data.
// - The token is sent only on decisions (approve / deny), only in the Authorization header, never in a URL, and
//   is kept in sessionStorage (this tab, until it closes). Reads never carry it.
// - A decision names what was reviewed: the card's (or request's) digest rides along, so a card that changed
//   between rendering and clicking is refused by the server instead of approved blind.
// - The live view resumes from the last cursor it received, so a reconnect neither skips nor repeats an event.
"use strict";

(function () {
  const TOKEN_KEY = "smthrs.approvalToken";
  const POLL_MS = 3000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const TERMINAL = new Set(["completed", "failed", "cancelled"]);

  const $ = (id) => document.getElementById(id);

  // -- DOM helpers (text only) -------------------------------------------------------------------------------------

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function clip(text, n) {
    const s = String(text);
    return s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
  }

  // Up to `lines` lines of at most `width` characters, broken at spaces where possible; the last one is clipped.
  function wrap(text, width, lines) {
    const out = [];
    let rest = String(text);
    while (rest.length > 0 && out.length < lines - 1) {
      if (rest.length <= width) break;
      let cut = rest.lastIndexOf(" ", width);
      if (cut < width / 2) cut = width;
      out.push(rest.slice(0, cut));
      rest = rest.slice(cut).replace(/^ /, "");
    }
    if (rest.length > 0) out.push(clip(rest, width));
    return out;
  }

  function json(value) {
    return JSON.stringify(value);
  }

  function clock(ms) {
    if (typeof ms !== "number") return "";
    const d = new Date(ms);
    return d.toLocaleTimeString([], { hour12: false });
  }

  function flash(message, kind) {
    const box = $("flash");
    box.textContent = message;
    box.className = "flash " + (kind || "info");
    box.hidden = false;
  }

  // -- token -------------------------------------------------------------------------------------------------------

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  function showTokenState() {
    const has = token() !== "";
    $("token-state").textContent = has ? "token set for this tab" : "no token: read-only";
    $("token-state").className = "token-state " + (has ? "ok" : "warn");
    $("token-forget").hidden = !has;
    for (const hint of document.querySelectorAll(".needs-token")) {
      hint.textContent = has ? "" : "Approve and Deny need the approval token (field at the top).";
    }
  }

  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const value = $("token-input").value.trim();
    $("token-input").value = "";
    if (value === "") {
      flash("Paste the token printed by `smthrs serve` (the line `smthrs serve: approval token: …`).", "warn");
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, value);
    showTokenState();
    flash("Token kept for this tab. Approve and Deny now act as the server's operator.", "info");
  });

  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showTokenState();
    flash("Token forgotten: the page is read-only again.", "info");
  });

  // -- JSON-RPC ----------------------------------------------------------------------------------------------------

  class RpcFailure extends Error {
    constructor(code, message) {
      super(message);
      this.code = code;
    }
  }

  let rpcSeq = 0;

  async function rpc(method, params, withToken) {
    const headers = { "Content-Type": "application/json" };
    if (withToken && token() !== "") headers.Authorization = "Bearer " + token();
    let resp;
    try {
      resp = await fetch("/rpc", {
        method: "POST",
        headers: headers,
        cache: "no-store",
        body: json({ jsonrpc: "2.0", id: ++rpcSeq, method: method, params: params || {} }),
      });
    } catch (err) {
      throw new RpcFailure("network", "The server did not answer (" + err.message + "). Is `smthrs serve` running?");
    }
    if (resp.status === 401) {
      throw new RpcFailure(
        "401",
        "Refused (401): deciding needs the approval token. Paste the token `smthrs serve` printed on its " +
          "stderr into the field at the top and try again. Nothing was decided.",
      );
    }
    if (resp.status === 403) {
      throw new RpcFailure(
        "403",
        "Refused (403): that is not this server session's approval token (a new one is printed each time " +
          "`smthrs serve` starts). Forget it and paste the current one. Nothing was decided.",
      );
    }
    let body;
    try {
      body = await resp.json();
    } catch (err) {
      throw new RpcFailure(String(resp.status), "The server answered HTTP " + resp.status + " without JSON.");
    }
    if (body && body.error) {
      const code = body.error.data && body.error.data.code ? body.error.data.code : String(body.error.code);
      throw new RpcFailure(code, String(body.error.message || "error") + " [" + code + "]");
    }
    if (!resp.ok) throw new RpcFailure(String(resp.status), "The server answered HTTP " + resp.status + ".");
    return body.result;
  }

  // -- the node graph (inline SVG) -----------------------------------------------------------------------------------

  function layers(nodes) {
    const byId = new Map(nodes.map((n) => [n.id, n]));
    const depth = new Map();
    function d(id, seen) {
      if (depth.has(id)) return depth.get(id);
      if (seen.has(id)) return 0; // a plan is acyclic; never loop on a malformed answer
      seen.add(id);
      const n = byId.get(id);
      let v = 0;
      for (const dep of (n && n.needs) || []) if (byId.has(dep)) v = Math.max(v, d(dep, seen) + 1);
      depth.set(id, v);
      return v;
    }
    const cols = [];
    for (const n of nodes) {
      const k = d(n.id, new Set());
      (cols[k] = cols[k] || []).push(n);
    }
    return cols;
  }

  function action(n) {
    if (n.run !== undefined) return "$ " + n.run;
    if (n.call !== undefined) return "call " + n.call + (n.with ? " " + json(n.with) : "");
    if (n.wait !== undefined) return "wait " + json(n.wait);
    return "(" + (n.kind || "node") + ")";
  }

  let svgSeq = 0;

  // opts: {focus: node id, changes: {added, changed}, outcomes: Map(node id -> outcome)}
  function drawGraph(container, nodes, edges, opts) {
    opts = opts || {};
    clear(container);
    const W = 250;
    const H = 118;
    const GX = 56;
    const GY = 18;
    const P = 12;
    const cols = layers(nodes);
    const pos = new Map();
    let rows = 0;
    cols.forEach((col, i) => {
      col.forEach((n, j) => pos.set(n.id, { x: P + i * (W + GX), y: P + j * (H + GY) }));
      rows = Math.max(rows, col.length);
    });
    const width = P * 2 + cols.length * W + Math.max(0, cols.length - 1) * GX;
    const height = P * 2 + rows * H + Math.max(0, rows - 1) * GY;
    const marker = "arrow-" + ++svgSeq;
    const svg = svgEl("svg", {
      width: width,
      height: height,
      viewBox: "0 0 " + width + " " + height,
      role: "img",
      class: "dag",
    });
    svg.appendChild(svgEl("title", {}, "node graph: " + nodes.length + " nodes"));
    const defs = svgEl("defs");
    const m = svgEl("marker", {
      id: marker,
      viewBox: "0 0 10 10",
      refX: 10,
      refY: 5,
      markerWidth: 7,
      markerHeight: 7,
      orient: "auto-start-reverse",
    });
    m.appendChild(svgEl("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrowhead" }));
    defs.appendChild(m);
    svg.appendChild(defs);

    for (const [from, to] of edges) {
      const a = pos.get(from);
      const b = pos.get(to);
      if (!a || !b) continue;
      const x1 = a.x + W;
      const y1 = a.y + H / 2;
      const x2 = b.x;
      const y2 = b.y + H / 2;
      const mid = (x1 + x2) / 2;
      svg.appendChild(
        svgEl("path", {
          d: "M " + x1 + " " + y1 + " C " + mid + " " + y1 + ", " + mid + " " + y2 + ", " + x2 + " " + y2,
          class: "edge",
          "marker-end": "url(#" + marker + ")",
        }),
      );
    }

    const changes = opts.changes || {};
    const added = new Set(changes.added || []);
    const changed = new Map((changes.changed || []).map((c) => [c.id, c.fields || []]));
    const outcomes = opts.outcomes || new Map();
    for (const n of nodes) {
      const p = pos.get(n.id);
      const classes = ["node", "tier-" + String(n.tier || "sealed")];
      if (n.approval) classes.push("gated");
      if (opts.focus === n.id) classes.push("focus");
      if (added.has(n.id)) classes.push("added");
      if (changed.has(n.id)) classes.push("changed");
      const outcome = outcomes.get(n.id);
      if (outcome) classes.push("o-" + outcome.replace(/[^a-z-]/g, ""));
      const g = svgEl("g", { class: classes.join(" "), transform: "translate(" + p.x + "," + p.y + ")" });
      g.setAttribute("data-node", n.id);
      const full = [
        n.id,
        action(n),
        "tier: " + n.tier,
        "reads: " + (n.reads || []).join(", "),
        "writes: " + (n.writes || []).join(", "),
      ];
      if ((n.removes || []).length) full.push("removes: " + n.removes.join(", "));
      if (n.approval) full.push("approval: " + json(n.approval));
      g.appendChild(svgEl("title", {}, full.join("\n")));
      g.appendChild(svgEl("rect", { width: W, height: H, rx: 8, ry: 8, class: "box" }));
      g.appendChild(svgEl("text", { x: 10, y: 19, class: "nid" }, clip(n.id, 22)));
      g.appendChild(svgEl("text", { x: W - 10, y: 19, class: "tier", "text-anchor": "end" }, n.tier));
      wrap(action(n), 36, 2).forEach((line, i) => g.appendChild(svgEl("text", { x: 10, y: 39 + i * 15, class: "cmd" }, line)));
      g.appendChild(svgEl("text", { x: 10, y: 73, class: "io" }, clip("reads  " + ((n.reads || []).join(", ") || "\u2014"), 38)));
      g.appendChild(svgEl("text", { x: 10, y: 89, class: "io" }, clip("writes " + ((n.writes || []).join(", ") || "\u2014"), 38)));
      let badge = "";
      if (outcome) badge = outcome;
      else if (n.approval) badge = "\u2691 approval: " + (n.approval.request || n.id);
      else if (added.has(n.id)) badge = "added since last approval";
      else if (changed.has(n.id)) badge = "changed: " + changed.get(n.id).join(", ");
      if (badge) g.appendChild(svgEl("text", { x: 10, y: 108, class: "badge" }, clip(badge, 38)));
      svg.appendChild(g);
    }
    const scroller = el("div", "graph-scroll");
    scroller.appendChild(svg);
    container.appendChild(scroller);
  }

  function nodeTable(tbody, nodes) {
    clear(tbody);
    for (const n of nodes) {
      const tr = el("tr");
      tr.appendChild(el("td", "mono", n.id));
      tr.appendChild(el("td", "mono", action(n)));
      tr.appendChild(el("td", "", n.tier));
      tr.appendChild(el("td", "mono", (n.reads || []).join("\n")));
      tr.appendChild(el("td", "mono", (n.writes || []).join("\n")));
      tr.appendChild(el("td", "mono", (n.removes || []).join("\n")));
      tr.appendChild(el("td", "mono", (n.needs || []).join(", ")));
      tr.appendChild(el("td", "mono", n.approval ? json(n.approval) : ""));
      tbody.appendChild(tr);
    }
  }

  function envelopeBlock(envelope) {
    const box = el("div", "envelope-body");
    box.appendChild(el("span", "label", "envelope"));
    const caps = (envelope && envelope.capabilities) || [];
    const capList = el("span", "caps");
    if (caps.length === 0) capList.appendChild(el("span", "muted", "no capabilities"));
    for (const c of caps) capList.appendChild(el("code", "cap", c));
    box.appendChild(capList);
    const rest = {};
    for (const [k, v] of Object.entries(envelope || {})) {
      if (k === "capabilities") continue;
      if ((Array.isArray(v) && v.length === 0) || (v && typeof v === "object" && Object.keys(v).length === 0)) continue;
      rest[k] = v;
    }
    if (Object.keys(rest).length) box.appendChild(el("code", "env-rest", json(rest)));
    return box;
  }

  function changesBlock(box, previous) {
    clear(box);
    if (!previous) {
      box.hidden = true;
      return;
    }
    box.hidden = false;
    const c = previous.changes || {};
    box.appendChild(el("div", "changes-title", "What changed since the last approved card "));
    box.firstChild.appendChild(el("code", "", clip(previous.digest || "", 16)));
    const list = el("ul");
    const item = (label, value) => {
      const li = el("li");
      li.appendChild(el("span", "label", label));
      li.appendChild(document.createTextNode(" " + value));
      list.appendChild(li);
    };
    if ((c.added || []).length) item("added", c.added.join(", "));
    if ((c.removed || []).length) item("removed", c.removed.join(", "));
    for (const ch of c.changed || []) item("changed", ch.id + " (" + (ch.fields || []).join(", ") + ")");
    if (c.envelope) item("envelope", "the envelope (capabilities / authority) changed");
    if (!list.firstChild) item("nothing", "no node or envelope difference (input or flow only)");
    box.appendChild(list);
  }

  // -- pending items -------------------------------------------------------------------------------------------------

  const cardCache = new Map(); // plan id -> review.card result (a card's content never changes)
  const rendered = new Map(); // item key -> article element

  async function cardOf(planId) {
    if (!cardCache.has(planId)) cardCache.set(planId, await rpc("review.card", { ident: planId }));
    return cardCache.get(planId);
  }

  function buildCard(kind, item, card) {
    const article = $("card-template").content.firstElementChild.cloneNode(true);
    article.classList.add(kind);
    const q = (sel) => article.querySelector(sel);
    if (kind === "plan") {
      article.dataset.planId = item.plan_id;
      q(".plan-id").textContent = item.plan_id;
    } else {
      article.dataset.runId = item.run_id;
      article.dataset.request = item.request;
      q(".ident").textContent = "";
      q(".ident").appendChild(el("span", "label", "run"));
      q(".ident").appendChild(el("code", "run-id", item.run_id));
      q(".ident").appendChild(el("span", "label", "request"));
      q(".ident").appendChild(el("code", "request-id", item.request));
      if (item.node) {
        q(".ident").appendChild(el("span", "label", "node"));
        q(".ident").appendChild(el("code", "node-id", item.node));
      }
      if (item.plan_id) {
        q(".ident").appendChild(el("span", "label", "plan"));
        q(".ident").appendChild(el("code", "plan-id", item.plan_id));
      }
      const watch = el("button", "quiet watch-run", "Watch run");
      watch.type = "button";
      watch.addEventListener("click", () => watchRun(item.run_id, item.plan_id));
      q(".actions").appendChild(watch);
    }
    q(".flow-id").textContent = (card && card.flow) || item.flow || "";
    q(".digest-value").textContent = item.digest;
    q(".digest-value").title = item.digest;
    q(".envelope").appendChild(envelopeBlock(item.envelope));
    if (card) {
      if (kind === "plan") changesBlock(q(".changes"), card.previous);
      drawGraph(q(".graph"), card.nodes, card.edges, {
        focus: kind === "request" ? item.node : null,
        changes: kind === "plan" && card.previous ? card.previous.changes : null,
      });
      nodeTable(q(".nodes tbody"), card.nodes);
      if (kind === "plan") q(".node-details").open = true; // what a plan approval pins: shown in full
    } else {
      q(".graph").appendChild(el("p", "muted", "This request comes from a flow's run, not a plan: no node graph."));
      q(".node-details").hidden = true;
    }
    q(".approve").addEventListener("click", () => decide("approve", kind, item, article));
    q(".deny").addEventListener("click", () => {
      // A denial is final (the plan never launches; the node fails): the first click only arms the button.
      const deny = q(".deny");
      if (deny.dataset.armed !== "1") {
        deny.dataset.armed = "1";
        deny.textContent = "Deny for good? Click again";
        return;
      }
      deny.dataset.armed = "";
      deny.textContent = "Deny";
      decide("deny", kind, item, article);
    });
    return article;
  }

  async function decide(verb, kind, item, article) {
    const result = article.querySelector(".result");
    const buttons = article.querySelectorAll(".actions button.approve, .actions button.deny");
    const params =
      kind === "plan"
        ? { ident: item.plan_id, digest: item.digest }
        : { ident: item.run_id, request: item.request, digest: item.digest };
    result.className = "result pending";
    result.textContent = verb === "approve" ? "approving\u2026" : "denying\u2026";
    buttons.forEach((b) => (b.disabled = true));
    try {
      const answer = await rpc(verb, params, true);
      const tag = answer && answer.receipt ? answer.receipt._tag || answer.receipt.type : "done";
      const what = kind === "plan" ? "plan " + item.plan_id : "request " + item.request + " of run " + item.run_id;
      const done = verb === "approve" ? "Approved " : "Denied ";
      result.className = "result ok";
      result.textContent = done + "(" + tag + ")";
      flash(done + what + " \u2014 receipt " + tag + ".", "ok");
      if (kind === "plan" && verb === "approve") expectRunOf(item);
      if (kind === "request") watchRun(item.run_id, item.plan_id);
      refresh();
    } catch (err) {
      result.className = "result error";
      result.textContent = err.message;
      flash(err.message, "error");
      buttons.forEach((b) => (b.disabled = false));
    }
  }

  function reconcile(containerId, countId, kind, items, keyOf) {
    const container = $(containerId);
    const keys = new Set();
    for (const item of items) {
      const key = kind + ":" + keyOf(item);
      keys.add(key);
      if (rendered.has(key)) continue;
      rendered.set(key, null); // reserved while the card loads
      const planId = item.plan_id;
      const load = planId ? cardOf(planId) : Promise.resolve(null);
      load
        .then((card) => {
          if (!rendered.has(key)) return; // decided meanwhile
          const article = buildCard(kind, item, card);
          rendered.set(key, article);
          container.appendChild(article);
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
      rendered.delete(key);
      if (article) article.remove();
    }
    $(countId).textContent = "(" + items.length + ")";
    empty(container, items.length === 0);
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

  // -- runs list and the live view -----------------------------------------------------------------------------------

  let expecting = null; // {flow, known: Set(run ids)} after a plan approval: watch the run its retry starts
  let knownRuns = new Set();

  function expectRunOf(item) {
    expecting = { flow: item.flow, planId: item.plan_id, known: new Set(knownRuns) };
  }

  function renderRuns(runs) {
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
        if (!live.runId || TERMINAL.has(live.status)) watchRun(fresh.run_id, planId);
      }
    }
    knownRuns = new Set((runs || []).map((r) => r.run_id));
  }

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

  function watchRun(runId, planId) {
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
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    let url = proto + "//" + location.host + "/projections?run_id=" + encodeURIComponent(runId);
    if (live.cursor) url += "&after_cursor=" + encodeURIComponent(live.cursor);
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
    li.appendChild(el("span", "at", clock(ev.occurred_at)));
    li.appendChild(el("span", "kind", ev.kind));
    const detail = [];
    if (p.node_id) detail.push(p.node_id);
    if (p.outcome) detail.push(p.outcome);
    if (p.fact && p.fact.observation && p.fact.observation.status) detail.push(p.fact.observation.status);
    if (p.approvalTarget && p.approvalTarget.requestId) detail.push("request " + p.approvalTarget.requestId);
    li.appendChild(el("span", "detail", detail.join(" \u00b7 ")));
    $("live-events").appendChild(li);

    if (ev.kind === "control.run.accepted" && p.planId && !live.planId) {
      live.planId = String(p.planId);
      loadLiveCard(live.planId);
    }
    if (p.fact && p.fact.observation && p.fact.observation.status) {
      live.status = String(p.fact.observation.status);
      const s = $("live-status");
      s.textContent = live.status;
      s.className = "status s-" + live.status.replace(/[^a-z-]/g, "");
    }
    if (ev.kind === "node-scheduled" && p.node_id) setOutcome(p.node_id, "running", p.attempt, ev.occurred_at);
    if (ev.kind === "control.approval.requested" && p.approvalTarget && live.card) {
      const gated = live.card.nodes.find((n) => n.approval && (n.approval.request || n.id) === p.approvalTarget.requestId);
      if (gated) setOutcome(gated.id, "waiting", null, ev.occurred_at);
    }
    if (ev.kind === "node-settled" && p.node_id) setOutcome(p.node_id, String(p.outcome), p.attempts, ev.occurred_at);
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

  $("watch-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const runId = $("watch-input").value.trim();
    if (runId) watchRun(runId, null);
  });

  // The catalog lists runs oldest first, a page at a time (keyset cursors). The first load pages to the end once;
  // later polls start from the cursor two pages before the end, so they read the newest runs (with their current
  // status) and any run created since, never the whole catalog again.
  const RECENT = 12;
  const RUNS_PAGE = 50;
  let runsAnchor = null;

  async function recentRuns() {
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
      if (!live.runId && (pending.requests || []).length) {
        const r = pending.requests[0];
        watchRun(r.run_id, r.plan_id);
      }
      renderRuns(await recentRuns());
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

  showTokenState();
  refresh();
  setInterval(refresh, POLL_MS);
})();
