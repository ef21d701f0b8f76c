// The shard live-ratio histogram as plain SVG (no library).

import { svg } from "./dom.js";

/**
 * @param {Object<string, number>} hist  {"0.0-0.1": shards, ...} in order
 * @param {number} threshold  bins below this live ratio are what compaction rewrites
 */
export function histogram(hist, threshold = 0.5) {
  const bins = Object.entries(hist);
  const W = 640, H = 260, left = 44, right = 12, top = 24, bottom = 46;
  const plotW = W - left - right, plotH = H - top - bottom;
  const top0 = Math.max(1, ...bins.map(([, n]) => n));
  // a round step (1, 2 or 5 x 10^k) giving at most 5 gridlines
  const step0 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    .find((s) => top0 / s <= 5) ?? 10 ** Math.ceil(Math.log10(top0 / 5));
  const max = Math.ceil(top0 / step0) * step0;
  const step = plotW / Math.max(1, bins.length);
  const root = svg("svg", { id: "live-ratio-chart", viewBox: `0 0 ${W} ${H}`, role: "img",
                            "aria-labelledby": "live-ratio-title" },
    svg("title", { id: "live-ratio-title" }, "Shards by live ratio (live rows / rows)"));
  for (let v = 0; v <= max; v += step0) {
    const y = top + plotH - (plotH * v) / max;
    root.append(svg("line", { class: "grid", x1: left, x2: W - right, y1: y, y2: y }),
      svg("text", { class: "axis", x: left - 6, y: y + 4, "text-anchor": "end" }, String(v)));
  }
  bins.forEach(([label, n], i) => {
    const low = Number(label.split("-")[0]);
    const barH = (plotH * n) / max;
    const x = left + i * step + step * 0.12;
    const cls = low < threshold ? "bar sparse" : "bar dense";
    root.append(
      svg("rect", { class: cls, x, y: top + plotH - barH, width: step * 0.76, height: Math.max(barH, 0),
                    "data-bin": label, "data-count": n },
        svg("title", {}, `${label}: ${n} shard(s)`)),
      svg("text", { class: "count", x: x + step * 0.38, y: top + plotH - barH - 5, "text-anchor": "middle" },
        n ? String(n) : ""),
      svg("text", { class: "axis", x: x + step * 0.38, y: top + plotH + 16, "text-anchor": "middle" },
        `${Math.round(low * 100)}%`));
  });
  root.append(
    svg("line", { class: "axis-line", x1: left, x2: W - right, y1: top + plotH, y2: top + plotH }),
    svg("text", { class: "axis", x: left + plotW / 2, y: H - 8, "text-anchor": "middle" },
      "live ratio of the shard (bins of 10%); red: below the compaction threshold"));
  return root;
}
