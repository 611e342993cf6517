// Shared by the playground and the dashboard: the optional API key and authorised fetches.
// The key field stays hidden until the gateway answers 401 (it was started with API keys).
"use strict";

const KEY_STORAGE = "speculant-api-key";

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// Wires the #api-key input: shows it when needed, remembers what is typed.
function setupKeyField(onChange) {
  const wrap = document.getElementById("key-wrap");
  const input = document.getElementById("api-key");
  input.value = apiKey();
  if (input.value) wrap.classList.remove("hidden");
  input.addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, input.value.trim());
    if (onChange) onChange();
  });
  return {
    require() { wrap.classList.remove("hidden"); input.focus(); },
  };
}

// GET a JSON body; throws an Error carrying the OpenAI error message and the HTTP status.
async function getJSON(path, keyField) {
  const resp = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (resp.status === 401 && keyField) keyField.require();
  if (!resp.ok) throw await httpError(resp);
  return resp.json();
}

async function httpError(resp) {
  let message = resp.status + " " + resp.statusText;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = resp.status + ": " + body.error.message;
  } catch (_) { /* not JSON */ }
  const err = new Error(message);
  err.status = resp.status;
  return err;
}

async function showModelName(keyField) {
  const el = document.getElementById("model-name");
  try {
    const models = await getJSON("/v1/models", keyField);
    el.textContent = models.data.length ? models.data.map((m) => m.id).join(", ") : "no model ready";
    return models.data.length ? models.data[0].id : null;
  } catch (err) {
    el.textContent = err.status === 401 ? "API key required" : "gateway unreachable";
    return null;
  }
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toFixed(digits === undefined ? 0 : digits);
}
