// dgemma playground: a chat over the server's own /v1/chat/completions, streamed, with the
// draft frames (docs/server.md, "draft frames") drawn as the canvas of the block being denoised.
// Everything the user writes stays: an answer that fails or is stopped keeps what arrived, and a
// request the server refuses puts the message back into the input box.
"use strict";

const $ = (id) => document.getElementById(id);
const KNOBS = ["max_tokens", "max_denoising_steps", "entropy_bound", "t_min", "t_max", "seed"];
const INTEGER_KNOBS = new Set(["max_tokens", "max_denoising_steps", "seed"]);
const MAX_FRAMES_KEPT = 2000;

// what the page holds: the conversation, pending images, the request in flight, frames drawn
const state = { model: null, vision: false, messages: [], attachments: [], controller: null, frames: [] };
window.dgemma = state; // for tests and the curious: state.frames lists every frame drawn
// the API key of a server started with --api-key: asked for on a 401, kept in this page's memory
// only (never in storage or the URL), so a reload asks again
let apiKey = null;

function authHeaders() {
  return apiKey === null ? {} : { authorization: `Bearer ${apiKey}` };
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("api-key").focus();
  setStatus(message, true);
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (response.status === 401) {
      askForKey(apiKey === null ? "this server needs an API key" : "wrong API key");
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    const card = (await response.json()).data[0];
    state.model = card.id;
    state.vision = Boolean(card.vision);
    const where = card.canvas_length ? ` · canvas ${card.canvas_length}` : "";
    $("model").textContent = `${card.id} · context ${card.max_model_len}${where}`;
    for (const [name, value] of Object.entries(card.sampler_defaults || {})) {
      const input = $(name);
      if (input && input.value === "") input.placeholder = String(value);
    }
    $("image-label").hidden = !state.vision;
    setStatus("ready");
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`, true);
  }
}

// ------------------------------------------------------------------------------- the request
function knobs() {
  const out = {};
  for (const name of KNOBS) {
    const raw = $(name).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value) || (INTEGER_KNOBS.has(name) && !Number.isInteger(value))) {
      throw new Error(`${name}: ${JSON.stringify(raw)} is not a${INTEGER_KNOBS.has(name) ? "n integer" : " number"}`);
    }
    out[name] = value;
  }
  return out;
}

function conversation() {
  const system = $("system").value.trim();
  return (system ? [{ role: "system", content: system }] : []).concat(state.messages);
}

// Server-sent events of a fetch response body: each `data:` line parsed, until [DONE].
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

// ------------------------------------------------------------------------------- the view
function addMessage(role, text = "", images = []) {
  $("empty").hidden = true;
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    box.append(img);
  }
  const parts = {};
  for (const name of ["thought", "content", "draft", "error", "figures"]) {
    parts[name] = document.createElement("div");
    parts[name].className = name;
    box.append(parts[name]);
  }
  parts.content.textContent = text;
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return parts;
}

// How a token piece shows in a canvas cell: whitespace made visible.
function visible(piece) {
  if (piece === "") return "∅";
  return piece.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/^ +$/, (s) => "␣".repeat(s.length));
}

function heat(entropy) {
  const x = Math.min(Math.max(entropy, 0) / 4, 1); // 0 .. 4 nats
  const hue = 140 - 140 * x; // green -> yellow -> red
  return `hsl(${hue} ${70 + 15 * x}% ${85 - 5 * x}%)`;
}

function drawCanvas(draft) {
  const cells = draft.pieces.map((piece, i) => {
    const cell = document.createElement("span");
    const accepted = draft.accepted[i];
    cell.className = `tok ${accepted ? "accepted" : "noised"}`;
    cell.textContent = visible(piece);
    cell.style.backgroundColor = heat(draft.entropy[i]);
    cell.title = `position ${i} · token ${draft.tokens[i]} · entropy ${draft.entropy[i].toFixed(3)} · ${accepted ? "accepted" : "re-noised"}`;
    return cell;
  });
  $("canvas").replaceChildren(...cells);
  const kept = draft.accepted.filter(Boolean).length;
  $("canvas-label").textContent = `block ${draft.block + 1} · step ${draft.step} · ${kept}/${draft.accepted.length} accepted`;
  state.frames.push({ block: draft.block, step: draft.step, accepted: kept, tokens: draft.tokens.join(" ") });
  if (state.frames.length > MAX_FRAMES_KEPT) state.frames.splice(0, state.frames.length - MAX_FRAMES_KEPT);
  $("canvas").dataset.frames = String(Number($("canvas").dataset.frames) + 1);
}

function figures(usage, started, firstBlock, finish) {
  const seconds = (performance.now() - started) / 1000;
  const out = [];
  if (usage) {
    out.push(`${usage.completion_tokens} tokens`);
    if (usage.tokens_per_forward !== undefined) out.push(`${usage.tokens_per_forward.toFixed(2)} tokens/forward`);
    if (seconds > 0) out.push(`${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    const details = usage.prompt_tokens_details || {};
    out.push(`prompt ${usage.prompt_tokens} (${details.cached_tokens || 0} cached)`);
    if (details.image_tokens) out.push(`${details.image_tokens} image tokens`);
  }
  out.push(firstBlock === null ? "no block" : `first block ${(firstBlock / 1000).toFixed(2)} s`);
  if (finish) out.push(`finish: ${finish}`);
  return out.join(" · ");
}

// ------------------------------------------------------------------------------- a turn
async function send(text) {
  let body;
  try {
    body = { model: state.model, stream: true, stream_drafts: $("show_drafts").checked,
             stream_options: { include_usage: true }, ...knobs() };
  } catch (err) {
    setStatus(err.message, true);
    return;
  }
  const images = state.attachments.splice(0);
  drawAttachments();
  const content = images.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
    : text;
  state.messages.push({ role: "user", content });
  const userView = addMessage("user", text, images);
  body.messages = conversation();
  const view = addMessage("assistant");
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  const started = performance.now();
  let answer = "", thought = "", usage = null, firstBlock = null, finish = null, failure = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      failure = await errorMessage(response);
      if (response.status === 401) askForKey(failure);
      // refused: nothing was generated; the message goes back into the input box
      state.messages.pop();
      userView.content.parentElement.remove();
      view.content.parentElement.remove();
      state.attachments.push(...images);
      drawAttachments();
      if (!$("input").value) $("input").value = text;
      if (response.status !== 401) setStatus(failure, true);
      return;
    }
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.draft) {
          drawCanvas(choice.draft);
          view.draft.textContent = choice.draft.text;
          continue;
        }
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content) {
          if (firstBlock === null) firstBlock = performance.now() - started;
          answer += delta.content || "";
          thought += delta.reasoning_content || "";
          view.content.textContent = answer;
          view.thought.textContent = thought;
          view.draft.textContent = "";
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      view.content.parentElement.scrollIntoView({ block: "end" });
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else failure = err.message;
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  view.draft.textContent = "";
  if (failure !== null || finish !== null || answer) {
    state.messages.push({ role: "assistant", content: answer }); // a partial answer stays in the conversation
    if (failure !== null) view.error.textContent = `error: ${failure}`;
    view.figures.textContent = figures(usage, started, firstBlock, finish);
    $("canvas-label").textContent += " · done";
    setStatus(failure === null ? "ready" : failure, failure !== null);
  }
}

// ------------------------------------------------------------------------------- images
function drawAttachments() {
  const thumbs = state.attachments.map((url, i) => {
    const box = document.createElement("span");
    box.className = "thumb";
    const img = document.createElement("img");
    img.src = url;
    img.alt = "image to send";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.title = "remove";
    remove.addEventListener("click", () => {
      state.attachments.splice(i, 1);
      drawAttachments();
    });
    box.append(img, remove);
    return box;
  });
  $("attachments").replaceChildren(...thumbs);
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// ------------------------------------------------------------------------------- wiring
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("api-key").value.trim() || null;
  $("api-key").value = "";
  $("key-form").hidden = true;
  loadModel();
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("reset").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("messages").replaceChildren($("empty"));
  $("empty").hidden = false;
  $("canvas").replaceChildren();
  $("canvas-label").textContent = "idle";
  setStatus("ready");
});
$("image").addEventListener("change", async (event) => {
  try {
    for (const file of event.target.files) state.attachments.push(await readAsDataUrl(file));
  } catch (err) {
    setStatus(`cannot read the image: ${err.message}`, true);
  }
  event.target.value = "";
  drawAttachments();
});

loadModel();
