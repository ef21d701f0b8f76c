// Store-wide view for admin tokens: stats, the shard live-ratio histogram, compaction.

import { api } from "./api.js";
import { histogram } from "./chart.js";
import { clear, coalesced, fmtAgo, fmtBytes, fmtInt, fmtTime, h, notify } from "./dom.js";
import { ask } from "./dialog.js";

function card(id, label, value, note = "") {
  return h("div", { class: "card", id }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, value), note ? h("div", { class: "note muted" }, note) : null);
}

function pct(part, whole) {
  return whole ? `${((100 * part) / whole).toFixed(1)}%` : "—";
}

export function adminView(root, ctx) {
  if (ctx.me.role !== "admin") {
    root.append(h("h1", {}, "Store"), h("p", { class: "error", id: "not-admin" },
      "Store statistics and maintenance need an admin token."));
    root.dataset.ready = "1";
    return {};
  }
  const cards = h("div", { class: "cards stats", id: "stats" });
  const chart = h("div", { id: "chart" });
  const compaction = h("div", { id: "compaction" });
  const start = h("button", { id: "start-compaction", type: "button", class: "admin-action primary" }, "Start a compaction");
  root.append(h("h1", {}, "Store"), cards,
    h("div", { class: "columns" },
      h("section", {}, h("h2", {}, "Shards by live ratio"), chart),
      h("section", {}, h("h2", {}, "Compaction"), compaction, start)));

  const load = async () => {
    const [stats, comp] = await Promise.all([api("v1/admin/stats"), api("v1/admin/compaction")]);
    const s = stats.store_stats;
    clear(cards).append(
      card("stat-tenants", "Tenants", fmtInt(s.tenants)),
      card("stat-adapters", "Adapters", fmtInt(s.adapters)),
      card("stat-versions", "Versions", fmtInt(s.live_versions), `${fmtInt(s.versions)} published`),
      card("stat-bytes", "Bytes stored", fmtBytes(s.bytes_live), `${fmtInt(s.rows)} rows, ${fmtInt(s.layouts)} layouts`),
      card("stat-logical", "Bytes published", fmtBytes(s.bytes_logical), "live versions, before deduplication"),
      card("stat-dedup", "Dedup savings", fmtBytes(s.dedup_savings_bytes), `${pct(s.dedup_savings_bytes, s.bytes_logical)} of published`),
      card("stat-dead", "Reclaimable", fmtBytes(s.bytes_dead), "rows no live version uses"),
      card("stat-shards", "Shards", fmtInt(s.shards), `${fmtInt(s.retired_shards)} retired`),
      card("stat-index", "Index", fmtBytes(s.index_bytes), `last seq ${fmtInt(s.last_seq)}`),
      card("stat-uptime", "Service", stats.writable ? "writable" : "read-only", `up ${Math.round(stats.uptime_s)} s`));
    clear(chart).append(histogram(s.live_ratio_histogram));
    const last = (x) => (x ? `seq ${x.seq}, ${fmtTime(x.time)} (${fmtAgo(x.time)})` : "none recently");
    clear(compaction).append(h("dl", { class: "facts" },
      h("dt", {}, "Background"), h("dd", { id: "auto-compact" }, comp.auto_compact
        ? `on: every ${comp.interval_s} s, retired shards swept after ${comp.grace_s} s` : "off"),
      h("dt", {}, "Would move now"), h("dd", { id: "pending" },
        `${comp.pending_rows} row(s) from ${comp.pending_shards} shard(s) in ${comp.pending_steps} step(s), ${fmtBytes(comp.pending_live_bytes)} live`),
      h("dt", {}, "Awaiting sweep"), h("dd", {}, `${comp.retired_shards} retired shard(s)`),
      h("dt", {}, "Last compaction"), h("dd", { id: "last-compaction" }, last(comp.last_compaction)),
      h("dt", {}, "Last sweep"), h("dd", {}, last(comp.last_sweep))));
    start.disabled = !comp.writable;
    root.dataset.ready = "1";
  };
  start.addEventListener("click", async () => {
    const ok = await ask({ title: "Start a compaction", confirm: "Compact",
      text: "Rewrite the live rows of sparse and small shards into new shards now? Publishes and reads continue meanwhile." });
    if (!ok) return;
    start.disabled = true;
    try {
      const r = await api("v1/admin/compact", { method: "POST" });
      notify(`Compaction moved ${r.rows_moved} row(s) (${fmtBytes(r.bytes_moved)}), retired ${r.shards_retired.length} shard(s).`);
    } catch (e) {
      notify(`${e.code}: ${e.message}`, "error");
    }
    await load().catch((e) => ctx.fail(root, e));
  });
  const reload = coalesced(load, (e) => ctx.fail(root, e));
  reload();
  return { onEvent: reload }; // (an event during a load: one more load after it, never dropped)
}
