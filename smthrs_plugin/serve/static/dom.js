// Element helpers of the review page, and the short texts (times, clipped names) the other modules build from.
//
// Invariant: every value from the server is inserted as TEXT (textContent, createTextNode, SVG text nodes): plan
// ids, commands, paths and envelopes are attacker-controlled strings. Nothing on the page uses innerHTML with data;
// build elements with el/svgEl, never with markup.

const SVG_NS = "http://www.w3.org/2000/svg";

export const $ = (id) => document.getElementById(id);

export function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

export function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

export function clip(text, n) {
  const s = String(text);
  return s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
}

// Up to `lines` lines of at most `width` characters, broken at spaces where possible; the last one is clipped.
export function wrap(text, width, lines) {
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

export function json(value) {
  return JSON.stringify(value);
}

export function clock(ms) {
  if (typeof ms !== "number") return "";
  const d = new Date(ms);
  return d.toLocaleTimeString([], { hour12: false });
}

// A decision time a reviewer can place: the date and the time.
export function when(ms) {
  if (typeof ms !== "number") return "";
  const d = new Date(ms);
  return d.toLocaleDateString([], { year: "numeric", month: "2-digit", day: "2-digit" }) + " " + clock(ms);
}

export function flash(message, kind) {
  const box = $("flash");
  box.textContent = message;
  box.className = "flash " + (kind || "info");
  box.hidden = false;
}
