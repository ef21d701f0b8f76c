// The console: sign-in, hash routes, the activity feed. Every datum comes from the JSON API.
//   #/                      tenants
//   #/{tenant}              a tenant's adapters
//   #/{tenant}/{name}[/{v}] one adapter (and one of its versions)
//   #/-/admin               store stats and compaction (admin tokens)

import { api, session } from "./api.js";
import { adapterView } from "./adapter.js";
import { adminView } from "./admin.js";
import { clear, h, link, validName } from "./dom.js";
import { startFeed } from "./feed.js";
import { homeView, tenantView } from "./tenants.js";

const $ = (id) => document.getElementById(id);
const ctx = { me: null, fail };
let current = null;
let stopFeed = null;

function fail(root, e) {
  const msg = e && e.status === 403
    ? `This token may not read this: ${e.message}`
    : `${e && e.code ? e.code + ": " : ""}${e && e.message ? e.message : e}`;
  root.append(h("p", { class: "error", role: "alert", dataset: { code: e && e.code ? e.code : "error" } }, msg));
  root.dataset.ready = "1";
  if (e && e.status === 401) signOut("Your token was refused; sign in again.");
}

function parse(hash) {
  let parts;
  try {
    parts = hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  } catch {
    return { view: "bad" };
  }
  if (!parts.length) return { view: "home" };
  if (parts[0] === "-") return parts[1] === "admin" && parts.length === 2 ? { view: "admin" } : { view: "bad" };
  const [tenant, name, version] = parts;
  if (parts.length > 3 || !validName(tenant) || (name !== undefined && !validName(name))
      || (version !== undefined && !/^[1-9][0-9]{0,15}$/.test(version))) return { view: "bad" };
  if (name === undefined) return { view: "tenant", tenant };
  return { view: "adapter", tenant, name, version: version === undefined ? null : Number(version) };
}

function crumbs(r) {
  const nav = clear($("crumbs"));
  if (r.view === "admin") nav.append(h("span", {}, "store"));
  if (r.tenant) nav.append(link([r.tenant], r.tenant));
  if (r.name) nav.append(" / ", link([r.tenant, r.name], r.name));
  if (r.version) nav.append(` @ v${r.version}`);
}

function route() {
  if (!ctx.me) return;
  const r = parse(location.hash);
  crumbs(r);
  const root = h("div", { class: "view", dataset: { view: r.view } });
  clear($("view")).append(root);
  if (r.view === "home") current = homeView(root, ctx);
  else if (r.view === "tenant") current = tenantView(root, ctx, r.tenant);
  else if (r.view === "adapter") current = adapterView(root, ctx, r.tenant, r.name, r.version);
  else if (r.view === "admin") current = adminView(root, ctx);
  else {
    root.append(h("h1", {}, "Not found"), h("p", { class: "error" }, "No such page. "), link([], "Back to the tenants"));
    root.dataset.ready = "1";
    current = {};
  }
  document.title = ["MinT Store", r.tenant, r.name].filter(Boolean).join(" · ");
}

function onEvent(ev) {
  if (current && current.onEvent) current.onEvent(ev);
}

function showSignIn(message) {
  $("signin").hidden = false;
  $("view").hidden = true;
  $("activity").hidden = true;
  const err = $("signin-error");
  err.hidden = !message;
  err.textContent = message || "";
  $("token").focus();
}

function signOut(message) {
  session.clear();
  ctx.me = null;
  if (stopFeed) stopFeed();
  stopFeed = null;
  clear($("view"));
  clear($("feed"));
  $("who").textContent = "";
  $("signout").hidden = true;
  $("admin-link").hidden = true;
  showSignIn(message);
}

// A header carries Latin-1 only: a token pasted with typographic quotes (or any character past
// U+00FF) cannot be sent, and fetch throws before any request is made.
const headerSafe = (token) => /^[\x20-\x7e\xa0-\xff]+$/.test(token);
const UNSENDABLE = "That token holds characters a request header cannot carry (typographic quotes, say): " +
  "paste it as plain text.";

async function boot() {
  if (session.token !== null && !headerSafe(session.token)) { // (stored by an earlier build)
    session.clear();
    showSignIn(UNSENDABLE);
    return;
  }
  try {
    ctx.me = await api("v1/tenants");
  } catch (e) {
    if (e.status === 401) {
      const had = session.token !== null;
      session.clear();
      showSignIn(had ? `Sign-in failed: ${e.message}` : "");
      return;
    }
    const message = `The service did not answer: ${e.message}`;
    if (!$("signin").hidden) { // signing in: say it there, where the user is looking
      showSignIn(message);
      return;
    }
    $("view").hidden = false;
    clear($("view")).append(h("p", { class: "error", role: "alert" }, message));
    return;
  }
  $("signin").hidden = true;
  $("view").hidden = false;
  $("activity").hidden = false;
  $("who").textContent = `${ctx.me.principal} · ${ctx.me.role}`;
  $("signout").hidden = !ctx.me.auth;
  $("admin-link").hidden = ctx.me.role !== "admin";
  document.body.dataset.role = ctx.me.role;
  stopFeed = startFeed($("feed"), $("feed-state"), onEvent);
  route();
}

$("signin-form").addEventListener("submit", (e) => {
  e.preventDefault(); // never submitted: the token must not end up in a URL
  const token = $("token").value.trim();
  $("token").value = "";
  if (!token) return;
  if (!headerSafe(token)) {
    showSignIn(UNSENDABLE);
    return;
  }
  session.set(token);
  boot();
});
$("signout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", () => { $("status").hidden = true; route(); });
boot();
