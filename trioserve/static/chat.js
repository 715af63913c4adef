// The chat page of trioserve: a client of the server's own WebSocket protocol
// (docs/protocol.md). One connection to the server that served this page; each
// message is an `infer` with `messages` (rendered with the model's chat
// template), streamed; Stop is a `stop` with the request's id as `target`.
//
// Safety: model output is text. Every string from the server reaches the DOM
// through textContent or a Text node, never as markup (no innerHTML anywhere),
// and the page's Content-Security-Policy allows no script but this one.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), status: $("status"), notice: $("notice"), log: $("log"),
    input: $("input"), send: $("send"), stop: $("stop"), newChat: $("new-chat"),
    composer: $("composer"), keyForm: $("key-form"), key: $("key"), system: $("system"),
    stopStrings: $("stop_strings"),
  };
  const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed"];
  const INTEGERS = new Set(["top_k", "max_new_tokens", "seed"]);
  const SETTINGS_KEY = "trioserve.chat.settings";
  const DRAFT_KEY = "trioserve.chat.draft";
  const API_KEY = "trioserve.chat.api_key";
  const KEPT = "Your message is kept, and sent when the connection is back.";

  // -- storage that never throws (private modes, disabled storage) ------------
  const store = {
    get(area, key) { try { return window[area].getItem(key); } catch { return null; } },
    set(area, key, value) { try { window[area].setItem(key, value); } catch { /* kept in memory only */ } },
    remove(area, key) { try { window[area].removeItem(key); } catch { /* nothing to remove */ } },
  };

  // -- state -------------------------------------------------------------------
  let ws = null;            // the WebSocket, or null between connections
  let opened = false;       // whether `ws` completed its handshake
  let retryDelay = 500;     // ms; doubles up to RETRY_MAX after each failed attempt
  const RETRY_MAX = 5000;
  let retryTimer = null;
  let waitingForKey = false;
  let apiKey = store.get("sessionStorage", API_KEY) || "";
  let history = [];         // finished turns: {role, content}
  let current = null;       // the running exchange: {id, userText, turn, text, node}
  let sendWhenOpen = false; // Send was pressed while disconnected
  let sequence = 0;

  // -- small DOM helpers (text only) -------------------------------------------
  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function notice(text, kind) {
    ui.notice.hidden = !text;
    ui.notice.textContent = text || "";
    ui.notice.dataset.kind = kind || "info";
  }

  function setStatus(state, text) {
    ui.status.dataset.state = state;
    ui.status.textContent = text;
  }

  function scrollDown(force) {
    const log = ui.log;
    if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 80) {
      log.scrollTop = log.scrollHeight;
    }
  }

  function addTurn(role, text) {
    const turn = element("li", `turn ${role}`);
    turn.append(element("div", "role", role === "user" ? "you" : "assistant"));
    const body = element("div", "text");
    const node = document.createTextNode(text);
    body.append(node);
    turn.append(body);
    ui.log.append(turn);
    scrollDown(true);
    return { turn, node };
  }

  function updateButtons() {
    const busy = current !== null;
    ui.send.disabled = busy;
    ui.stop.disabled = !busy || !opened;
  }

  // -- settings ----------------------------------------------------------------
  function saveSettings() {
    const saved = { system: ui.system.value, stop_strings: ui.stopStrings.value };
    for (const name of NUMBERS) saved[name] = $(name).value;
    store.set("localStorage", SETTINGS_KEY, JSON.stringify(saved));
  }

  function loadSettings() {
    let saved = null;
    try { saved = JSON.parse(store.get("localStorage", SETTINGS_KEY) || "null"); } catch { saved = null; }
    if (!saved || typeof saved !== "object") return;
    if (typeof saved.system === "string") ui.system.value = saved.system;
    if (typeof saved.stop_strings === "string") ui.stopStrings.value = saved.stop_strings;
    for (const name of NUMBERS) {
      if (typeof saved[name] === "string") $(name).value = saved[name];
    }
  }

  // The infer request's sampler fields; throws with a message naming the field.
  function samplerFields() {
    const fields = {};
    for (const name of NUMBERS) {
      const raw = $(name).value.trim();
      if (raw === "") continue;
      const value = Number(raw);
      if (!Number.isFinite(value) || (INTEGERS.has(name) && !Number.isInteger(value))) {
        throw new Error(`${name} must be ${INTEGERS.has(name) ? "an integer" : "a number"}, got ${JSON.stringify(raw)}`);
      }
      fields[name] = value;
    }
    const stops = ui.stopStrings.value.split("\n").filter((s) => s !== "");
    if (stops.length) fields.stop_conditions = stops;
    return fields;
  }

  // -- the connection ----------------------------------------------------------
  function socketURL() {
    const url = new URL("/", window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.search = apiKey ? `?api_key=${encodeURIComponent(apiKey)}` : "";
    url.hash = "";
    return url.href;
  }

  function connect() {
    clearTimeout(retryTimer);
    retryTimer = null;
    if (ws !== null || waitingForKey) return;
    setStatus("connecting", "connecting…");
    opened = false;
    let socket;
    try {
      socket = new WebSocket(socketURL());
    } catch (error) {
      notice(`Cannot open a WebSocket: ${error.message}`, "error");
      return;
    }
    ws = socket;
    socket.onopen = () => {
      if (ws !== socket) return;
      opened = true;
      retryDelay = 500;
      setStatus("open", "connected");
      notice("");
      send({ action: "info", request_id: "info" });
      updateButtons();
      if (sendWhenOpen) {
        sendWhenOpen = false;
        submit();
      }
    };
    socket.onmessage = (event) => {
      if (ws !== socket) return;
      let frame;
      try { frame = JSON.parse(event.data); } catch { return; }
      if (frame && typeof frame === "object") receive(frame);
    };
    socket.onclose = (event) => {
      if (ws !== socket) return;
      const wasOpen = opened;
      ws = null;
      opened = false;
      connectionLost();
      if (wasOpen) {
        setStatus("closed", `disconnected (code ${event.code}): reconnecting…`);
        scheduleRetry(0);
      } else {
        setStatus("closed", "not connected");
        diagnose();
      }
    };
  }

  function scheduleRetry(delay) {
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, delay);
  }

  function backoff() {
    const delay = retryDelay;
    retryDelay = Math.min(retryDelay * 2, RETRY_MAX);
    scheduleRetry(delay);
    return delay;
  }

  // Browsers show every refused handshake alike (code 1006): 401, 403 and a
  // server that is down cannot be told apart. Ask the server over HTTP instead.
  async function diagnose() {
    let ready;
    try {
      ready = await fetch("/ready", { cache: "no-store" });
    } catch {
      const delay = backoff();
      notice(`The server does not answer (stopped or restarting): retrying in ${Math.round(delay / 100) / 10} s.${sendWhenOpen ? ` ${KEPT}` : ""}`, "info");
      return;
    }
    if (ready.status !== 200) {
      let state = `HTTP ${ready.status}`;
      try { state = (await ready.json()).status || state; } catch { /* keep the status */ }
      const delay = backoff();
      notice(`The server is not ready (${state}): retrying in ${Math.round(delay / 100) / 10} s.${sendWhenOpen ? ` ${KEPT}` : ""}`, "info");
      return;
    }
    const headers = { Accept: "application/json" };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    let probe;
    try {
      probe = await fetch("/", { headers, cache: "no-store" });
    } catch {
      backoff();
      return;
    }
    if (probe.status === 401) {
      askForKey(apiKey ? "The server refused this API key (HTTP 401). Enter the right one." : "");
      return;
    }
    const delay = backoff();
    notice(
      "The server is ready and the key is accepted, but it refused this page's WebSocket " +
      "handshake: most likely the origin (HTTP 403; its log says why), or it is full (503). " +
      "Behind a proxy, forward the Host header as the browser sent it (docs/deployment.md). " +
      `Retrying in ${Math.round(delay / 100) / 10} s.`,
      "error",
    );
  }

  function askForKey(message) {
    waitingForKey = true;
    ui.keyForm.hidden = false;
    setStatus("closed", "API key needed");
    notice(message || "This server needs an API key.", message ? "error" : "info");
    ui.key.focus();
  }

  ui.keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = ui.key.value;
    ui.key.value = "";
    if (apiKey) store.set("sessionStorage", API_KEY, apiKey);
    else store.remove("sessionStorage", API_KEY);
    ui.keyForm.hidden = true;
    waitingForKey = false;
    retryDelay = 500;
    notice("");
    connect();
  });

  function send(frame) {
    if (ws === null || !opened) return false;
    try {
      ws.send(JSON.stringify(frame));
    } catch {
      return false; // closing: its close event follows
    }
    return true;
  }

  // -- frames ------------------------------------------------------------------
  function receive(frame) {
    if (frame.action === "info" && frame.model) {
      const m = frame.model;
      ui.model.textContent = `${m.name} · ${m.engine} · context ${m.context_length} tokens`;
      const limit = frame.limits && frame.limits.max_new_tokens;
      if (Number.isInteger(limit)) $("max_new_tokens").max = String(limit);
      return;
    }
    if (frame.action !== "infer" || current === null || frame.request_id !== current.id) return;
    if (frame.response_type === "chunk") {
      if (typeof frame.chunk === "string") {
        current.node.appendData(frame.chunk);
        current.text += frame.chunk;
        scrollDown(false);
      }
    } else if (frame.response_type === "full") {
      finish(frame);
    } else if (frame.response_type === "error") {
      fail(frame.error || {});
    }
  }

  function stat(container, name, text) {
    const span = element("span", "", text);
    span.dataset.stat = name;
    container.append(span);
  }

  function seconds(value) {
    return typeof value === "number" ? `${value.toFixed(2)} s` : "–";
  }

  function finish(frame) {
    const exchange = current;
    current = null;
    const response = typeof frame.response === "string" ? frame.response : exchange.text;
    // The chunks concatenate to the response; should they not, show the response.
    if (response !== exchange.text) exchange.node.data = response;
    exchange.turn.classList.remove("streaming");
    const usage = frame.usage || {};
    const timing = frame.timing || {};
    const interrupted = frame.stop_reason === "interrupted";
    if (interrupted) exchange.turn.classList.add("interrupted");
    const stats = element("div", "stats");
    let reason = `stopped: ${frame.stop_reason}`;
    if (interrupted) reason = "interrupted";
    else if (frame.eos_reason === "stop_string") reason = `stopped at ${JSON.stringify(frame.stop_string)}`;
    else if (frame.stop_reason === "num_tokens") reason = "stopped at max_new_tokens";
    else if (frame.stop_reason === "eos") reason = "end of turn";
    stat(stats, "stop", reason);
    const generated = usage.generated_tokens ?? 0;
    stat(stats, "generated", `${generated} tokens`);
    const first = timing.first_token_s;
    const total = timing.total_s;
    let rate = null;
    if (generated > 1 && typeof first === "number" && total > first) rate = (generated - 1) / (total - first);
    else if (generated > 0 && total > 0) rate = generated / total;
    stat(stats, "tps", rate === null ? "– tok/s" : `${rate.toFixed(1)} tok/s`);
    stat(stats, "ttft", `first token ${seconds(first)}`);
    stat(stats, "prompt", `prompt ${usage.prompt_tokens ?? 0} tokens`);
    stat(stats, "cached", `${usage.cached_tokens ?? 0} cached`);
    if (usage.trimmed_tokens) stat(stats, "trimmed", `${usage.trimmed_tokens} trimmed`);
    stat(stats, "total", `total ${seconds(total)}`);
    exchange.turn.append(stats);
    history.push({ role: "user", content: exchange.userText });
    history.push({ role: "assistant", content: response });
    updateButtons();
    scrollDown(false);
  }

  function fail(error) {
    const exchange = current;
    current = null;
    exchange.turn.classList.remove("streaming");
    exchange.turn.classList.add("failed");
    const where = error.field ? ` (${error.field})` : "";
    exchange.turn.append(element("div", "error", `${error.type || "error"}: ${error.message || "the request failed"}${where}`));
    restoreInput(exchange.userText);
    updateButtons();
  }

  // The connection closed under a running request: the server has dropped it.
  // Its text goes back into the box (when that is empty), to be sent again.
  function connectionLost() {
    if (current === null) {
      updateButtons();
      return;
    }
    const exchange = current;
    current = null;
    exchange.turn.classList.remove("streaming");
    exchange.turn.classList.add("failed");
    exchange.turn.append(element("div", "error", "connection lost: your message is back in the box, to send again"));
    restoreInput(exchange.userText);
    updateButtons();
  }

  function restoreInput(text) {
    if (ui.input.value.trim() === "") {
      ui.input.value = text;
      store.set("sessionStorage", DRAFT_KEY, text);
    }
  }

  // -- actions -----------------------------------------------------------------
  function submit() {
    const text = ui.input.value;
    if (current !== null || text.trim() === "") return;
    let fields;
    try {
      fields = samplerFields();
    } catch (error) {
      notice(error.message, "error");
      return;
    }
    const messages = [];
    if (ui.system.value.trim() !== "") messages.push({ role: "system", content: ui.system.value });
    messages.push(...history, { role: "user", content: text });
    const id = `chat-${sequence + 1}`;
    const frame = { action: "infer", request_id: id, messages, stream: true, compact_chunks: true, ...fields };
    if (!send(frame)) {
      // Kept in the box, and sent once the connection is back.
      sendWhenOpen = true;
      notice(`Not connected. ${KEPT}`, "info");
      if (ws === null && !waitingForKey) connect();
      return;
    }
    sequence += 1;
    notice("");
    addTurn("user", text);
    const { turn, node } = addTurn("assistant", "");
    turn.classList.add("streaming");
    turn.dataset.requestId = id;
    current = { id, userText: text, turn, node, text: "" };
    ui.input.value = "";
    store.remove("sessionStorage", DRAFT_KEY);
    updateButtons();
  }

  function stop() {
    if (current !== null) send({ action: "stop", request_id: `stop-${current.id}`, target: current.id });
  }

  function newChat() {
    stop();
    current = null;
    history = [];
    ui.log.replaceChildren();
    updateButtons();
    ui.input.focus();
  }

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  ui.input.addEventListener("input", () => store.set("sessionStorage", DRAFT_KEY, ui.input.value));
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  for (const field of [ui.system, ui.stopStrings, ...NUMBERS.map($)]) {
    field.addEventListener("change", saveSettings);
  }
  // Back online, or the tab shown again: try now rather than at the next retry.
  const retryNow = () => { if (ws === null && !waitingForKey) { retryDelay = 500; connect(); } };
  window.addEventListener("online", retryNow);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) retryNow(); });

  loadSettings();
  ui.input.value = store.get("sessionStorage", DRAFT_KEY) || "";
  updateButtons();
  connect();
  ui.input.focus();
})();
