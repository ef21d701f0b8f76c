// The tenant list and one tenant's adapters (filter and sort on the client).

import { api, enc } from "./api.js";
import { clear, coalesced, fmtAgo, fmtBytes, fmtTime, h, link } from "./dom.js";
import { touches } from "./feed.js";

const COUNTED = 100; // tenants whose adapter count the home page fetches

export function homeView(root, ctx) {
  const list = h("ul", { id: "tenants", class: "cards" });
  root.append(h("h1", {}, "Tenants"),
    h("p", { class: "muted" }, ctx.me.role === "admin"
      ? "Every tenant with adapters in the store." : "The tenants this token may read."),
    list);
  let refresh = false; // the first render uses the list fetched at sign-in
  const render = async () => {
    if (refresh) ctx.me = await api("v1/tenants"); // (a tenant's first publish makes it one)
    refresh = true;
    clear(list);
    const counting = [];
    ctx.me.tenants.forEach((tenant, i) => {
      const count = h("span", { class: "count muted" }, i < COUNTED ? "…" : "");
      list.append(h("li", { dataset: { tenant } }, link([tenant], tenant, { class: "tenant" }), count));
      if (i < COUNTED) {
        // the names alone (a catalog page reads every version of every adapter on it)
        counting.push(api(`v1/adapters/${enc(tenant)}?limit=1000`).then((page) => {
          const n = page.names.length;
          count.textContent = `${n}${page.next ? "+" : ""} adapter${n === 1 ? "" : "s"}`;
        }, (e) => { count.textContent = e.message; }));
      }
    });
    if (!ctx.me.tenants.length) list.append(h("li", { class: "muted" }, "No tenants yet."));
    root.dataset.ready = "1";
    await Promise.all(counting); // (a render's counts done before the next render asks again)
  };
  const reload = coalesced(render, (e) => ctx.fail(root, e));
  reload();
  return {
    onEvent(ev) { if (ev.kind === "publish" || ev.kind === "delete") reload(); },
  };
}

const COLUMNS = [
  ["name", "Name"], ["latest", "Latest"], ["tags", "Tags"], ["base", "Base"], ["rank", "Rank"],
  ["nbytes", "Size"], ["updated", "Last publish"],
];
const NUMERIC = new Set(["latest", "rank", "nbytes"]);
const MAX_ROWS = 20000;

function sortValue(row, key) {
  if (key === "tags") return Object.keys(row.tags).sort().join(",");
  return row[key];
}

function compare(a, b) {
  if (a === b) return 0;
  if (a === null || a === undefined) return 1;
  if (b === null || b === undefined) return -1;
  return a < b ? -1 : 1;
}

function tagChips(tenant, name, tags) {
  return Object.entries(tags).sort().map(([tag, v]) =>
    link([tenant, name, v], `${tag} → v${v}`, { class: "chip", title: `${tag} points at version ${v}` }));
}

export function tenantView(root, ctx, tenant) {
  let rows = [];
  let sort = { key: "name", dir: 1 };
  const filter = h("input", { id: "filter", type: "search", placeholder: "Filter by name, base or tag",
                              spellcheck: "false", "aria-label": "filter adapters" });
  const shown = h("span", { id: "shown", class: "muted" });
  const head = h("tr");
  const body = h("tbody");
  const table = h("table", { id: "adapters", class: "data" }, h("thead", {}, head), body);
  root.append(h("h1", {}, tenant), h("div", { class: "toolbar" }, filter, shown), table);

  const renderHead = () => {
    clear(head);
    for (const [key, label] of COLUMNS) {
      const mark = sort.key === key ? (sort.dir > 0 ? " ▲" : " ▼") : "";
      head.append(h("th", { class: NUMERIC.has(key) ? "num" : null, "aria-sort": sort.key === key ? (sort.dir > 0 ? "ascending" : "descending") : "none" },
        h("button", { type: "button", class: "sort", dataset: { key }, onclick: () => {
          sort = { key, dir: sort.key === key ? -sort.dir : 1 };
          renderHead();
          renderBody();
        } }, label + mark)));
    }
  };
  const renderBody = () => {
    const q = filter.value.trim().toLowerCase();
    const keep = rows.filter((r) => !q || r.name.includes(q) || (r.base || "").includes(q)
      || Object.keys(r.tags).some((t) => t.includes(q)));
    keep.sort((a, b) => sort.dir * compare(sortValue(a, sort.key), sortValue(b, sort.key))
      || compare(a.name, b.name));
    clear(body);
    for (const r of keep) {
      body.append(h("tr", { dataset: { name: r.name } },
        h("td", {}, link([tenant, r.name], r.name, { class: "name" })),
        h("td", { class: "num" }, r.latest === null ? "deleted" : `v${r.latest}`),
        h("td", {}, tagChips(tenant, r.name, r.tags)),
        h("td", {}, r.base ?? "—"),
        h("td", { class: "num" }, r.rank ?? "—"),
        h("td", { class: "num" }, fmtBytes(r.nbytes)),
        h("td", { title: fmtAgo(r.updated) }, fmtTime(r.updated))));
    }
    if (!keep.length) body.append(h("tr", {}, h("td", { colspan: COLUMNS.length, class: "muted" },
      rows.length ? "No adapter matches the filter." : "No adapters yet.")));
    shown.textContent = `${keep.length} of ${rows.length} adapter${rows.length === 1 ? "" : "s"}`;
  };
  const load = async () => {
    const got = [];
    let after = null;
    do {
      const page = await api(`v1/catalog/${enc(tenant)}?limit=1000${after ? `&after=${enc(after)}` : ""}`);
      got.push(...page.adapters);
      after = page.next;
    } while (after && got.length < MAX_ROWS);
    rows = got;
    renderBody();
    root.dataset.ready = "1";
  };
  filter.addEventListener("input", renderBody);
  renderHead();
  const reload = coalesced(load, (e) => ctx.fail(root, e));
  reload();
  return {
    onEvent(ev) { if (touches(ev, tenant)) reload(); },
  };
}
