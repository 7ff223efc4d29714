// The server as the page talks to it: JSON-RPC over `POST /rpc`, the session's approval token, the words of the
// CLI's JSON vocabulary, and the plan cards read so far.
//
// Invariants
// - The token is sent only on decisions (approve / deny), only in the Authorization header, never in a URL, and
//   is kept in sessionStorage (this tab, until it closes). Reads never carry it.
// - The server answers in the CLI's JSON vocabulary (run status `parked`, times `*_at_ms`, a node key as `key`).
//   Journal payloads keep their stored words; the page shows a status in the vocabulary's word wherever it
//   comes from (statusWord).

import { $, json } from "./dom.js";

const TOKEN_KEY = "smthrs.approvalToken";

export const TERMINAL = new Set(["completed", "failed", "cancelled"]);
// A run status as a journal payload stores it -> the word every answer uses (docs/rules.md "JSON vocabulary").
const STATUS_WORDS = { suspended: "parked" };

export function statusWord(status) {
  const s = String(status);
  return Object.prototype.hasOwnProperty.call(STATUS_WORDS, s) ? STATUS_WORDS[s] : s;
}

// -- token ---------------------------------------------------------------------------------------------------------

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function keepToken(value) {
  sessionStorage.setItem(TOKEN_KEY, value);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

export function showTokenState() {
  const has = token() !== "";
  $("token-state").textContent = has ? "token set for this tab" : "no token: read-only";
  $("token-state").className = "token-state " + (has ? "ok" : "warn");
  $("token-forget").hidden = !has;
  for (const hint of document.querySelectorAll(".needs-token")) {
    hint.textContent = has ? "" : "Approve and Deny need the approval token (field at the top).";
  }
}

// -- JSON-RPC ------------------------------------------------------------------------------------------------------

class RpcFailure extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

let rpcSeq = 0;

export async function rpc(method, params, withToken) {
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

// -- plan cards ----------------------------------------------------------------------------------------------------

const cardCache = new Map(); // plan id -> review.card result (a card's content never changes)

export async function cardOf(planId) {
  if (!cardCache.has(planId)) cardCache.set(planId, await rpc("review.card", { ident: planId }));
  return cardCache.get(planId);
}
