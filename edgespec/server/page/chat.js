// The chat page: talks to the server's OpenAI API (/v1/chat/completions,
// streamed), shows each answer as it comes and, under it, the generation's
// speculative stats from the final chunk's "edgespec" field.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = [];          // {role, content} of the conversation so far
let running = null;          // the AbortController of the answer being streamed

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value || localStorage.getItem("edgespec-api-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  div.appendChild(content);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
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

async function ask(text) {
  turns.push({role: "user", content: text});
  bubble("user", text);
  const answer = bubble("assistant", "");
  const content = answer.querySelector(".content");
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let firstS = null, extra = null, usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: running.signal,
      body: JSON.stringify({model: $("model").value || undefined, messages: turns, stream: true,
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
          content.textContent += delta;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
      }
    }
    turns.push({role: "assistant", content: content.textContent});
  } catch (e) {
    if (e.name !== "AbortError") bubble("error", String(e.message || e));
    turns.pop();   // the question goes unanswered: ask it again if you like
  } finally {
    if (extra) {
      const stats = document.createElement("div");
      stats.className = "stats";
      stats.textContent = statsLine(extra, usage, firstS);
      answer.appendChild(stats);
    }
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
$("clear").addEventListener("click", () => { turns.length = 0; $("messages").replaceChildren(); });
$("api-key").addEventListener("change", () => {
  localStorage.setItem("edgespec-api-key", $("api-key").value);
  loadModels();
});
loadModels();
