// The chat page: conversation state, the controls, and one streaming request at a time.
import { fetchModel, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const KEY_STORAGE = "aiolm.apiKey"; // sessionStorage only: the key leaves with the tab
const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), messages: $("messages"), empty: $("empty"), error: $("error"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), composer: $("composer"), newChat: $("new-chat"),
  system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"), topP: $("top-p"),
  keyForm: $("key-form"), apiKey: $("api-key"), keyHint: $("key-hint"),
  attach: $("attach"), attachButton: $("attach-button"), attachments: $("attachments"),
};
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  model: null,
  history: [], // {role, content} turns sent back with every request
  controller: null, // the AbortController of the request in flight
  attached: [], // data: URLs of the images for the next message
  reading: Promise.resolve(), // the files still being read: send waits for them
};

// The controls a refused request can name in its error's "param".
const PARAM_INPUTS = { temperature: ui.temperature, max_tokens: ui.maxTokens, top_p: ui.topP };

function showError(message, param = null) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
  for (const [name, input] of Object.entries(PARAM_INPUTS)) {
    if (name === param) input.setAttribute("aria-invalid", "true");
    else input.removeAttribute("aria-invalid");
  }
}

function thumbnail(url) {
  return Object.assign(document.createElement("img"), { src: url, alt: "attached image", className: "thumb" });
}

function addMessage(role, text, images = []) {
  ui.empty.hidden = true;
  const el = document.createElement("article");
  el.className = `msg ${role}`;
  el.dataset.role = role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : state.model?.id ?? "assistant";
  const body = document.createElement("div");
  body.className = "body";
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(who, body, meta);
  if (role === "assistant") { // a reasoning model's thinking, shown folded above the answer
    const thoughts = document.createElement("details");
    thoughts.className = "reasoning";
    thoughts.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Thinking…";
    const text = document.createElement("div");
    text.className = "thoughts";
    thoughts.append(summary, text);
    body.before(thoughts);
  }
  if (role === "user") {
    if (images.length) {
      const gallery = document.createElement("div");
      gallery.className = "images";
      gallery.append(...images.map(thumbnail));
      body.append(gallery);
    }
    body.append(text);
  }
  ui.messages.append(el);
  scrollDown(true);
  return el;
}

function renderAnswer(el, text) {
  const body = el.querySelector(".body");
  body.innerHTML = renderMarkdown(text); // safe: the renderer escapes everything it does not build
  for (const pre of body.querySelectorAll("pre")) {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    pre.append(copy);
  }
}

function renderReasoning(el, text, done) {
  const thoughts = el.querySelector(".reasoning");
  if (!text) return;
  thoughts.hidden = false;
  thoughts.querySelector(".thoughts").textContent = text;
  thoughts.querySelector("summary").textContent = done ? "Thought" : "Thinking…";
}

function scrollDown(force = false) {
  const m = ui.messages;
  if (force || m.scrollHeight - m.scrollTop - m.clientHeight < 80) m.scrollTop = m.scrollHeight;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = Object.assign(document.createElement("textarea"), { value: text });
  document.body.append(area);
  area.select();
  document.execCommand("copy"); // plain-http pages have no Clipboard API
  area.remove();
}

