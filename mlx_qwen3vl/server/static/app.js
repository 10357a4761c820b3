// The playground: one screenshot, grounding (POST /v1/ground) and a streamed chat about it
// (POST /v1/chat/completions, stream: true), both on this server's own API. Model output is only
// ever written with textContent. The API key lives in this tab's memory, in localStorage only
// when the user ticks "remember".
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "mlx_qwen3vl.apiKey";
  const state = {key: null, image: null, dataUrl: null, blobUrl: null, chat: [], busy: false, job: null};

  try {
    state.key = window.localStorage.getItem(KEY_STORE);
  } catch (e) { /* storage off: memory only */ }

  // ------------------------------------------------------------------------------- API calls
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function headers() {
    const h = {"Content-Type": "application/json"};
    if (state.key) h.Authorization = "Bearer " + state.key;
    return h;
  }

  async function failure(res) {
    let message = `HTTP ${res.status}`;
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (e) { /* not JSON */ }
    if (res.status === 401) askKey(state.key ? "that key was refused; try again" : null);
    return new ApiError(res.status, message);
  }

  async function call(method, path, body, signal) {
    const init = {method, headers: headers(), signal};
    if (body !== undefined) init.body = JSON.stringify(body);
    const res = await fetch(path, init);
    if (!res.ok) throw await failure(res);
    return res.json();
  }

  function showError(err) {
    const box = $("error");
    box.textContent = err ? String(err.message || err) : "";
    box.hidden = !err;
    if (err) notice(null);
  }

  function notice(text) {  // a calm line (a stopped request), not an error
    $("notice").textContent = text || "";
    $("notice").hidden = !text;
  }

  // ------------------------------------------------------------------------------- the key
  function askKey(problem) {
    $("key-form").hidden = false;
    $("key-error").textContent = problem || "";
    $("key-error").hidden = !problem;
    $("key").focus();
  }

  async function checkAccess() {
    try {
      const models = await call("GET", "/v1/models");
      $("model").textContent = models.data && models.data.length ? models.data[0].id : "";
      $("key-form").hidden = true;
      $("forget-key").hidden = !state.key;
      return true;
    } catch (err) {
      if (err.status !== 401) showError(err);
      return false;
    }
  }

  $("key-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    state.key = $("key").value.trim() || null;
    $("key").value = "";
    try {
      if ($("remember").checked && state.key) window.localStorage.setItem(KEY_STORE, state.key);
      else window.localStorage.removeItem(KEY_STORE);
    } catch (e) { /* storage off */ }
    if (await checkAccess()) showError(null);
  });

  $("forget-key").addEventListener("click", () => {
    state.key = null;
    try { window.localStorage.removeItem(KEY_STORE); } catch (e) { /* storage off */ }
    $("forget-key").hidden = true;
    checkAccess();
  });

  // ------------------------------------------------------------------------------- the image
  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(new Error("the file could not be read"));
      reader.readAsDataURL(file);
    });
  }

  function setImage(file) {
    if (!file) return;
    if (!file.type.startsWith("image/")) {
      showError(new Error(`${file.name || "that"} is not an image (${file.type || "unknown type"})`));
      return;
    }
    showError(null);
    if (state.blobUrl) URL.revokeObjectURL(state.blobUrl);
    state.blobUrl = URL.createObjectURL(file);
    state.image = file;
    state.dataUrl = readDataUrl(file);
    clearMarks();
    $("ground-result").hidden = true;
    resetChat();
    const img = $("shot");
    img.onload = () => {
      $("image-info").textContent = `${file.name || "pasted image"}: ${img.naturalWidth} × ${img.naturalHeight} px`;
    };
    img.onerror = () => {  // e.g. a text file named .png: said now, not at Locate
      if (state.image !== file) return;
      state.image = state.dataUrl = null;
      $("stage").hidden = true;
      $("image-info").textContent = "";
      showError(new Error(`${file.name || "that file"} could not be read as an image; pick a PNG, JPEG, WebP or GIF`));
    };
    img.src = state.blobUrl;
    $("stage").hidden = false;
  }

  $("file").addEventListener("change", (ev) => setImage(ev.target.files[0]));
  document.addEventListener("dragover", (ev) => {  // a drop anywhere on the page
    ev.preventDefault();
    $("drop").classList.add("over");
  });
  document.addEventListener("dragleave", () => $("drop").classList.remove("over"));
  document.addEventListener("drop", (ev) => {
    ev.preventDefault();
    $("drop").classList.remove("over");
    if (ev.dataTransfer && ev.dataTransfer.files.length) setImage(ev.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (ev) => {
    const items = ev.clipboardData ? Array.from(ev.clipboardData.items) : [];
    const item = items.find((i) => i.kind === "file" && i.type.startsWith("image/"));
    if (item) {
      ev.preventDefault();
      setImage(item.getAsFile());
    }
  });

  // ------------------------------------------------------------------------------- drawing
  function place(el, left, top, width, height) {
    el.style.left = left + "%";
    el.style.top = top + "%";
    if (width !== undefined) {
      el.style.width = width + "%";
      el.style.height = height + "%";
    }
    el.hidden = false;
  }

  function placeBox(el, box, w, h) {  // [x1, y1, x2, y2], first and last pixel on each axis
    const [x1, y1, x2, y2] = box;
    place(el, (100 * x1) / w, (100 * y1) / h, (100 * (x2 - x1 + 1)) / w, (100 * (y2 - y1 + 1)) / h);
  }

  function clearMarks() {
    for (const id of ["point", "box", "zoom-window", "failure"]) $(id).hidden = true;
    $("stage").classList.remove("failed");
  }

  function draw(r) {  // marks in percent of the image: they follow it at every displayed size
    clearMarks();
    const [w, h] = r.image_size;
    if (r.zoom && r.zoom.window) placeBox($("zoom-window"), r.zoom.window, w, h);
    if (r.box) placeBox($("box"), r.box, w, h);
    if (r.point) {
      place($("point"), (100 * (r.point[0] + 0.5)) / w, (100 * (r.point[1] + 0.5)) / h);  // the pixel's centre
    } else {
      $("failure").textContent = r.note || `no point (${r.status})`;
      $("failure").hidden = false;
      $("stage").classList.add("failed");
    }
  }

  function cell(row, text, kind = "td") {
    const el = document.createElement(kind);
    el.textContent = text;
    row.appendChild(el);
    return el;
  }

  function report(r) {
    const status = $("status");
    status.className = "status " + (r.point ? "ok" : "failed");
    let text;
    if (r.point) {
      text = `point (${r.point[0]}, ${r.point[1]})` + (r.box ? `, box (${r.box.join(", ")})` : "");
      if (r.zoom) {
        text += r.zoom.window ? `, from pass ${r.zoom.pass}` : "";
        if (r.zoom.pass === 1 && r.zoom.passes.length > 1) text += ` (pass 2: ${r.zoom.passes[1].status})`;
      }
    } else {
      text = `${r.status}: ${r.note || "no point"}`;
    }
    status.textContent = text;
    const passes = r.zoom ? r.zoom.passes
      : [{...r, timing: {...r.timing, cached_tokens: r.usage.prompt_tokens_details.cached_tokens}}];
    $("answer").textContent = passes.length > 1 ? passes.map((p, i) => `pass ${i + 1}: ${p.answer}`).join("\n")
      : r.answer;
    // One column per pass (and their total): it fits a phone's width.
    const cols = passes.map((p, i) => ({name: `pass ${i + 1}`, size: `${p.image_size[0]}×${p.image_size[1]}`,
      t: p.timing, cached: p.timing.cached_tokens}));
    if (passes.length > 1) {
      cols.push({name: "both", size: "", t: r.timing, cached: r.usage.prompt_tokens_details.cached_tokens});
    }
    const rows = [
      ["image", (c) => c.size],
      ["prompt tokens (cached)", (c) => `${c.t.prompt_tokens} (${c.cached})`],
      ["generated tokens", (c) => String(c.t.generation_tokens)],
      ["seconds", (c) => c.t.seconds.toFixed(3)],
      ["prompt tokens/s", (c) => c.t.prompt_tps.toFixed(1)],
      ["generation tokens/s", (c) => c.t.generation_tps.toFixed(1)],
    ];
    const head = document.createElement("tr");
    cell(head, "", "th");
    for (const c of cols) cell(head, c.name, "th").classList.toggle("total", c.name === "both");
    $("timings").querySelector("thead").replaceChildren(head);
    const body = $("timings").querySelector("tbody");
    body.replaceChildren();
    for (const [label, value] of rows) {
      const row = document.createElement("tr");
      cell(row, label, "th");
      for (const c of cols) cell(row, value(c)).classList.toggle("total", c.name === "both");
      body.appendChild(row);
    }
    $("ground-result").hidden = false;
  }

  function busy(on) {
    state.busy = on;
    $("locate").disabled = on;
    $("send").disabled = on;
    document.body.classList.toggle("busy", on);
  }

  // A request in flight: spinner, elapsed seconds and Stop (which aborts it: the server sees the
  // connection close). Returns the job: its AbortSignal, and end() once the request has settled.
  function start(label) {
    busy(true);
    notice(null);
    const controller = new AbortController();
    const t0 = performance.now();
    const seconds = () => ((performance.now() - t0) / 1000).toFixed(1);
    const tick = () => { $("progress-text").textContent = `${label}… ${seconds()} s`; };
    tick();
    const timer = setInterval(tick, 100);
    $("progress").hidden = false;
    const job = {
      signal: controller.signal, seconds,
      stop: () => controller.abort(),
      end: () => {
        clearInterval(timer);
        $("progress").hidden = true;
        state.job = null;
        busy(false);
      },
    };
    state.job = job;
    return job;
  }

  $("stop").addEventListener("click", () => { if (state.job) state.job.stop(); });

  const aborted = (err) => err && err.name === "AbortError";

  $("ground-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (state.busy) return;
    const instruction = $("instruction").value.trim();
    if (!state.dataUrl) return showError(new Error("first drop, paste or pick a screenshot"));
    if (!instruction) return showError(new Error("type an instruction: what to find on the screenshot"));
    showError(null);
    const job = start("Locating");
    try {
      const fraction = Number($("zoom-fraction").value);
      const r = await call("POST", "/v1/ground", {
        image: await state.dataUrl, instruction, format: $("format").value,
        zoom: $("zoom").checked ? (fraction > 0 && fraction <= 1 ? fraction : true) : false,
      }, job.signal);
      draw(r);
      report(r);
    } catch (err) {
      if (aborted(err)) notice(`Stopped after ${job.seconds()} s.`);
      else showError(err);
    } finally {
      job.end();
    }
  });

  // ------------------------------------------------------------------------------- chat
  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.textContent = text;
    $("chat-log").appendChild(div);
    return div;
  }

  function resetChat() {
    state.chat = [];
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
  }

  $("chat-clear").addEventListener("click", resetChat);

  $("question").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("chat-form").requestSubmit();
    }
  });

  async function stream(body, onDelta, signal) {
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
      signal});
    if (!res.ok) throw await failure(res);
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", usage = null, chunks = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return {usage, chunks};
          const obj = JSON.parse(data);
          if (obj.error) throw new ApiError(500, obj.error.message);
          if (obj.usage) usage = obj.usage;
          const delta = obj.choices && obj.choices[0] && obj.choices[0].delta;
          if (delta && delta.content) {
            chunks += 1;
            onDelta(delta.content);
          }
        }
      }
    }
    return {usage, chunks};
  }

  $("chat-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (state.busy) return;
    const question = $("question").value.trim();
    if (!question) return;
    showError(null);
    const content = state.chat.length === 0 && state.dataUrl
      ? [{type: "image_url", image_url: {url: await state.dataUrl}}, {type: "text", text: question}]
      : question;
    state.chat.push({role: "user", content});
    const asked = bubble("user", question);
    $("question").value = "";
    const out = bubble("assistant", "");
    out.classList.add("streaming");
    const job = start("Answering");
    const t0 = performance.now();
    let first = null, text = "";
    try {
      const {usage, chunks} = await stream(
        {messages: state.chat, stream: true, stream_options: {include_usage: true}, temperature: 0, max_tokens: 512},
        (piece) => {
          first = first || performance.now();
          text += piece;
          out.textContent = text;
        }, job.signal);
      state.chat.push({role: "assistant", content: text});
      const end = performance.now();
      const n = usage ? usage.completion_tokens : chunks;
      const rate = first && n > 1 && end > first ? ((n - 1) * 1000) / (end - first) : 0;
      $("chat-stats").textContent = `${n} tokens in ${chunks} chunks` +
        (usage ? `, prompt ${usage.prompt_tokens} (${usage.prompt_tokens_details.cached_tokens} cached)` : "") +
        (first ? `, first after ${((first - t0) / 1000).toFixed(2)} s, ${rate.toFixed(1)} tok/s` : "");
    } catch (err) {
      state.chat.pop();  // a stopped or failed turn is left out of the chat, as the command line's Ctrl-C does
      if (aborted(err)) {
        out.textContent = text ? `${text} [stopped]` : "[stopped]";
        out.classList.add("stopped");
        asked.classList.add("stopped");
        notice(`Stopped after ${job.seconds()} s; that question and its answer are left out of the chat.`);
      } else {
        out.remove();
        showError(err);
      }
    } finally {
      out.classList.remove("streaming");
      job.end();
    }
  });

  // ------------------------------------------------------------------------------- tabs
  function showTab(name) {
    for (const t of ["ground", "chat"]) {
      $("tab-" + t).setAttribute("aria-selected", String(t === name));
      $(t + "-panel").hidden = t !== name;
    }
    $("stage").classList.toggle("plain", name !== "ground");  // the marks belong to the Ground tab
  }

  $("tab-ground").addEventListener("click", () => showTab("ground"));
  $("tab-chat").addEventListener("click", () => showTab("chat"));

  checkAccess();
})();
