// The chat page: keeps the conversation, streams each reply from /v1/chat/completions (SSE) into the page.
"use strict";
const $ = (id) => document.getElementById(id);
const log = $("log"), form = $("f"), input = $("msg"), sendBtn = $("send"), stopBtn = $("stop");
let messages = [], controller = null, image = null;     // image: the attached file as a data URL, sent once

$("api_key").value = localStorage.getItem("llampy_api_key") || "";
$("api_key").addEventListener("change", () => localStorage.setItem("llampy_api_key", $("api_key").value));
$("clear").addEventListener("click", () => { messages = []; log.textContent = ""; $("stats").textContent = ""; });

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(cls, text) {
  const d = document.createElement("div");
  d.className = "msg " + cls;
  d.textContent = text;
  log.appendChild(d);
  d.scrollIntoView({block: "end"});
  return d;
}

fetch("/v1/models", {headers: headers()}).then((r) => r.ok ? r.json() : null)
  .then((j) => { if (j && j.data && j.data[0]) $("model").textContent = j.data[0].id; }).catch(() => {});

// Images: offered when the server reads them (--mmproj: /props says so); sent as an image_url part (a data URL)
fetch("/props", {headers: headers()}).then((r) => r.ok ? r.json() : null)
  .then((j) => { if (j && j.modalities && j.modalities.vision) $("attach").hidden = false; }).catch(() => {});

function setImage(url, name) {
  image = url;
  $("attached").hidden = !url;
  $("preview").src = url || "";
  $("attached_name").textContent = name || "";
  if (!url) $("image").value = "";
}
$("attach").addEventListener("click", () => $("image").click());
$("unattach").addEventListener("click", () => setImage(null));
$("image").addEventListener("change", () => {
  const file = $("image").files[0];
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result, file.name);
  reader.readAsDataURL(file);
});

// Reads an SSE stream: calls onData(parsed JSON) for every "data:" event except the final [DONE].
async function readSSE(res, onData) {
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data && data !== "[DONE]") onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const content = image ? [{type: "text", text}, {type: "image_url", image_url: {url: image}}] : text;
  messages.push({role: "user", content});
  const u = bubble("user", text);
  if (image) {
    const img = document.createElement("img");
    img.src = image;
    img.alt = $("attached_name").textContent;
    u.appendChild(img);
    setImage(null);
  }
  const a = bubble("assistant", "");
  a.dataset.chunks = "0";
  const sys = $("system").value.trim();
  const body = {
    messages: sys ? [{role: "system", content: sys}, ...messages] : messages,
    stream: true, stream_options: {include_usage: true},
    temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value),
  };
  controller = new AbortController();
  sendBtn.disabled = true; stopBtn.hidden = false;
  const t0 = performance.now();
  let reply = "", tFirst = null, usage = null;
  try {
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                     signal: controller.signal});
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || res.statusText);
    }
    await readSSE(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (tFirst === null) tFirst = performance.now();
        reply += delta.content;
        a.textContent = reply;
        a.dataset.chunks = String(Number(a.dataset.chunks) + 1);
        a.scrollIntoView({block: "end"});
      }
    });
    messages.push({role: "assistant", content: reply});
    if (usage) {
      const secs = (performance.now() - (tFirst || t0)) / 1000;
      $("stats").textContent = `${usage.prompt_tokens} prompt tokens, ${usage.completion_tokens} generated, ` +
        `first token after ${((tFirst || t0) - t0).toFixed(0)} ms, ` +
        `${(usage.completion_tokens / Math.max(secs, 1e-3)).toFixed(1)} tokens/s`;
    }
  } catch (e) {
    if (e.name === "AbortError") { messages.push({role: "assistant", content: reply}); }
    else { a.classList.add("error"); a.textContent = reply + (reply ? "\n" : "") + "error: " + e.message; }
  } finally {
    a.dataset.done = "1";
    controller = null;
    sendBtn.disabled = false; stopBtn.hidden = true;
    input.focus();
  }
}

form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
});
stopBtn.addEventListener("click", () => { if (controller) controller.abort(); });
