// Live dashboard: polls /v1/speculant/stats every second and redraws numbers and charts.
"use strict";

const STATS_URL = "/v1/speculant/stats";
const POLL_MS = 1000;
const HISTORY = 60; // samples kept for the tokens/s chart

const rateHistory = []; // [tokens/s], newest last
let keyField = null;

const $ = (id) => document.getElementById(id);
const pct = (x) => (x === null || x === undefined ? "–" : fmt(100 * x, 1) + "%");

function setText(id, text) {
  const el = $(id);
  if (el.textContent !== String(text)) el.textContent = text;
}

function renderNumbers(stats) {
  const t = stats.totals;
  const g = stats.gateway;
  setText("tokens-per-s", fmt(g.tokens_per_s, 1));
  setText("window-s", fmt(stats.window_s));
  setText("num-running", t.num_running);
  setText("num-pending", g.num_pending);
  setText("num-waiting", t.num_waiting);
  setText("num-preemptions", t.num_preemptions);
  setText("kv-usage", pct(t.kv_usage));
  $("kv-meter").style.width = fmt(100 * t.kv_usage, 1) + "%";
  setText("acceptance-rate", pct(t.acceptance_rate));
  setText("num-accepted", t.num_accepted_tokens);
  setText("num-draft-tokens", t.num_draft_tokens);
  setText("acceptance-length", fmt(t.mean_acceptance_length, 2));
  setText("num-drafts", t.num_drafts);
  setText("generation-tokens", fmt(g.generation_tokens));
  setText("prompt-tokens", fmt(g.prompt_tokens));
  setText("num-finished", fmt(g.num_requests_finished));
  setText("num-workers", t.num_workers);
}

function renderPerPosition(rates) {
  const bars = $("per-pos");
  const labels = $("per-pos-labels");
  $("per-pos-empty").classList.toggle("hidden", rates.length > 0);
  while (bars.children.length < rates.length) {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.appendChild(document.createElement("span"));
    bars.appendChild(bar);
    const label = document.createElement("span");
    label.textContent = "draft " + (labels.children.length + 1);
    labels.appendChild(label);
  }
  while (bars.children.length > rates.length) { bars.lastChild.remove(); labels.lastChild.remove(); }
  rates.forEach((rate, i) => {
    const bar = bars.children[i];
    bar.style.height = Math.max(0.5, 100 * rate) + "%";
    bar.firstChild.textContent = fmt(100 * rate) + "%";
    bar.title = `draft token ${i + 1}: accepted in ${fmt(100 * rate, 1)}% of steps with drafts`;
  });
}

function renderRateChart() {
  const canvas = $("rate-chart");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const top = Math.max(1, ...rateHistory) * 1.15;
  const step = width / HISTORY;
  ctx.fillStyle = "#3056d3";
  rateHistory.forEach((rate, i) => {
    const h = (rate / top) * (height - 16);
    const x = width - (rateHistory.length - i) * step;
    ctx.fillRect(x + 1, height - h, step - 2, h);
  });
  ctx.fillStyle = "#667085";
  ctx.font = "12px system-ui, sans-serif";
  ctx.fillText("max " + fmt(Math.max(0, ...rateHistory), 1) + " tok/s", 4, 12);
}

function renderWorkers(workers) {
  const rows = workers.map((w) => {
    const spec = w.speculative_method ? `${w.speculative_method} (k=${w.num_speculative_tokens})` : "off";
    const cells = [w.worker_id, w.model, spec, w.num_running, w.num_waiting, pct(w.kv_usage),
      `${w.num_accepted_tokens} / ${w.num_draft_tokens}`];
    const tr = document.createElement("tr");
    for (const value of cells) tr.appendChild(document.createElement("td")).textContent = value;
    return tr;
  });
  $("workers").replaceChildren(...rows);
}

async function poll() {
  try {
    const stats = await getJSON(STATS_URL, keyField);
    rateHistory.push(stats.gateway.tokens_per_s);
    if (rateHistory.length > HISTORY) rateHistory.shift();
    renderNumbers(stats);
    renderPerPosition(stats.totals.acceptance_per_pos);
    renderRateChart();
    renderWorkers(stats.workers);
    $("status").textContent = "live · updated " + new Date().toLocaleTimeString();
    $("status").className = "muted";
  } catch (err) {
    $("status").textContent = "cannot read stats: " + err.message;
    $("status").className = "error";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function init() {
  keyField = setupKeyField(() => showModelName(keyField));
  showModelName(keyField);
  poll();
}

document.addEventListener("DOMContentLoaded", init);
