// Confirmation dialogs (with an optional name input), built from text only.

import { h, validName } from "./dom.js";

/**
 * Ask before acting. Resolves with true (or the input's value) on confirm, null on cancel.
 * @param {{title: string, text: string, confirm?: string, input?: {label: string, value?: string}}} opts
 */
export function ask({ title, text, confirm = "Confirm", input = null, danger = false }) {
  return new Promise((resolve) => {
    const field = input ? h("input", { id: "ask-input", type: "text", spellcheck: "false", value: input.value || "" }) : null;
    const ok = h("button", { id: "ask-ok", type: "button", class: danger ? "danger" : "primary" }, confirm);
    const cancel = h("button", { id: "ask-cancel", type: "button" }, "Cancel");
    const dialog = h("dialog", { id: "ask", "aria-labelledby": "ask-title" },
      h("h2", { id: "ask-title" }, title),
      h("p", { id: "ask-text" }, text),
      input ? h("label", { for: "ask-input" }, input.label) : null,
      field,
      h("div", { class: "buttons" }, cancel, ok));
    let done = false;
    const finish = (value) => {
      if (done) return;
      done = true;
      dialog.close();
      dialog.remove();
      resolve(value);
    };
    const check = () => { ok.disabled = field !== null && !validName(field.value.trim()); };
    if (field) field.addEventListener("input", check);
    check();
    ok.addEventListener("click", () => finish(field ? field.value.trim() : true));
    cancel.addEventListener("click", () => finish(null));
    dialog.addEventListener("cancel", (e) => { e.preventDefault(); finish(null); });
    document.body.append(dialog);
    dialog.showModal();
    (field || cancel).focus();
  });
}
