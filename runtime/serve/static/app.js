// The chat page of `tfport serve`: plain JavaScript, no framework, no build step.
//
// It talks to the server it was loaded from (relative URLs, so a path prefix behind a proxy
// works): GET v1/models lists the models; a decoder with a chat template is asked through
// v1/chat/completions, one without through v1/completions (the conversation as one text it
// continues), both streamed as server-sent events read from fetch's ReadableStream; an encoder
// gets the similarity panel (v1/embeddings of two texts, their cosine). Stop aborts the fetch:
// the server frees the row when the connection closes. The conversation lives in this page only.
"use strict";

const $ = (id) => document.getElementById(id);
const page = { models: new Map(), messages: [], controller: null };

// ------------------------------------------------------------------------------------ requests
function headers() {
  const key = $("api-key").value.trim();
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

// The response of GET (no body) or POST `body` to `path`; an Error with the server's message
// (OpenAI's {"error": {"message"}}) for a status other than 2xx.
async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
  const response = await fetch(path, init);
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message || message;
    } catch (_) { /* not OpenAI's error shape: keep the status line */ }
    throw new Error(message);
  }
  return response;
}

// The JSON of each server-sent event of a streamed response, until "data: [DONE]"; a reader
// that stops early (an error event) closes the response.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trim()).join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // already closed or aborted: nothing to do
  }
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

// ------------------------------------------------------------------------------------- models
async function loadModels() {
  let models;
  try {
    models = (await (await api("v1/models")).json()).data;
  } catch (err) {
    notice(`Could not list the models: ${err.message}`);
    return;
  }
  notice("");
  const select = $("model");
  const previous = select.value;
  page.models = new Map(models.map((model) => [model.id, model]));
  select.replaceChildren(...models.map((model) => new Option(`${model.id} (${model.family})`, model.id)));
  if (page.models.has(previous)) select.value = previous;
  showPanel();
}

function current() {
  return page.models.get($("model").value);
}

function showPanel() {
  const model = current();
  const encoder = model !== undefined && model.family === "encoder";
  $("chat-panel").hidden = encoder;
  $("embed-panel").hidden = !encoder;
  $("mode").textContent = model === undefined ? ""
    : encoder ? "embeddings" : model.chat_template ? "chat" : "text completion (no chat template)";
}

// --------------------------------------------------------------------------------------- chat
function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who, content);
  $("log").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

// The request body: the settings left empty are left out, so the server's defaults apply (the
// export's generation_config.json; max_tokens as many as fit for chat, 16 for completions).
function requestBody(model) {
  const body = { model: model.id, stream: true, stream_options: { include_usage: true } };
  if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
  if ($("max-tokens").value !== "") body.max_tokens = Number($("max-tokens").value);
  const system = $("system").value.trim();
  if (model.chat_template) {
    body.messages = [...(system ? [{ role: "system", content: system }] : []), ...page.messages];
  } else {
    body.prompt = [system, ...page.messages.map((m) => m.content)].filter(Boolean).join("\n");
  }
  return body;
}

// Tokens per second from the streamed chunks: the tokens after the first chunk over the time
// since it arrived (the first one waits for the prompt to be read).
class Meter {
  constructor() {
    this.start = performance.now();
    this.tokens = 0;
  }

  add(count) {
    if (!count) return;
    const now = performance.now();
    if (this.first === undefined) {
      this.first = now;
      this.firstTokens = count;
    }
    this.last = now;
    this.tokens += count;
  }

  text() {
    if (this.first === undefined) return "";
    const parts = [`${this.tokens} tokens`];
    const seconds = (this.last - this.first) / 1000;
    if (seconds > 0) parts.push(`${((this.tokens - this.firstTokens) / seconds).toFixed(1)} tokens/s`);
    parts.push(`first token after ${((this.first - this.start) / 1000).toFixed(2)} s`);
    return parts.join(" · ");
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("model").disabled = busy;
}

async function send(event) {
  event.preventDefault();
  const model = current();
  const text = $("prompt").value;
  if (page.controller || model === undefined || !text.trim()) return;
  $("prompt").value = "";
  const conversation = page.messages; // "New chat" while this runs starts another
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const item = addMessage("assistant", "");
  const content = item.querySelector(".content");
  item.setAttribute("aria-busy", "true");
  page.controller = new AbortController();
  setBusy(true);
  const meter = new Meter();
  $("speed").textContent = "";
  let reply = "";
  let finish = "";
  try {
    const path = model.chat_template ? "v1/chat/completions" : "v1/completions";
    const response = await api(path, requestBody(model), page.controller.signal);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      if (choice === undefined) continue; // the usage chunk
      const piece = (model.chat_template ? choice.delta.content : choice.text) || "";
      reply += piece;
      content.textContent = reply;
      meter.add(choice.token_ids ? choice.token_ids.length : Number(piece !== ""));
      $("speed").textContent = meter.text();
      finish = choice.finish_reason || finish;
    }
  } catch (err) {
    finish = err.name === "AbortError" ? "stopped" : "error";
    if (finish === "error") {
      const error = document.createElement("p");
      error.className = "error";
      error.textContent = err.message;
      item.append(error);
    }
  } finally {
    item.dataset.finish = finish;
    item.removeAttribute("aria-busy");
    conversation.push({ role: "assistant", content: reply });
    page.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function stop() {
  if (page.controller) page.controller.abort();
}

function clearChat() {
  stop();
  page.messages = [];
  $("log").replaceChildren();
  $("speed").textContent = "";
}

// ---------------------------------------------------------------------------------- embeddings
function cosine(a, b) {
  let dot = 0, aa = 0, bb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return dot / Math.sqrt(aa * bb);
}

async function compare() {
  const output = $("similarity");
  output.textContent = "…";
  try {
    const body = { model: current().id, input: [$("text-a").value, $("text-b").value] };
    const data = (await (await api("v1/embeddings", body)).json()).data;
    output.textContent = cosine(data[0].embedding, data[1].embedding).toFixed(4);
    notice("");
  } catch (err) {
    output.textContent = "";
    notice(`Could not embed the texts: ${err.message}`);
  }
}

// ------------------------------------------------------------------------------------- wiring
$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", clearChat);
$("compare").addEventListener("click", compare);
$("model").addEventListener("change", showPanel);
$("api-key").addEventListener("change", loadModels);
loadModels();
