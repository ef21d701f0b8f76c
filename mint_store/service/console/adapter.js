// One adapter: its tags, versions, and one version's config, tensor layout and PEFT download.

import { api, enc } from "./api.js";
import { clear, coalesced, fmtBytes, fmtTime, h, link, notify } from "./dom.js";
import { ask } from "./dialog.js";
import { touches } from "./feed.js";

function path(tenant, name, rest = "") {
  return `v1/adapters/${enc(tenant)}/${enc(name)}${rest}`;
}

/** The live version a tag rolls back to: the newest live version below the one it points at. */
export function previousLive(versions, current) {
  const older = versions.filter((v) => !v.deleted && v.version < current).map((v) => v.version);
  return older.length ? Math.max(...older) : null;
}

async function download(tenant, name, version) {
  const resp = await api(path(tenant, name, `/versions/${version}/peft`), { raw: true });
  const url = URL.createObjectURL(await resp.blob());
  const a = h("a", { href: url, download: `${tenant}-${name}-v${version}.tar` });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
}

export function adapterView(root, ctx, tenant, name, wanted) {
  const admin = ctx.me.role === "admin";
  const title = h("h1", {}, link([tenant], tenant, { class: "up" }), " / ", name);
  const summary = h("p", { id: "summary", class: "muted" });
  const tagsBody = h("tbody");
  const versionsBody = h("tbody");
  const detail = h("section", { id: "version-detail" });
  root.append(title, summary,
    h("h2", {}, "Tags"),
    h("table", { id: "tags", class: "data narrow" },
      h("thead", {}, h("tr", {}, h("th", {}, "Tag"), h("th", {}, "Version"), admin ? h("th", {}, "") : null)),
      tagsBody),
    h("h2", {}, "Versions"),
    h("table", { id: "versions", class: "data" },
      h("thead", {}, h("tr", {}, ["Version", "Content id", "Size", "Created", "Deduplicated", "Deleted", "Tags"]
        .map((c) => h("th", {}, c)), admin ? h("th", {}, "") : null)),
      versionsBody),
    detail);

  let versions = [];
  let selected = wanted;

  const act = async (question, request, done) => {
    const answer = await ask(question);
    if (answer === null) return;
    try {
      await request(answer);
      notify(done(answer));
    } catch (e) {
      notify(`${e.code}: ${e.message}`, "error");
    }
    await load();
  };
  const moveTag = (v) => act(
    { title: `Tag ${tenant}/${name}@${v}`, text: `Move a tag to version ${v}; engines following the tag switch to it.`,
      input: { label: "Tag", value: "prod" }, confirm: "Move tag" },
    (tag) => api(path(tenant, name, `/tags/${enc(tag)}`), { method: "PUT", body: { version: v } }),
    (tag) => `Tag ${tag} now points at version ${v}.`);
  const rollBack = (tag, from, to) => act(
    { title: `Roll back ${tag}`, text: `Move tag ${tag} of ${tenant}/${name} from version ${from} back to version ${to}?`,
      confirm: "Roll back" },
    () => api(path(tenant, name, `/tags/${enc(tag)}`), { method: "PUT", body: { version: to } }),
    () => `Tag ${tag} rolled back to version ${to}.`);
  const remove = (v) => act(
    { title: `Delete ${tenant}/${name}@${v}`, danger: true, confirm: "Delete version",
      text: `Delete version ${v}? Tags pointing at it are removed; its bytes are reclaimed by compaction once no version uses them.` },
    () => api(path(tenant, name, `/versions/${v}`), { method: "DELETE" }),
    () => `Version ${v} deleted.`);

  const renderTags = () => {
    clear(tagsBody);
    const tags = versions.flatMap((v) => v.tags.map((t) => [t, v.version])).sort();
    for (const [tag, v] of tags) {
      const back = previousLive(versions, v);
      tagsBody.append(h("tr", { dataset: { tag, version: v } },
        h("td", {}, h("span", { class: "chip" }, tag)),
        h("td", { class: "num" }, link([tenant, name, v], `v${v}`)),
        admin ? h("td", {}, h("button", {
          type: "button", class: "admin-action rollback", dataset: { tag }, disabled: back === null,
          title: back === null ? "no earlier live version" : `move ${tag} to version ${back}`,
          onclick: () => rollBack(tag, v, back),
        }, back === null ? "Roll back" : `Roll back to v${back}`)) : null));
    }
    if (!tags.length) tagsBody.append(h("tr", {}, h("td", { colspan: 3, class: "muted" }, "No tags.")));
  };

  const renderVersions = () => {
    clear(versionsBody);
    for (const v of [...versions].reverse()) {
      versionsBody.append(h("tr", { dataset: { version: v.version }, class: [
        v.version === selected ? "selected" : "", v.deleted ? "deleted" : ""].join(" ").trim() || null },
        h("td", { class: "num" }, link([tenant, name, v.version], `v${v.version}`, { class: "version" })),
        h("td", { class: "mono", title: v.content_id }, v.content_id.slice(0, 12) + "…"),
        h("td", { class: "num" }, fmtBytes(v.nbytes)),
        h("td", {}, fmtTime(v.created)),
        h("td", {}, v.deduplicated ? "yes" : "no"),
        h("td", {}, v.deleted ? "deleted" : ""),
        h("td", {}, v.tags.map((t) => h("span", { class: "chip" }, t))),
        admin ? h("td", { class: "actions" },
          h("button", { type: "button", class: "admin-action set-tag", disabled: v.deleted, onclick: () => moveTag(v.version) }, "Tag…"),
          h("button", { type: "button", class: "admin-action delete danger", disabled: v.deleted, onclick: () => remove(v.version) }, "Delete"))
          : null));
    }
  };

  const renderDetail = async () => {
    const v = versions.find((x) => x.version === selected);
    clear(detail);
    if (!v) {
      detail.append(h("p", { class: "error" }, `No version ${selected} of ${tenant}/${name}.`));
      return;
    }
    const [info, layout] = await Promise.all([
      api(path(tenant, name, `/versions/${v.version}`)),
      api(`v1/layouts/${enc(v.layout_id)}`),
    ]);
    if (selected !== v.version) return; // another version was chosen meanwhile
    const dl = h("button", { id: "download", type: "button", class: "primary", disabled: v.deleted,
                             onclick: () => download(tenant, name, v.version).catch((e) => notify(e.message, "error")) },
      "Download PEFT files (.tar)");
    clear(detail).append(
      h("h2", {}, `Version ${v.version}`, v.deleted ? " (deleted)" : ""),
      h("dl", { class: "facts" },
        h("dt", {}, "Content id"), h("dd", { class: "mono", id: "content-id" }, info.content_id),
        h("dt", {}, "Layout id"), h("dd", { class: "mono" }, info.layout_id),
        h("dt", {}, "Base"), h("dd", {}, info.base),
        h("dt", {}, "Size"), h("dd", {}, `${fmtBytes(info.nbytes)} (${info.nbytes.toLocaleString("en-US")} bytes)`),
        h("dt", {}, "Created"), h("dd", {}, fmtTime(info.created))),
      dl,
      h("div", { class: "columns" },
        h("div", {}, h("h3", {}, "Adapter config"),
          h("pre", { id: "config" }, info.peft_config === null ? "(none stored)" : JSON.stringify(info.peft_config, null, 2))),
        h("div", {}, h("h3", {}, `Tensor layout (${layout.tensors.length} tensors, ${fmtBytes(layout.row_nbytes)} a row)`),
          h("table", { id: "layout", class: "data compact" },
            h("thead", {}, h("tr", {}, ["Tensor", "Shape", "Dtype", "Offset"].map((c) => h("th", {}, c)))),
            h("tbody", {}, layout.tensors.map(([tname, shape, dtype, offset]) => h("tr", {},
              h("td", { class: "mono" }, tname), h("td", { class: "mono" }, `[${shape.join(", ")}]`),
              h("td", {}, dtype), h("td", { class: "num" }, offset.toLocaleString("en-US")))))))));
  };

  const load = async () => {
    const all = [];
    for (let after = 0; after !== null;) { // the service answers a page of versions at a time
      const got = await api(path(tenant, name, `/versions?after=${after}`));
      all.push(...got.versions);
      after = got.next !== null && got.versions.length && got.next > after ? got.next : null;
    }
    versions = all;
    const live = versions.filter((v) => !v.deleted);
    if (selected === null) selected = (live.length ? live : versions).at(-1).version;
    const latest = live.at(-1);
    summary.textContent = latest
      ? `latest v${latest.version} · ${live.length} live of ${versions.length} versions · base ${latest.base}`
      : `every version deleted (${versions.length})`;
    renderTags();
    renderVersions();
    await renderDetail();
    root.dataset.ready = "1";
  };
  const reload = coalesced(load, (e) => ctx.fail(root, e));
  reload();
  return {
    onEvent(ev) { if (touches(ev, tenant, name)) reload(); },
  };
}
