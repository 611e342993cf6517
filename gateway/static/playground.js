// Chat playground: streams /v1/chat/completions and colours each token by how it was made.
// Provenance comes from the opt-in `speculant: {provenance: true}` extension (per-token
// `drafted` flags); per-token text comes from logprobs `bytes`, decoded as one UTF-8 stream
// so a character split over two tokens lands whole in the second one's span.
"use strict";

const chatHistory = []; // [{role, content}] sent with every turn
let controller = null; // AbortController of the answer being streamed
let keyField = null;
let modelId = null;

const $ = (id) => document.getElementById(id);

function numberField(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

function requestBody() {
  const body = {
    messages: chatHistory.slice(),
    stream: true,
    stream_options: { include_usage: true },
    logprobs: true,
    speculant: { provenance: true },
  };
  if (modelId) body.model = modelId;
  for (const [id, name] of [["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"]]) {
    const value = numberField(id);
    if (value !== null) body[name] = value;
  }
  const schema = $("json-schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error(`JSON schema: not valid JSON (${e.message})`); }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
  }
  const nMax = numberField("n-max");
  const method = $("method").value;
  if (!$("spec-on").checked) body.speculative = { n_max: 0 };
  else {
    const spec = {};
    if (nMax !== null) spec.n_max = nMax;
    if (method) spec.method = method;
    if (Object.keys(spec).length) body.speculative = spec;
  }
  return body;
}

// Server-sent events of a fetch response, as parsed JSON payloads, up to `data: [DONE]`.
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let sep;
    while ((sep = /\r\n\r\n|\n\n|\r\r/.exec(buffer)) !== null) {
      const raw = buffer.slice(0, sep.index);
      buffer = buffer.slice(sep.index + sep[0].length);
      const data = raw.split(/\r\n|\n|\r/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data === "") continue; // a comment (keep-alive)
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function addMessage(role) {
  const msg = document.createElement("div");
  msg.className = "msg " + role;
  msg.innerHTML = '<div class="role"></div><div class="body"></div>';
  msg.querySelector(".role").textContent = role;
  if (!$("colour-on").checked) msg.classList.add("plain");
  $("messages").appendChild(msg);
  return msg;
}

// One streamed answer: token spans, counters, and the stats line under it.
class AnswerView {
  constructor() {
    this.msg = addMessage("assistant");
    this.body = this.msg.querySelector(".body");
    this.stats = document.createElement("div");
    this.stats.className = "answer-stats";
    this.msg.appendChild(this.stats);
    this.utf8 = new TextDecoder();
    this.content = "";
    this.numTokens = 0;
    this.numDraftedShown = 0;
    this.numSteps = 0;
    this.startTime = performance.now();
    this.firstTime = null;
    this.lastTime = null;
    this.usage = null;
  }

  addChunk(chunk) {
    if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) { // the usage chunk
      if (chunk.usage) this.usage = chunk.usage;
      return;
    }
    const text = (choice.delta && choice.delta.content) || "";
    this.content += text;
    const prov = chunk.speculant || { token_ids: [], drafted: [] };
    const logprobs = (choice.logprobs && choice.logprobs.content) || [];
    if (prov.token_ids.length === 0) return;
    const now = performance.now();
    if (this.firstTime === null) this.firstTime = now;
    this.lastTime = now;
    this.numSteps += 1;
    if (logprobs.length === prov.token_ids.length) this.addTokens(prov, logprobs);
    else this.addSpan(text, prov.drafted.every(Boolean) ? "draft" : prov.drafted.some(Boolean) ? "mixed" : "target");
    this.numTokens += prov.token_ids.length;
    this.numDraftedShown += prov.drafted.filter(Boolean).length;
    this.render();
  }

  addTokens(prov, logprobs) {
    prov.token_ids.forEach((tokenId, i) => {
      const item = logprobs[i];
      const text = item.bytes ? this.utf8.decode(Uint8Array.from(item.bytes), { stream: true }) : item.token;
      const forced = prov.grammar && prov.grammar[i];
      const span = this.addSpan(text, forced ? "grammar" : prov.drafted[i] ? "draft" : "target");
      const how = forced ? "forced by the grammar" : prov.drafted[i] ? "accepted draft" : "target";
      span.title = `token ${tokenId} · ${how} · logprob ${fmt(item.logprob, 3)}`;
    });
  }

  addSpan(text, kind) {
    const span = document.createElement("span");
    span.className = "tok " + kind;
    span.textContent = text;
    this.body.appendChild(span);
    return span;
  }

  // Token texts include what the answer text leaves out (a stop string, the end-of-turn token):
  // cut the spans down to the answer text, or show it plain if they disagree otherwise.
  finish() {
    const shown = this.body.textContent;
    if (shown === this.content) return;
    if (!shown.startsWith(this.content)) {
      this.body.textContent = this.content;
      return;
    }
    let excess = shown.length - this.content.length;
    while (excess > 0 && this.body.lastChild) {
      const last = this.body.lastChild;
      const len = last.textContent.length;
      if (len <= excess) { last.remove(); excess -= len; } else { last.textContent = last.textContent.slice(0, len - excess); excess = 0; }
    }
  }

  render() {
    const spec = (this.usage && this.usage.speculative) || null;
    const numTokens = this.usage ? this.usage.completion_tokens : this.numTokens;
    const decodeSeconds = this.firstTime !== null ? (this.lastTime - this.firstTime) / 1000 : 0;
    const tokensPerS = decodeSeconds > 0 ? (this.numTokens - 1) / decodeSeconds : null;
    const parts = [
      `<b>${numTokens}</b> tokens in <b>${this.numSteps}</b> steps`,
      `<b>${fmt(this.numSteps ? this.numTokens / this.numSteps : null, 2)}</b> tokens/step`,
    ];
    if (spec) {
      const rate = spec.num_draft_tokens ? (100 * spec.num_accepted_tokens) / spec.num_draft_tokens : null;
      parts.push(`drafted <b class="drafted">${spec.num_draft_tokens}</b>`,
        `accepted <b class="accepted">${spec.num_accepted_tokens}</b> (${fmt(rate)}%)`,
        `acceptance length <b>${fmt(spec.mean_acceptance_length, 2)}</b>`);
    } else {
      parts.push(`accepted drafts so far <b class="accepted">${this.numDraftedShown}</b>`);
    }
    parts.push(`<b>${fmt(tokensPerS, 1)}</b> tokens/s`);
    if (this.firstTime !== null) parts.push(`first token ${fmt(this.firstTime - this.startTime)} ms`);
    this.stats.innerHTML = parts.join(" · ");
    this.stats.dataset.tokens = numTokens;
    this.stats.dataset.accepted = spec ? spec.num_accepted_tokens : this.numDraftedShown;
    this.stats.dataset.drafted = spec ? spec.num_draft_tokens : "";
    this.stats.dataset.done = spec ? "1" : "";
  }
}

function showError(message) {
  const el = $("error");
  el.textContent = message;
  el.classList.toggle("hidden", !message);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const prompt = $("prompt").value.trim();
  if (!prompt || controller) return;
  showError("");
  $("prompt").value = "";
  chatHistory.push({ role: "user", content: prompt });
  addMessage("user").querySelector(".body").textContent = prompt;
  const view = new AnswerView();
  controller = new AbortController();
  setBusy(true);
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (resp.status === 401) keyField.require();
    if (!resp.ok) throw await httpError(resp);
    for await (const chunk of sseEvents(resp)) view.addChunk(chunk);
  } catch (err) {
    if (err.name !== "AbortError") showError(err.message);
  } finally {
    view.finish();
    view.render();
    if (view.content) chatHistory.push({ role: "assistant", content: view.content });
    else chatHistory.pop(); // nothing came back: the turn is not part of the conversation
    controller = null;
    setBusy(false);
    view.msg.scrollIntoView({ block: "end" });
  }
}

// The proposers a request may pick, from the first worker that reports them.
async function listMethods() {
  try {
    const resp = await fetch("/v1/speculant/stats", { headers: authHeaders({}) });
    if (!resp.ok) return;
    const stats = await resp.json();
    const worker = (stats.workers || []).find((w) => (w.available_methods || []).length);
    if (!worker) return;
    const select = $("method");
    select.options[0].textContent = `server default (${worker.speculative_method})`;
    for (const name of worker.available_methods) {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      select.appendChild(option);
    }
  } catch (err) { /* the list is a convenience: the default method still works */ }
}

function init() {
  listMethods();
  keyField = setupKeyField(async () => { modelId = await showModelName(keyField); });
  showModelName(keyField).then((id) => { modelId = id; });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    chatHistory.length = 0;
    $("messages").textContent = "";
    showError("");
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("colour-on").addEventListener("change", (e) => {
    document.querySelectorAll(".msg.assistant").forEach((m) => m.classList.toggle("plain", !e.target.checked));
  });
  $("spec-on").addEventListener("change", (e) => { $("n-max").disabled = !e.target.checked; });
}

document.addEventListener("DOMContentLoaded", init);
