// A pending item as the reviewer sees it: the card (plan or node request) with its envelope, the node graph and
// declarations, the approval gates, and what changed since the last approved card.
//
// Everything here is built with dom.js's text-only helpers: names, commands and envelopes are shown, never parsed
// as markup. The card does not decide or navigate itself: buildCard's `on` hooks do (pending.js, live.js).

import { $, clear, clip, el, json, svgEl, when, wrap } from "./dom.js";

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
export function drawGraph(container, nodes, edges, opts) {
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
  const changed = new Map((changes.changed || []).map((c) => [c.id, c]));
  const outcomes = opts.outcomes || new Map();
  for (const n of nodes) {
    const p = pos.get(n.id);
    const classes = ["node", "tier-" + String(n.tier || "sealed")];
    if (n.approval) classes.push("gated");
    if (opts.focus === n.id) classes.push("focus");
    if (added.has(n.id)) classes.push("added");
    const change = changed.get(n.id);
    if (change) classes.push(change.cause === "upstream" ? "rekeyed" : "changed");
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
    if (n.approval) full.push("approval: " + gateText(n.approval));
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
    else if (change && change.cause === "upstream") badge = "re-keyed: " + (change.because || []).join(", ") + " changed";
    else if (change && change.cause === "unexplained") badge = "key changed";
    else if (change) badge = "changed: " + (change.fields || []).join(", ");
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
    tr.appendChild(el("td", "gate", gateText(n.approval)));
    tbody.appendChild(tr);
  }
}

// -- readable text for envelopes, gates and declaration values ----------------------------------------------------

// An envelope as lines of text: the authority a grant carries (never raw JSON for the known members).
function envelopeLines(envelope) {
  const env = envelope || {};
  const lines = [];
  const caps = env.capabilities || [];
  lines.push("capabilities: " + (caps.length ? caps.join(", ") : "none"));
  if ((env.flows || []).length) lines.push("may start flows: " + env.flows.join(", "));
  const budget = env.budget || {};
  const spend = Object.entries(budget).map(([k, v]) => k + " " + (typeof v === "object" ? json(v) : String(v)));
  if (spend.length) lines.push("budget: " + spend.join(", "));
  if (env.placement !== undefined && env.placement !== null) {
    lines.push("placement: " + (typeof env.placement === "object" ? json(env.placement) : String(env.placement)));
  }
  for (const [k, v] of Object.entries(env)) {
    if (!["capabilities", "flows", "budget", "placement"].includes(k)) lines.push(k + ": " + json(v));
  }
  return lines;
}

// A node's approval gate: which request it asks, and the authority a yes grants.
function gateText(approval) {
  if (!approval) return "";
  const parts = ["asks approval \u201c" + String(approval.request || "") + "\u201d"];
  if (approval.envelope) parts.push("grants " + envelopeLines(approval.envelope).join("; "));
  for (const [k, v] of Object.entries(approval)) {
    if (k !== "request" && k !== "envelope") parts.push(k + ": " + (typeof v === "object" ? json(v) : String(v)));
  }
  return parts.join(" \u2014 ");
}

// One declaration value as a reviewer reads it.
function valueText(field, v) {
  if (v === undefined) return "\u2014 (not declared)";
  if (v === null) return "null";
  if (field === "approval") return gateText(v);
  if (Array.isArray(v)) {
    if (v.length === 0) return "(none)";
    return v.map((x) => (typeof x === "object" ? json(x) : String(x))).join(", ");
  }
  if (typeof v === "object") return json(v);
  return String(v);
}

