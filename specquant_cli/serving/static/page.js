// The chat page of `specquant serve`: plain JavaScript, no build step, no outside resources.
// It talks to this server only: GET /v1/models (policies, the parent's calibrated speed) and a streamed
// POST /v1/chat/completions, whose chunks carry `specquant.spans` (where each piece of text came from) and the
// running figures. Model output is only ever inserted as text (textContent), never as HTML.
"use strict";

(() => {
  const KEY_STORE = "specquant-api-key";
  const SOURCES = {
    draft: "model draft, accepted by the parent",
    suffix: "suffix / n-gram draft, accepted by the parent",
    grammar: "forced by the answer's grammar (structured output), accepted by the parent",
    parent: "the parent's own token (a correction or the bonus)",
  };
  const $ = (id) => document.getElementById(id);
  const state = { model: null, parentTps: null, messages: [], controller: null };

  // -- rendering (text only) ------------------------------------------------------------------------

  // Append `spans` ([{text, source}]) to `container`, one <span> per piece, tinted by its source.
  function appendSpans(container, spans) {
    for (const span of spans) {
      const source = Object.hasOwn(SOURCES, span.source) ? span.source : "unknown";
      const el = document.createElement("span");
      el.className = "tok src-" + source;
      el.dataset.source = source;
      el.textContent = String(span.text);
      container.append(el);
    }
  }

  // The spans of one chunk: the server's, or the whole content as one unattributed piece.
  function chunkSpans(content, spans) {
    const ok = Array.isArray(spans) && spans.map((s) => s.text).join("") === content;
    return ok ? spans : [{ text: content, source: "unknown" }];
  }

  function addTurn(role, text) {
    const li = document.createElement("li");
    li.className = "turn " + role;
    li.dataset.state = role === "user" ? "sent" : "streaming";
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Model";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const foot = document.createElement("div");
    foot.className = "foot";
    li.append(who, body, foot);
    $("conversation").append(li);
    li.scrollIntoView({ block: "end" });
    return { li, body, foot, text: "", figures: {} };
  }

  // -- errors -----------------------------------------------------------------------------------

  // A readable message for an HTTP error answer (`body`: its parsed JSON, or null).
  function errorMessage(status, body, retryAfter) {
    const detail = body && body.error && body.error.message ? String(body.error.message) : "";
    const tail = detail ? ": " + detail : "";
    if (status === 401) return `The server refused the API key (401)${tail}. Enter the key above.`;
    if (status === 429) {
      const wait = retryAfter ? ` Try again in about ${retryAfter} s.` : "";
      return `The server is busy (429)${tail}.${wait}`;
    }
    if (status === 503) return `The server cannot answer now (503)${tail}.`;
    if (status >= 500) return `The server failed (${status})${tail || ": internal error"}.`;
    return `The request was refused (${status})${tail}.`;
  }

  function streamError(body) {
    const detail = body && body.error && body.error.message ? String(body.error.message) : "unknown error";
    return `The answer was cut short: ${detail}.`;
  }

  function connectionLost(err) {
    return `Lost the connection to the server (${err && err.message ? err.message : "network error"}). ` +
      "Is `specquant serve` still running?";
  }

  async function apiError(response) {
    let body = null;
    try {
      body = await response.json();
    } catch (e) {
      body = null; // not JSON: the status alone
    }
    return errorMessage(response.status, body, response.headers.get("Retry-After"));
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = false;
  }

  function clearError() {
    $("error").textContent = "";
    $("error").hidden = true;
  }

  // -- the API key ------------------------------------------------------------------------------

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function askKey() {
    $("key-form").hidden = false;
    $("key-change").hidden = false;
    $("key-input").focus();
  }

  function saveKey(event) {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
    $("key-input").value = "";
    $("key-form").hidden = true;
    loadModels();
  }

  // -- the live panel ---------------------------------------------------------------------------

  const fmt = (x, digits) => (typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–");

  function setStat(id, text) {
    $(id).textContent = text;
  }

  function resetPanel() {
    for (const id of ["stat-tps", "stat-ratio", "stat-acceptance", "stat-per-call", "stat-tokens", "stat-tier",
      "stat-plan", "stat-why"]) setStat(id, "–");
  }

  function ratio(tps) {
    return state.parentTps && typeof tps === "number" ? tps / state.parentTps : null;
  }

  // Show what a chunk's `specquant` object carries (every field is optional).
  function updatePanel(sq, figures) {
    Object.assign(figures, sq);
    if ("decode_tokens_per_s" in sq) setStat("stat-tps", fmt(sq.decode_tokens_per_s, 1));
    if ("decode_tokens_per_s" in sq) setStat("stat-ratio", fmt(ratio(sq.decode_tokens_per_s), 2) + "×");
    if ("acceptance_rate" in sq) setStat("stat-acceptance", sq.drafted ? fmt(100 * sq.acceptance_rate, 0) + " %" : "–");
    if ("mean_accepted_length" in sq) setStat("stat-per-call", fmt(sq.mean_accepted_length, 2));
    if ("tokens" in sq) setStat("stat-tokens", String(sq.tokens));
    if (sq.route) setStat("stat-tier", `${sq.route.tier} (score ${fmt(sq.route.score, 2)})`);
    if ("plan" in sq) setStat("stat-plan", `${sq.policy}: ${sq.plan}`);
    if ("why" in sq) setStat("stat-why", sq.why || "fixed by the policy");
  }

  function footer(turn, note) {
    const f = turn.figures;
    const parts = [];
    if (typeof f.tokens === "number") parts.push(`${f.tokens} tokens`);
    if (typeof f.decode_tokens_per_s === "number") parts.push(`${fmt(f.decode_tokens_per_s, 1)} tok/s`);
    if (ratio(f.decode_tokens_per_s) !== null) parts.push(`${fmt(ratio(f.decode_tokens_per_s), 2)}× the parent`);
    if (f.drafted) parts.push(`acceptance ${fmt(100 * f.acceptance_rate, 0)} %`);
    if (f.plan) parts.push(f.plan);
    if (note) parts.push(note);
    turn.foot.textContent = parts.join(" · ");
  }

  // -- models -----------------------------------------------------------------------------------

  // The server's policies, its default selected (an empty choice sends none: the server's default applies).
  function fillPolicies(policies, defaultPolicy) {
    const select = $("policy");
    select.replaceChildren();
    for (const name of policies) {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      select.append(option);
    }
    select.value = policies.includes(defaultPolicy) ? defaultPolicy : (policies[0] || "");
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: headers() });
    } catch (err) {
      return showError(connectionLost(err));
    }
    if (!response.ok) {
      showError(await apiError(response));
      if (response.status === 401) askKey();
      return;
    }
    const card = (await response.json()).data[0];
    const sq = card.specquant || {};
    state.model = card.id;
    state.parentTps = typeof sq.parent_tokens_per_s === "number" ? sq.parent_tokens_per_s : null;
    $("model-name").textContent = card.id;
    fillPolicies(sq.policies || (sq.default_policy ? [sq.default_policy] : []), sq.default_policy);
    setStat("stat-parent", state.parentTps ? fmt(state.parentTps, 1) : "not calibrated");
    clearError();
  }

  // -- streaming --------------------------------------------------------------------------------

  // Handle one SSE event; returns {done}, {error} or null (more to come).
  function handleEvent(event, turn) {
    const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
    if (!data) return null;
    if (data === "[DONE]") return { done: true };
    const chunk = JSON.parse(data);
    if (chunk.error) return { error: streamError(chunk) };
    const choice = (chunk.choices || [])[0];
    const content = choice && choice.delta ? choice.delta.content : null;
    const sq = chunk.specquant || {};
    if (content) {
      appendSpans(turn.body, chunkSpans(content, sq.spans));
      turn.text += content;
      turn.li.scrollIntoView({ block: "end" });
    }
    updatePanel(sq, turn.figures);
    return null;
  }

  async function readStream(response, turn) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const result = handleEvent(buffer.slice(0, cut), turn);
        buffer = buffer.slice(cut + 2);
        if (result) return result;
      }
    }
    return { error: "The stream ended before the answer was complete (the server stopped, or its worker died)." };
  }

  function request() {
    const maxTokens = parseInt($("max-tokens").value, 10);
    const temperature = parseFloat($("temperature").value);
    return {
      model: state.model || undefined,
      messages: state.messages,
      stream: true,
      max_tokens: Number.isFinite(maxTokens) ? maxTokens : undefined,
      temperature: Number.isFinite(temperature) ? temperature : undefined,
      specquant_policy: $("policy").value || undefined,
    };
  }

  async function generate(turn, controller) {
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(request()), signal: controller.signal,
      });
      if (!response.ok) return { error: await apiError(response), status: response.status };
      return await readStream(response, turn);
    } catch (err) {
      if (controller.signal.aborted) return { stopped: true };
      controller.abort(); // a stream we cannot read any more: let the server stop generating for it
      return { error: connectionLost(err) };
    }
  }

  function setBusy(busy) {
    $("busy").hidden = !busy;
    $("send").disabled = busy;
    $("clear").disabled = busy;
    $("stop").disabled = !busy;
  }

  // The answer is over (done, stopped or failed): keep what was shown in the conversation.
  function settle(userTurn, turn, outcome, prompt) {
    if (!turn.text) { // nothing was said (an error, Stop, an empty answer): take the question back, for a retry
      state.messages.pop();
      userTurn.li.remove();
      turn.li.remove();
      $("prompt").value = prompt;
    } else {
      state.messages.push({ role: "assistant", content: turn.text });
    }
    if (outcome.error) {
      showError(outcome.error);
      if (outcome.status === 401) askKey();
    }
    turn.li.dataset.state = outcome.done ? "done" : outcome.stopped ? "stopped" : "error";
    footer(turn, outcome.stopped ? "stopped" : outcome.error ? "cut short" : "");
  }

  async function send(event) {
    event.preventDefault();
    const prompt = $("prompt").value;
    if (!prompt.trim() || state.controller) return;
    clearError();
    resetPanel();
    state.messages.push({ role: "user", content: prompt });
    const userTurn = addTurn("user", prompt);
    const turn = addTurn("assistant", "");
    $("prompt").value = "";
    const controller = (state.controller = new AbortController());
    setBusy(true);
    let outcome;
    try {
      outcome = await generate(turn, controller);
    } catch (err) {
      outcome = { error: `The page failed to read the answer: ${err && err.message}` };
    } finally {
      state.controller = null;
      setBusy(false);
    }
    settle(userTurn, turn, outcome, prompt);
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function newChat() {
    state.messages = [];
    $("conversation").replaceChildren();
    clearError();
    resetPanel();
  }

  function onKey(event) {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("ask-form").requestSubmit();
    }
  }

  function start() {
    $("ask-form").addEventListener("submit", send);
    $("key-form").addEventListener("submit", saveKey);
    $("key-change").addEventListener("click", askKey);
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", newChat);
    $("prompt").addEventListener("keydown", onKey);
    if (sessionStorage.getItem(KEY_STORE)) $("key-change").hidden = false;
    loadModels();
  }

  // For the browser tests: the rendering and error functions, nothing that holds the key.
  window.specquantPage = Object.freeze({ appendSpans, chunkSpans, errorMessage, SOURCES });
  document.addEventListener("DOMContentLoaded", start);
})();
