// The live activity feed: long polls of /v1/events, newest first, no reload.

import { api } from "./api.js";
import { fmtTime, h, link } from "./dom.js";

const KEEP = 100;   // entries shown
const HISTORY = 50; // events shown from before the page opened

function describe(ev) {
  switch (ev.kind) {
    case "publish": {
      const one = (it) => [link([it.tenant, it.name, it.version], `${it.tenant}/${it.name}@${it.version}`),
        it.tag ? ` tagged ${it.tag}` : ""];
      if (ev.items.length === 1) return ["published ", one(ev.items[0])];
      // one group commit: several versions in one event
      return [`published ${ev.items.length} versions`, h("ul", { class: "items" }, ev.items.map((it) => h("li", {}, one(it))))];
    }
    case "tag":
      return ["tagged ", link([ev.tenant, ev.name, ev.version], `${ev.tenant}/${ev.name}@${ev.version}`), ` ${ev.tag}`];
    case "untag":
      return ["removed tag ", `${ev.tag} of `, link([ev.tenant, ev.name], `${ev.tenant}/${ev.name}`)];
    case "delete":
      return ["deleted ", link([ev.tenant, ev.name, ev.version], `${ev.tenant}/${ev.name}@${ev.version}`)];
    case "base":
      return [`registered base ${ev.base}`];
    case "compact":
      return [`compaction moved ${ev.content_ids.length} row(s), retired ${ev.retired.length} shard(s)`];
    case "sweep":
      return [`swept ${ev.shards.length} retired shard(s)`];
    case "quarantine":
      return [`quarantined ${ev.content_ids.length} row(s)`];
    default:
      return [String(ev.kind)];
  }
}

function entry(ev) {
  return h("li", { class: `event ${ev.kind}`, dataset: { seq: ev.seq, kind: ev.kind } },
    h("span", { class: "kind" }, ev.kind),
    h("span", { class: "what" }, describe(ev)),
    h("time", { class: "muted" }, fmtTime(ev.time)));
}

/** Follow the feed into `list`; `onEvent(ev)` for each event committed after the page opened.
 *  Returns a function that stops it. */
export function startFeed(list, stateEl, onEvent) {
  const ctrl = new AbortController();
  const show = (ev) => {
    list.prepend(entry(ev));
    while (list.children.length > KEEP) list.lastElementChild.remove();
  };
  (async () => {
    let backoff = 500;
    let after = null;
    let head = 0;
    while (!ctrl.signal.aborted) {
      try {
        if (after === null) {
          // events past `head` are news (they refresh the open page); the rest is history
          ({ head } = await api("v1/events?after=0&limit=0", { signal: ctrl.signal }));
          after = Math.max(0, head - HISTORY);
          list.dataset.head = String(head);
        }
        stateEl.textContent = "live";
        stateEl.className = "live";
        const batch = await api(`v1/events?after=${after}&wait=25&limit=200`, { signal: ctrl.signal });
        list.dataset.lastSeq = String(batch.last_seq);
        after = batch.last_seq;
        backoff = 500;
        for (const ev of batch.events) {
          show(ev);
          if (ev.seq > head) onEvent(ev);
        }
      } catch (e) {
        if (ctrl.signal.aborted) return;
        stateEl.textContent = `reconnecting (${e.message})`;
        stateEl.className = "muted";
        await new Promise((r) => setTimeout(r, backoff));
        backoff = Math.min(backoff * 2, 30000);
      }
    }
  })();
  return () => ctrl.abort();
}

/** Whether an event changes what a page about `tenant` (and `name`) shows. */
export function touches(ev, tenant, name = null) {
  if (ev.kind === "publish") return ev.items.some((it) => it.tenant === tenant && (name === null || it.name === name));
  if (["tag", "untag", "delete"].includes(ev.kind)) return ev.tenant === tenant && (name === null || ev.name === name);
  return false;
}