function envelopeBlock(envelope, approvers) {
  const box = el("div", "envelope-body");
  box.appendChild(el("span", "label", "envelope"));
  const caps = (envelope && envelope.capabilities) || [];
  const capList = el("span", "caps");
  if (caps.length === 0) capList.appendChild(el("span", "muted", "no capabilities"));
  for (const c of caps) capList.appendChild(el("code", "cap", c));
  box.appendChild(capList);
  const rest = envelopeLines(envelope).slice(1);
  if (rest.length) box.appendChild(el("span", "env-rest", rest.join(" \u00b7 ")));
  if (approvers !== undefined) {
    const who = el("div", "approvers");
    who.appendChild(el("span", "label", "who may decide"));
    who.appendChild(
      el(
        "span",
        "approvers-text",
        approvers === null ? "the installed approval authority decides per request" : approvers.join("; ") || "nobody",
      ),
    );
    box.appendChild(who);
  }
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
  const title = el("div", "changes-title", "What changed since the last approved card ");
  title.appendChild(el("code", "", clip(previous.digest || "", 16)));
  const a = previous.approval;
  if (a && a.principal) title.appendChild(el("span", "muted", " (approved by " + a.principal + " " + when(a.decided_at_ms) + ")"));
  box.appendChild(title);
  const list = el("ul");
  const item = (label, text) => {
    const li = el("li");
    li.appendChild(el("span", "label", label));
    if (text !== undefined) li.appendChild(document.createTextNode(" " + text));
    list.appendChild(li);
    return li;
  };
  if ((c.added || []).length) item("added", c.added.join(", "));
  if ((c.removed || []).length) item("removed", c.removed.join(", "));
  for (const ch of c.changed || []) {
    const li = item(ch.cause === "declaration" ? "changed" : "re-keyed");
    li.dataset.node = ch.id;
    li.classList.add("change", "cause-" + String(ch.cause).replace(/[^a-z-]/g, ""));
    li.appendChild(el("code", "node-name", ch.id));
    if (ch.cause === "upstream") {
      li.appendChild(document.createTextNode(" re-keyed because " + (ch.because || []).join(", ") + " changed"));
    } else if (ch.cause === "unexplained") {
      li.appendChild(document.createTextNode(" key changed, and no declaration shown here explains it:"));
    }
    const rows = el("dl", "diff");
    for (const f of ch.fields || []) {
      const v = (ch.values || {})[f] || {};
      rows.appendChild(el("dt", "", f));
      const dd = el("dd");
      dd.appendChild(el("del", "old", valueText(f, v.old)));
      dd.appendChild(el("span", "arrow", " \u2192 "));
      dd.appendChild(el("ins", "new", valueText(f, v.new)));
      rows.appendChild(dd);
    }
    if (ch.cause === "unexplained" && ch.key) {
      rows.appendChild(el("dt", "", "key"));
      const dd = el("dd");
      dd.appendChild(el("del", "old", ch.key.old));
      dd.appendChild(el("span", "arrow", " \u2192 "));
      dd.appendChild(el("ins", "new", ch.key.new));
      rows.appendChild(dd);
    }
    if (rows.firstChild) li.appendChild(rows);
    if (ch.cause === "declaration" && (ch.because || []).length) {
      li.appendChild(el("div", "muted", "(its upstream " + ch.because.join(", ") + " changed too)"));
    }
  }
  if (c.envelope) {
    const li = item("envelope");
    li.classList.add("change");
    const rows = el("dl", "diff");
    rows.appendChild(el("dt", "", "authority"));
    const dd = el("dd");
    dd.appendChild(el("del", "old", envelopeLines(c.envelope.old).join("; ")));
    dd.appendChild(el("span", "arrow", " \u2192 "));
    dd.appendChild(el("ins", "new", envelopeLines(c.envelope.new).join("; ")));
    rows.appendChild(dd);
    li.appendChild(rows);
  }
  if (!list.firstChild) item("nothing", "no node or envelope difference (input or flow only)");
  box.appendChild(list);
}

// -- the card ------------------------------------------------------------------------------------------------------

// `on`: {decide(verb, kind, item, article), watchRun(runId, planId)} — what the card's buttons do.
export function buildCard(kind, item, card, on) {
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
    watch.addEventListener("click", () => on.watchRun(item.run_id, item.plan_id));
    q(".actions").appendChild(watch);
  }
  q(".flow-id").textContent = (card && card.flow) || item.flow || "";
  const pinned = kind === "plan" ? item.digest : item.key; // what the decision pins
  q(".digest-value").textContent = pinned;
  q(".digest-value").title = pinned;
  const approvers =
    kind === "plan" ? (card && card.approvers ? card.approvers.plan : undefined) : item.approvers;
  q(".envelope").appendChild(envelopeBlock(item.envelope, approvers));
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
  q(".approve").addEventListener("click", () => on.decide("approve", kind, item, article));
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
    on.decide("deny", kind, item, article);
  });
  return article;
}