function number(input) {
  const v = input.value.trim();
  return v === "" ? undefined : Number(v);
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

function formatStats(usage, t0, tFirst, tEnd) {
  const parts = [`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`];
  const decode = (tEnd - tFirst) / 1000;
  if (usage.completion_tokens > 1 && decode > 0) {
    parts.push(`${((usage.completion_tokens - 1) / decode).toFixed(1)} tokens/s`);
  }
  if (tFirst) parts.push(`first token ${Math.round(tFirst - t0)} ms`);
  return parts.join(" · ");
}

function renderAttached() {
  ui.attachments.replaceChildren(...state.attached.map((url, i) => {
    const item = document.createElement("div");
    item.className = "attachment";
    const remove = Object.assign(document.createElement("button"), {
      type: "button", className: "remove", textContent: "×", title: "Remove this image",
    });
    remove.dataset.index = i;
    remove.setAttribute("aria-label", "Remove image");
    item.append(thumbnail(url), remove);
    return item;
  }));
  ui.attachments.hidden = !state.attached.length;
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function attach(files) {
  files = [...files];
  state.reading = state.reading.then(async () => {
    for (const file of files) {
      if (!IMAGE_TYPES.includes(file.type)) {
        showError(`${file.name || "That file"} is not a PNG, JPEG, WebP or GIF image.`);
        continue;
      }
      try {
        state.attached.push(await readDataUrl(file));
      } catch (e) {
        showError(`Could not read ${file.name || "the image"}: ${e.message}`);
      }
    }
    renderAttached();
  });
}

// A message with images goes as OpenAI content parts; one without stays a plain string.
function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? [{ type: "text", text }, ...parts] : parts;
}

async function send(text) {
  await state.reading;
  const images = state.attached;
  if (state.controller || (!text.trim() && !images.length)) return;
  // A setting the browser itself finds out of range or unreadable ("0,5" reads as 5 in some
  // locales) is named here, not sent: the server would take 5 as a temperature.
  const bad = Object.entries(PARAM_INPUTS).find(
    ([, input]) => input.validity.badInput || input.validity.rangeOverflow || input.validity.rangeUnderflow,
  );
  if (bad) {
    showError(`${bad[0]}: ${bad[1].validationMessage || "not a valid number"}`, bad[0]);
    return;
  }
  showError("");
  state.attached = [];
  renderAttached();
  const system = ui.system.value.trim();
  const userTurn = { role: "user", content: userContent(text, images) };
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, userTurn];
  const request = { model: state.model?.id, messages, temperature: number(ui.temperature),
                    max_tokens: number(ui.maxTokens), top_p: number(ui.topP) };
  const userEl = addMessage("user", text, images);
  const el = addMessage("assistant");
  el.dataset.state = "streaming";
  ui.prompt.value = "";
  state.controller = new AbortController();
  setBusy(true);
  let answer = "";
  let reasoning = "";
  let usage = null;
  let frame = 0;
  const t0 = performance.now();
  let tFirst = 0;
  try {
    for await (const chunk of streamChat(state.key, request, state.controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta ?? {};
      const thought = delta.reasoning_content ?? delta.reasoning; // --reasoning-parser servers
      if (!delta.content && !thought) continue;
      tFirst ||= performance.now();
      answer += delta.content ?? "";
      reasoning += thought ?? "";
      frame ||= requestAnimationFrame(() => {
        frame = 0;
        renderReasoning(el, reasoning, answer !== "");
        renderAnswer(el, answer);
        scrollDown();
      });
    }
    el.dataset.state = "done";
  } catch (e) {
    if (!answer && !reasoning) { // stopped or refused before any text: give the prompt back to edit and resend
      userEl.remove();
      el.remove();
      if (!ui.prompt.value) ui.prompt.value = text;
      if (!state.attached.length) {
        state.attached = images;
        renderAttached();
      }
      ui.empty.hidden = ui.messages.querySelector(".msg") !== null;
      if (e.name !== "AbortError") showError(e.message, e.param);
      if (e.status === 401) askForKey();
    } else if (e.name === "AbortError") {
      el.dataset.state = "stopped";
    } else {
      el.dataset.state = "error";
      showError(e.message);
    }
  } finally {
    cancelAnimationFrame(frame);
    state.controller = null;
    setBusy(false);
  }
  if (!el.isConnected) return;
  renderReasoning(el, reasoning, true);
  renderAnswer(el, answer);
  state.history.push(userTurn, { role: "assistant", content: answer }); // the thinking is not sent back
  const meta = el.querySelector(".meta");
  if (el.dataset.state === "stopped") meta.textContent = "stopped";
  else if (usage) meta.textContent = formatStats(usage, t0, tFirst, performance.now());
  scrollDown();
  ui.prompt.focus();
}

function askForKey() {
  ui.keyForm.hidden = false;
  ui.keyHint.textContent = "This server needs a key. It is kept in this tab only.";
  ui.apiKey.focus();
}

async function connect() {
  try {
    state.model = await fetchModel(state.key);
    ui.model.textContent = state.model.id;
    ui.model.title = `max_model_len ${state.model.max_model_len ?? "?"}`;
    if (state.key) sessionStorage.setItem(KEY_STORAGE, state.key); // only a key the server took
    ui.keyForm.hidden = !state.key; // a key that works: the server has one, so keep the field
    ui.keyHint.textContent = "Key accepted. It is kept in this tab only.";
    showError("");
    return true;
  } catch (e) {
    ui.model.textContent = "not connected";
    if (e.status === 401) {
      sessionStorage.removeItem(KEY_STORAGE);
      askForKey();
      showError(state.key ? "The server refused this API key." : "This server needs an API key.");
    } else {
      showError(e.message);
    }
    return false;
  }
}

ui.composer.addEventListener("submit", (ev) => {
  ev.preventDefault();
  send(ui.prompt.value);
});
ui.prompt.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    send(ui.prompt.value);
  }
});
ui.stop.addEventListener("click", () => state.controller?.abort());
ui.attachButton.addEventListener("click", () => ui.attach.click());
ui.attach.addEventListener("change", () => {
  attach(ui.attach.files);
  ui.attach.value = ""; // the same file can be picked again
});
ui.prompt.addEventListener("paste", (ev) => {
  // a copied picture; text that comes with a picture of itself (a spreadsheet's cells) stays text
  const data = ev.clipboardData;
  if (data?.files.length && !data.getData("text/plain")) attach(data.files);
});
ui.attachments.addEventListener("click", (ev) => {
  const button = ev.target.closest(".remove");
  if (!button) return;
  state.attached.splice(Number(button.dataset.index), 1);
  renderAttached();
  ui.prompt.focus();
});
ui.newChat.addEventListener("click", () => {
  state.controller?.abort();
  state.history = [];
  for (const el of ui.messages.querySelectorAll(".msg")) el.remove();
  ui.empty.hidden = false;
  showError("");
  ui.prompt.focus();
});
ui.keyForm.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  state.key = ui.apiKey.value.trim();
  if (await connect()) ui.prompt.focus();
});
ui.messages.addEventListener("click", async (ev) => {
  const button = ev.target.closest(".copy");
  if (!button) return;
  const code = button.parentElement.querySelector("code")?.textContent ?? "";
  try {
    await copyText(code);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});

connect().then((ok) => ok && ui.prompt.focus());
