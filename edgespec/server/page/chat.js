// The chat page: talks to the server's OpenAI API (/v1/chat/completions,
// streamed), shows each answer as Markdown as it comes (markdown.js) and,
// under it, the generation's speculative stats from the final chunk's
// "edgespec" field, or a "stopped" mark with what came when Stop cut it.
// Conversations (messages, system prompt, stats) are kept in the browser's
// localStorage and listed on the left.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "edgespec-conversations";   // localStorage: {current, list: [{id, title, system, turns}]}
let store = load();
let running = null;          // the AbortController of the answer being streamed

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.list)) return s;
  } catch (e) { /* a damaged store starts afresh */ }
  return {current: null, list: []};
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(store));
}

function current() {
  let c = store.list.find((x) => x.id === store.current);
  if (!c) {
    c = {id: String(Date.now()), title: "New chat", system: "", turns: []};
    store.list.unshift(c);
    store.current = c.id;
  }
  return c;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value || localStorage.getItem("edgespec-api-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// A message bubble; an assistant's text is Markdown (its raw text kept in data-text).
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const content = document.createElement("div");
  content.className = "content";
  div.appendChild(content);
  show(div, text);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function show(div, text) {
  const content = div.querySelector(".content");
  content.dataset.text = text;
  if (div.classList.contains("assistant")) content.innerHTML = markdown.render(text);
  else content.textContent = text;
}

function note(div, kind, text) {
  const line = document.createElement("div");
  line.className = kind;
  line.textContent = text;
  div.appendChild(line);
}

function needKey(message) {
  $("key-label").hidden = false;
  bubble("error", message + " (enter the server's API key above)");
}

async function loadModels() {
  const r = await fetch("/v1/models", {headers: headers()});
  if (r.status === 401) return needKey("this server requires an API key");
  const body = await r.json();
  $("model").replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
}

// "41.8 tok/s · acceptance 63% · ≈1.72× (estimated) · drafter auto (ngram 12, recycle 3) · 96 tokens, first after 0.21 s"
function statsLine(extra, usage, firstS) {
  const parts = [`${extra.tokens_per_s.toFixed(1)} tok/s`];
  const spec = extra.spec;
  if (spec) parts.push(`acceptance ${Math.round(100 * spec.acceptance_rate)}%`);
  parts.push(`≈${extra.estimated_speedup.toFixed(2)}× (estimated)`);
  let drafter = `drafter ${extra.drafter}`;
  const used = spec ? Object.entries(spec.per_drafter) : [];
  if (used.length) drafter += " (" + used.map(([name, d]) => `${name} ${d.steps}`).join(", ") + ")";
  parts.push(drafter);
  if (usage) parts.push(`${usage.completion_tokens} tokens` + (firstS === null ? "" : `, first after ${firstS.toFixed(2)} s`));
  return parts.join(" · ");
}

// "stopped · 12 pieces in 1.40 s, first after 0.21 s"
function stoppedLine(pieces, seconds, firstS) {
  return `stopped · ${pieces} pieces in ${seconds.toFixed(2)} s` + (firstS === null ? "" : `, first after ${firstS.toFixed(2)} s`);
}

function renderConversations() {
  const c = current();
  $("conversations").replaceChildren(...store.list.map((x) => {
    const li = document.createElement("li");
    li.textContent = x.title;
    li.className = x.id === c.id ? "active" : "";
    li.addEventListener("click", () => { if (!running) { store.current = x.id; save(); renderAll(); } });
    return li;
  }));
}

function renderAll() {
  const c = current();
  $("system").value = c.system;
  $("messages").replaceChildren();
  for (const t of c.turns) {
    const div = bubble(t.role, t.content);
    if (t.stats) note(div, "stats", t.stats);
    if (t.stopped) note(div, "stopped", t.stopped);
  }
  renderConversations();
}

async function ask(text) {
  const c = current();
  if (!c.turns.length) c.title = text.slice(0, 40);
  c.turns.push({role: "user", content: text});
  save();
  renderConversations();
  bubble("user", text);
  const answer = bubble("assistant", "");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let firstS = null, extra = null, usage = null, pieces = 0, text_ = "";
  const messages = (c.system ? [{role: "system", content: c.system}] : [])
    .concat(c.turns.map((t) => ({role: t.role, content: t.content})));
  const turn = {role: "assistant", content: ""};
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: running.signal,
      body: JSON.stringify({model: $("model").value || undefined, messages, stream: true,
                            stream_options: {include_usage: true},
                            temperature: Number($("temperature").value),
                            max_tokens: Number($("max-tokens").value)}),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      if (r.status === 401) needKey(err.error ? err.error.message : "unauthorized");
      throw new Error(err.error ? err.error.message : `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, cut);
        buffered = buffered.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        if (chunk.edgespec) extra = chunk.edgespec;
        const delta = chunk.choices.length ? chunk.choices[0].delta.content : "";
        if (delta) {
          if (firstS === null) firstS = (performance.now() - t0) / 1000;
          pieces++;
          text_ += delta;
          show(answer, text_);
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
    turn.content = text_;
    if (extra) note(answer, "stats", turn.stats = statsLine(extra, usage, firstS));
    c.turns.push(turn);
  } catch (e) {
    if (e.name === "AbortError") {   // Stop: the answer so far stays, marked
      turn.content = text_;
      note(answer, "stopped", turn.stopped = stoppedLine(pieces, (performance.now() - t0) / 1000, firstS));
      c.turns.push(turn);
    } else {
      answer.remove();
      bubble("error", String(e.message || e));
      c.turns.pop();   // the question goes unanswered: ask it again if you like
    }
  } finally {
    save();
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  ask(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => running && running.abort());
$("clear").addEventListener("click", () => {
  if (running) return;
  store.current = null;
  current();
  save();
  renderAll();
});
$("delete").addEventListener("click", () => {
  if (running) return;
  store.list = store.list.filter((x) => x.id !== store.current);
  store.current = store.list.length ? store.list[0].id : null;
  current();
  save();
  renderAll();
});
$("system").addEventListener("change", () => { current().system = $("system").value; save(); });
$("messages").addEventListener("click", (e) => {   // a code block's copy button
  if (!e.target.classList.contains("copy")) return;
  const code = e.target.parentElement.querySelector("code").textContent;
  const done = () => { e.target.textContent = "Copied"; setTimeout(() => { e.target.textContent = "Copy"; }, 1500); };
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(code).then(done);
  else {   // a page served over plain http to another machine has no clipboard API
    const area = document.createElement("textarea");
    area.value = code;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
    done();
  }
});
$("api-key").addEventListener("change", () => {
  localStorage.setItem("edgespec-api-key", $("api-key").value);
  loadModels();
});
renderAll();
loadModels();
