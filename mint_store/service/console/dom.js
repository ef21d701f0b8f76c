// DOM helpers. Every string goes in as text (text nodes, textContent), never as markup:
// tenant and adapter names, tags and adapter configs are untrusted input.

const SVG_NS = "http://www.w3.org/2000/svg";

function setProps(el, props) {
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.setAttribute("class", value);
    else if (key === "text") el.textContent = String(value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "style" || key.startsWith("on") || key === "innerHTML") throw new Error(`refused prop ${key}`);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

/** h("a", {href: "#/x", class: "y"}, "text", otherNode) */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  setProps(el, props);
  return append(el, children);
}

export function svg(tag, props, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setProps(el, props);
  return append(el, children);
}

export function clear(el) {
  el.replaceChildren();
  return el;
}

export const NAME_RE = /^[a-z0-9][a-z0-9._-]{0,63}$/;

export function validName(s) {
  return typeof s === "string" && NAME_RE.test(s) && !s.includes("..");
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

export function fmtTime(ts) {
  if (ts === null || ts === undefined) return "—";
  const d = new Date(Number(ts) * 1000);
  const pad = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtAgo(ts) {
  if (ts === null || ts === undefined) return "";
  const s = Math.max(0, Date.now() / 1000 - Number(ts));
  if (s < 60) return `${Math.floor(s)} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86400)} d ago`;
}

export function fmtInt(n) {
  return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US");
}

/** A status line at the top: "ok" or "error". */
export function notify(text, kind = "ok") {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = kind;
  el.hidden = false;
}

export function link(parts, text, props = {}) {
  return h("a", { href: "#/" + parts.map((p) => encodeURIComponent(String(p))).join("/"), ...props }, text);
}

/** `load` run at most once at a time and never lost: called while it runs, it runs once more when
 * that run ends (however many calls came meanwhile), so the page always ends on the newest state
 * and an older load can never finish last. Errors go to `onError`. */
export function coalesced(load, onError) {
  let running = null;
  let again = false;
  return () => {
    if (running) {
      again = true;
      return running;
    }
    running = (async () => {
      try {
        do {
          again = false;
          await load();
        } while (again);
      } catch (e) {
        onError(e);
      } finally {
        running = null;
      }
    })();
    return running;
  };
}
