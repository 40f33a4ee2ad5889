// The TokenRouter assistant page: microphone and speaker for the voice pipeline, and its view.
// Everything here is served by the local app (no CDN); the address holds the launch's token, so
// relative URLs carry it to every request.
"use strict";

const BASE = location.pathname.endsWith("/") ? location.pathname : location.pathname.replace(/[^/]*$/, "");
const $ = (sel) => document.querySelector(sel);
const STAGES = ["speech_end", "endpoint_decided", "asr_final", "llm_first_token", "first_clause_ready", "tts_first_audio", "first_audio_out"];

const S = {
  ws: null, hello: null, settings: null, choices: null, devices: null,
  playCtx: null, player: null, capCtx: null, capNode: null, micStream: null,
  current: null, retries: 0, takenOver: false, playSeq: 0,
};
// What tests (and the curious) can read: reply audio received and played, per page load.
window.trStats = { firstPlayDelayMs: null, chunks: 0, received: 0, played: 0, peak: 0, rms: 0, turns: 0, progressReports: 0 };

// ------------------------------------------------------------------ the page's state

// One model of what is true now. Messages from the app and the person's actions change it (`update`);
// `render` draws the status pill, badges, banner, overlay and prompts from it alone, so nothing on screen
// is left over from an earlier transition (a mode switch, a cloud that came back, a refused microphone).
const view = {
  conn: "connecting", // connecting | loading | ready | retrying | gone | taken-over | stopped
  connMessage: "", // why it is gone or stopped
  phase: "starting", // starting | idle | hearing | answering | speaking: the pipeline's turn
  mode: "hands-free", // the talk mode in force (settings)
  audioMode: "browser", // browser: the page's microphone and speaker | device: this machine's (sounddevice)
  mic: "unknown", // unknown | on | refused | missing | unavailable | failed | stopped
  micMessage: "", // what to do about a microphone that is not on
  sound: "off", // off | needs-click | on: the browser plays sound only after a click on the page
  ptt: false, // the space bar is held (push-to-talk)
  cloud: null, // {state, label, error} from the app
  pendingFile: null, // a file dropped before the assistant could take it: asked once it listens
  turnsShown: 0, // turns on screen since the conversation was last reset
};
window.trView = view; // tests read the state the page renders

function update(changes) {
  Object.assign(view, changes);
  render();
}

const MIC_LABEL = { on: "mic: on", unknown: "mic: …", refused: "mic: refused", missing: "mic: none",
  unavailable: "mic: unavailable", failed: "mic: failed", stopped: "mic: stopped" };
const CLOUD_LABEL = { connected: "cloud: connected", reachable: "cloud: reachable", pending: "cloud: connects at the next answer",
  offline: "offline: device answers alone", "device-only": "device only" };

function statusOf(v) {
  switch (v.conn) {
    case "connecting": return ["connecting", "connecting…"];
    case "loading": return ["loading", "loading models…"];
    case "retrying": case "gone": return ["disconnected", "disconnected"];
    case "taken-over": return ["idle", "in another tab"];
    case "stopped": return ["disconnected", "stopped"];
    default: break;
  }
  if (v.sound === "needs-click") return ["idle", "click Start"];
  if (v.phase === "starting") return ["loading", "starting…"];
  if (v.phase === "hearing") return ["hearing", "hearing you"];
  if (v.phase === "answering") return ["answering", "answering"];
  if (v.phase === "speaking") return ["speaking", "speaking"];
  if (!micUsable(v)) return ["idle", "no microphone: drop a file"];
  if (v.mode === "push-to-talk") return v.ptt ? ["hearing", "listening (space held)"] : ["listening", "hold space to talk"];
  return ["listening", "listening"];
}

function micUsable(v) {
  return v.audioMode === "device" || v.mic === "on";
}

function render() {
  const v = view;
  const [state, text] = statusOf(v);
  const st = $("#status");
  st.dataset.state = state;
  st.textContent = text;

  const mic = $("#mic-badge");
  mic.dataset.state = micUsable(v) ? "on" : "off";
  mic.textContent = v.audioMode === "device" ? "mic: this machine's" : MIC_LABEL[v.mic] || `mic: ${v.mic}`;

  const cb = $("#cloud-badge");
  if (v.cloud) {
    cb.dataset.state = v.cloud.state;
    cb.textContent = CLOUD_LABEL[v.cloud.state] || v.cloud.state;
    cb.title = `${v.cloud.label}${v.cloud.error ? " — " + v.cloud.error : ""}`;
  }

  document.body.dataset.talkMode = v.mode;
  document.body.dataset.ptt = v.ptt ? "down" : "up";
  $("#mode-hands-free").classList.toggle("on", v.mode === "hands-free");
  $("#mode-ptt").classList.toggle("on", v.mode === "push-to-talk");
  $("#ptt-hint").hidden = v.mode !== "push-to-talk" || v.conn !== "ready";

  renderBanner(v);

  // The start overlay: shown only while the browser waits for a click; it already says what is wrong
  // with the microphone and what happens to a dropped file, so nothing waits for the click to be explained.
  $("#start-overlay").hidden = v.sound !== "needs-click" || v.conn !== "ready";
  $("#start-mic").textContent = v.audioMode === "browser" && v.mic !== "on" && v.mic !== "unknown" ? v.micMessage : "";
  $("#start-mic").hidden = !$("#start-mic").textContent;
  $("#start-file").textContent = v.pendingFile ? `“${v.pendingFile.name}” will be asked once you click Start.` : "";
  $("#start-file").hidden = !v.pendingFile;

  // Help where the conversation goes: the microphone's problem, or how to begin.
  const help = $("#mic-help");
  help.textContent = v.audioMode === "browser" && v.conn === "ready" && v.mic !== "on" && v.mic !== "unknown" ? v.micMessage : "";
  help.hidden = !help.textContent;
  const empty = $("#empty");
  empty.hidden = v.turnsShown > 0 || v.conn !== "ready";
  empty.textContent = emptyPrompt(v);
}

function emptyPrompt(v) {
  if (!micUsable(v)) return "Drop an audio file (WAV, FLAC, OGG, MP3) anywhere on the page to ask it; the answer is spoken back.";
  if (v.mode === "push-to-talk") return "Hold the space bar and ask a question; let go when you are done. The answer is spoken back.";
  return "Just talk: ask a question, for example “what's the capital of Australia?” When you stop, the answer is spoken back.";
}

function renderBanner(v) {
  const b = $("#banner");
  b.textContent = "";
  let text = "";
  let action = null;
  if (v.conn === "taken-over") {
    text = "The assistant is now in use in another tab.";
    action = ["Use it here", () => { S.takenOver = false; connect(); }];
  } else if (v.conn === "retrying") text = "Lost the connection to the assistant; retrying…";
  else if (v.conn === "gone") text = "The assistant is not running. Start it again with “tokenrouter-edge app” and open the address it prints.";
  else if (v.conn === "stopped") text = v.connMessage;
  b.hidden = !text;
  if (!text) return;
  b.textContent = text;
  if (action) {
    const btn = document.createElement("button");
    btn.textContent = action[0];
    btn.onclick = action[1];
    b.append(" ", btn);
  }
}

// ------------------------------------------------------------------ connection

function connect() {
  update({ conn: "connecting", phase: "starting" });
  const ws = new WebSocket(`ws://${location.host}${BASE}ws`);
  ws.binaryType = "arraybuffer";
  S.ws = ws;
  ws.onopen = () => { S.retries = 0; };
  ws.onmessage = (e) => (typeof e.data === "string" ? onMessage(JSON.parse(e.data)) : onAudio(e.data));
  ws.onclose = (e) => {
    if (S.ws !== ws) return;
    S.ws = null;
    flushPlayer();
    if (e.code === 4001 || S.takenOver) { update({ conn: "taken-over" }); return; }
    if (view.conn === "stopped") return;
    if (S.retries++ < 5) {
      update({ conn: "retrying" });
      setTimeout(connect, 1000 * S.retries);
    } else update({ conn: "gone" });
  };
}

function send(obj) {
  if (S.ws && S.ws.readyState === WebSocket.OPEN) S.ws.send(JSON.stringify(obj));
}

function onMessage(m) {
  switch (m.type) {
    case "loading": update({ conn: "loading" }); break;
    case "fatal": update({ conn: "stopped", connMessage: m.message }); break;
    case "hello": onHello(m); break;
    case "listening": update({ phase: "idle" }); askPendingFile(); break;
    case "speech_started": update({ phase: "hearing" }); renderPartial("", ""); break;
    case "partial": renderPartial(m.stable, m.unstable); break;
    case "final": renderPartial("", ""); if (m.text) { newTurn(m.text); update({ phase: "answering" }); } break;
    case "token": addToken(m); break;
    case "interruption": onInterruption(m); break;
    case "turn_done": onTurnDone(m); break;
    case "notice": notice(m.level, m.message); break;
    case "cloud": update({ cloud: m }); break;
    case "history": renderMemory(m.history); break;
    case "conversation_reset": markReset(); renderMemory([]); break; // one message: the page never shows half a reset
    case "settings": applySettings(m.settings); break;
    case "play_turn": S.playSeq = m.seq; if (S.player) S.player.port.postMessage({ type: "turn", seq: m.seq }); break;
    case "play_pause": if (S.player) S.player.port.postMessage({ type: "pause", paused: m.paused }); break;
    case "play_flush": if (S.player) S.player.port.postMessage({ type: "flush", seq: m.seq }); break;
    case "taken_over": S.takenOver = true; break;
    default: break; // e.g. the end-of-turn judgement: not shown
  }
}

async function onHello(m) {
  S.hello = m;
  S.choices = m.choices || {};
  S.devices = m.devices;
  document.body.dataset.audioMode = m.audio;
  applySettings(m.settings);
  renderMemory(m.history);
  renderPastTurns(m.history, m.turns || []);
  update({ conn: "ready", audioMode: m.audio, cloud: m.cloud });
  if (m.audio !== "browser") {
    update({ sound: "on" });
    send({ type: "ready", mic: false });
    return;
  }
  const micError = await startAudio();
  send({ type: "ready", mic: view.mic === "on", mic_error: micError });
}

// ------------------------------------------------------------------ audio

async function startAudio() {
  try {
    if (!S.playCtx) {
      S.playCtx = new AudioContext({ sampleRate: S.hello.rate_out, latencyHint: "interactive" });
      await S.playCtx.audioWorklet.addModule(BASE + "static/worklets.js");
      S.player = new AudioWorkletNode(S.playCtx, "tr-player", { numberOfInputs: 0, outputChannelCount: [1] });
      S.player.connect(S.playCtx.destination);
      S.player.port.onmessage = onPlayerReport;
    }
  } catch (e) {
    notice("error", `This browser cannot play the replies here (${e.name}: ${e.message}).`);
  }
  const micError = await startMic();
  await audioRunning();
  document.body.dataset.audio = "on";
  return micError;
}

// The browser plays sound only after a click on the page: ask for one when it is needed.
function audioRunning() {
  const ctxs = [S.playCtx, S.capCtx].filter(Boolean);
  const running = () => ctxs.every((c) => c.state === "running");
  if (running()) { update({ sound: "on" }); return Promise.resolve(); }
  Promise.all(ctxs.map((c) => c.resume())).catch(() => {});
  return new Promise((resolve) => {
    const check = () => {
      if (running()) { update({ sound: "on" }); resolve(); return true; }
      return false;
    };
    setTimeout(() => { if (!check()) update({ sound: "needs-click" }); }, 300);
    $("#start").onclick = async () => { await Promise.all(ctxs.map((c) => c.resume())); check(); };
  });
}

// Opens the microphone; returns null, or what is wrong and what to do (also shown at once, before any click).
async function startMic() {
  if (S.micStream) return null;
  const err = await openMic();
  if (err) update({ mic: err[0], micMessage: err[1] });
  return err ? err[1] : null;
}

async function openMic() {
  const fileToo = "Until then you can drop an audio file (WAV, FLAC, OGG, MP3) on the page to ask a question.";
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    return ["unavailable", `This browser gives the page no microphone. ${fileToo}`];
  }
  const aec = !S.settings || S.settings.echo_cancellation !== false;
  try {
    S.micStream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: aec, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
    });
  } catch (e) {
    if (e.name === "NotAllowedError" || e.name === "SecurityError") {
      return ["refused", `Microphone access was refused. Allow it for this page (the icon left of the address) and reload. ${fileToo}`];
    }
    if (e.name === "NotFoundError") return ["missing", `No microphone was found. Plug one in and reload. ${fileToo}`];
    return ["failed", `The microphone could not be opened (${e.name}: ${e.message}). ${fileToo}`];
  }
  try {
    try { S.capCtx = new AudioContext({ sampleRate: 16000, latencyHint: "interactive" }); } catch (e) { S.capCtx = new AudioContext(); }
    await S.capCtx.audioWorklet.addModule(BASE + "static/worklets.js");
    const src = S.capCtx.createMediaStreamSource(S.micStream);
    S.capNode = new AudioWorkletNode(S.capCtx, "tr-capture", { numberOfOutputs: 0 });
    src.connect(S.capNode);
    S.capNode.port.onmessage = (e) => { if (S.ws && S.ws.readyState === WebSocket.OPEN) S.ws.send(e.data); };
  } catch (e) {
    stopMic();
    return ["failed", `The microphone could not be read (${e.name}: ${e.message}). ${fileToo}`];
  }
  S.micStream.getAudioTracks()[0].onended = () => {
    stopMic();
    update({ mic: "stopped", micMessage: "The microphone stopped (unplugged, or taken by another program). Reload to use it again, or drop an audio file." });
    send({ type: "mic", on: false });
    notice("warning", "The microphone stopped (unplugged, or taken by another program).");
  };
  update({ mic: "on", micMessage: "" });
  return null;
}

function stopMic() {
  if (S.micStream) S.micStream.getTracks().forEach((t) => t.stop());
  if (S.capCtx) S.capCtx.close().catch(() => {});
  S.micStream = S.capCtx = S.capNode = null;
}

async function restartMic() {
  stopMic();
  const err = await startMic();
  if (err) notice("warning", err);
  if (S.capCtx && S.capCtx.state !== "running") await audioRunning();
  send({ type: "mic", on: view.mic === "on" });
}

function onAudio(buf) {
  const seq = new DataView(buf).getUint32(0, true);
  const pcm = new Int16Array(buf, 4);
  const f = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) f[i] = pcm[i] / 32768;
  trStats.chunks += 1;
  trStats.received += f.length;
  if (seq !== S.firstChunkSeq) { S.firstChunkSeq = seq; S.firstChunkAt = performance.now(); }
  if (S.player) S.player.port.postMessage({ type: "chunk", seq, samples: f }, [f.buffer]);
  if (seq === S.playSeq && view.phase !== "speaking") update({ phase: "speaking" });
}

function onPlayerReport(e) {
  const r = e.data;
  trStats.progressReports += 1;
  trStats.peak = Math.max(trStats.peak, r.peak);
  trStats.rms = r.rms;
  trStats.played = r.total;
  if (r.first && r.seq === S.firstChunkSeq) trStats.firstPlayDelayMs = performance.now() - S.firstChunkAt;
  // "at": when the player reported, on the machine's clock (the app converts it: the report's trip is not the wait)
  send({ type: "progress", seq: r.seq, played: r.played, first: r.first, at: performance.timeOrigin + performance.now() });
}

function flushPlayer() {
  if (S.player) S.player.port.postMessage({ type: "flush", seq: S.playSeq });
}

// ------------------------------------------------------------------ the conversation

function newTurn(userText) {
  const el = document.createElement("div");
  el.className = "turn";
  el.innerHTML = '<div class="msg user"><span class="who">you</span><span class="text"></span></div>'
    + '<div class="msg assistant"><span class="who">assistant</span><span class="answer"></span><div class="kept" hidden></div></div>';
  el.querySelector(".user .text").textContent = userText;
  $("#turns").appendChild(el);
  S.current = { el, answer: el.querySelector(".answer"), tokens: [] };
  update({ turnsShown: view.turnsShown + 1 });
  el.scrollIntoView({ block: "end" });
}

function tokenTitle(route, score, extra, tier) {
  const who = tier >= 2 ? `written by tier ${tier} (a model above the cloud)`
    : route === "cloud" ? "written by the cloud" : "written on the device";
  const sc = score === null || score === undefined ? "no router score" : `router score ${score.toFixed(3)}`;
  return `${sc} · ${who}${extra ? " · " + extra : ""}`;
}

function addToken(m) {
  if (!S.current) newTurn("(…)");
  const span = document.createElement("span");
  span.className = "tok " + m.route;
  const extra = [];
  if (m.lookahead && m.route === "cloud") { span.classList.add("lookahead"); extra.push("the cloud's lookahead guess"); }
  else if (m.lookahead) extra.push("the cloud's guess was near enough: the device kept its token");
  if (m.overruled) { span.classList.add("overruled"); extra.push("the cloud's check overruled the device here"); }
  span.dataset.i = m.i;
  span.dataset.route = m.route;
  if (m.score !== null) span.dataset.score = m.score;
  span.title = tokenTitle(m.route, m.score, extra.join(", "));
  span.textContent = m.text;
  S.current.answer.appendChild(span);
  S.current.tokens[m.i] = span;
}

function onInterruption(m) {
  if (!S.current) return;
  S.current.el.classList.add("interrupted");
  const kept = m.rejoined ? "you went on, so none is kept: your whole request is answered next" : `kept: “${m.heard}”`;
  notice("info", `Interrupted (reply paused ${Math.round(m.stop_ms)} ms after you started); ${kept}`);
}

function onTurnDone(m) {
  trStats.turns += 1;
  update({ phase: "idle" });
  if (m.reset) { S.current = null; markReset(); return; }
  if (m.answer && S.current) renderAnswer(S.current, m);
  renderLastTurn(m);
  S.current = null;
}

// The final record decides: each token's route, the cloud's guesses and its overrules. Used for a live turn
// (over the tokens already streamed) and for a past one (a reloaded page), so both look the same.
function renderAnswer(t, m) {
  const a = m.answer;
  a.pieces.forEach((text, i) => {
    let span = t.tokens[i];
    if (!span) { addToken({ i, text, route: a.routes[i], score: a.scores[i] }); span = t.tokens[i]; }
    span.textContent = text;
    span.className = "tok " + a.routes[i];
    span.dataset.route = a.routes[i];
    const extra = [];
    if (a.lookahead_positions.includes(i)) {
      if (a.routes[i] === "cloud") { span.classList.add("lookahead"); extra.push("the cloud's lookahead guess"); }
      else extra.push("the cloud's guess was near enough: the device kept its token");
    }
    if (a.overruled_positions.includes(i)) { span.classList.add("overruled"); extra.push("the cloud's check overruled the device here"); }
    // a pool (--tier): a tier above the cloud wrote it; its own colour, and the legend says so
    const tier = (a.tiers || [])[i] || 0;
    if (tier >= 2) { span.classList.add("tier"); span.dataset.tier = tier; $("#legend-tier").hidden = false; }
    span.title = tokenTitle(a.routes[i], a.scores[i], extra.join(", "), tier);
  });
  // ...and the order: a token whose live event was missed was appended last; put each at its index
  a.pieces.forEach((_, i) => t.answer.appendChild(t.tokens[i]));
  if (a.finish_reason === "length") t.el.classList.add("cut");
  // a base model wrote some of it (generator.base_model_warnings): say so under the answer, once
  t.el.querySelectorAll(".warning").forEach((el) => el.remove());
  for (const w of a.warnings || []) {
    const p = document.createElement("p");
    p.className = "warning";
    p.textContent = `Warning: ${w}.`;
    t.el.appendChild(p);
  }
  if (m.interrupted) markUnplayed(t, m.spoken_text, m.rejoined);
}

// After a barge-in only what was played stays in the history: dim the rest of the answer. When the person
// went on with the request (rejoined), none of it stays: the next turn answers the whole request.
function markUnplayed(t, kept, rejoined) {
  const keptChars = kept.replace(/\s+/g, "").length;
  let n = 0;
  for (const span of t.tokens) {
    if (!span) continue;
    n += span.textContent.replace(/\s+/g, "").length;
    if (n > keptChars) span.classList.add("unplayed");
  }
  t.el.classList.add("interrupted");
  const k = t.el.querySelector(".kept");
  k.hidden = false;
  k.textContent = rejoined
    ? "you went on: this reply was dropped, the next one answers your whole request"
    : `interrupted · kept in history: “${kept}”`;
}

// A reloaded page (or one that took over) shows the conversation the assistant remembers: each turn from its
// record (cloud marks and all) where the app has one, else as the history holds it; the last turn's panel too.
function renderPastTurns(history, records) {
  if ($("#turns").children.length) return;
  let last = null;
  for (let i = 0; i + 1 < (history || []).length; i += 2) {
    newTurn(history[i].content);
    const rec = records[i / 2];
    if (rec && rec.answer) { renderAnswer(S.current, rec); last = rec; }
    else S.current.answer.textContent = history[i + 1].content;
    S.current.el.classList.add("past");
  }
  S.current = null;
  if (last) renderLastTurn(last);
}

// "start over" or Reset: the turns above stay readable, marked as forgotten, below a divider.
function markReset() {
  const turns = $("#turns");
  if (!turns.querySelector(".turn:not(.forgotten)")) return;
  turns.querySelectorAll(".turn").forEach((el) => el.classList.add("forgotten"));
  const hr = document.createElement("div");
  hr.className = "reset-divider";
  hr.textContent = "conversation reset: the assistant has forgotten the turns above";
  turns.appendChild(hr);
  update({ turnsShown: 0 });
  hr.scrollIntoView({ block: "end" });
}

function renderPartial(stable, unstable) {
  $("#partial .stable").textContent = stable;
  $("#partial .unstable").textContent = unstable;
}

// Stages in the order they ended (the endpoint can be decided after the transcript is final); missing ones last.
function renderWaterfall(timings) {
  const vals = STAGES.map((s) => timings[s]).filter((v) => v !== null && v !== undefined);
  const lo = Math.min(0, ...vals);
  const hi = Math.max(1, ...vals);
  const wf = $("#waterfall");
  wf.classList.remove("empty");
  const rows = [];
  for (const s of STAGES) {
    const row = $(`#waterfall .stage[data-stage="${s}"]`);
    const v = timings[s];
    const bar = row.querySelector(".bar");
    rows.push([v === null || v === undefined ? Infinity : v, STAGES.indexOf(s), row]);
    if (v === null || v === undefined) {
      row.dataset.ms = "";
      bar.style.width = "0";
      row.querySelector(".ms").textContent = "–";
      continue;
    }
    row.dataset.ms = v;
    bar.style.left = `${((Math.min(0, v) - lo) / (hi - lo)) * 100}%`;
    bar.style.width = `${(Math.abs(v) / (hi - lo)) * 100}%`;
    row.querySelector(".ms").textContent = `${Math.round(v)}`;
  }
  rows.sort((x, y) => x[0] - y[0] || x[1] - y[1]).forEach(([, , row]) => wf.appendChild(row));
}

// Why the turn ended when it did: the silence waited and the signals that set it (endofturn.py).
function describeEndOfTurn(d) {
  if (!d) return "–";
  if (d.mode !== "smart") return `on silence (${d.wait_ms} ms)${d.note ? ": " + d.note : ""}`;
  const why = [];
  if (d.probability !== null && d.probability !== undefined) why.push(`Smart Turn ${d.probability.toFixed(2)}`);
  if (d.text_end !== null && d.text_end !== undefined) why.push(`text P(end) ${d.text_end.toFixed(3)}`);
  if (d.text_sure_end) why.push("a sure question");
  if (d.text_misheard) why.push("last word likely misheard");
  return `after ${d.wait_ms} ms of silence` + (why.length ? ` · ${why.join(" · ")}` : "") + (d.note ? ` · ${d.note}` : "");
}

function fmtBytes(n) {
  return n < 1024 ? `${n} B` : `${(n / 1024).toFixed(1)} KB`;
}

const pct = (x) => `${Math.round(x * 100)}%`;

// What the answer was: complete, cut at the token limit, interrupted, or finished by the device alone.
function answerState(a, m) {
  if (a.degraded) return ["degraded", "degraded: the device finished alone"];
  if (m.interrupted) return ["interrupted", "interrupted"];
  if (a.finish_reason === "length") return ["cut", `cut at the limit (${a.n_tokens} tokens): not a complete answer`];
  return ["complete", "complete"];
}

function renderLastTurn(m) {
  renderWaterfall(m.timings_ms);
  const a = m.answer;
  const st = $("#answer-state");
  if (!a) { st.textContent = "–"; st.dataset.state = ""; return; }
  const c = m.cloud_share;
  $("#cloud-share").textContent = `${pct(c.answer)} (${a.n_cloud_tokens}/${a.n_tokens})`;
  $("#cloud-share-bar").style.width = `${c.answer * 100}%`;
  $("#cloud-target").textContent = c.since_target === null
    ? `target ${pct(c.target)}`
    : `target ${pct(c.target)} · ${pct(c.since_target)} of ${c.since_target_tokens} tokens since it was set`;
  $("#cloud-why").textContent = c.why.join("; ");
  $("#round-trips").textContent = `${a.round_trips}`;
  $("#bytes").textContent = `${fmtBytes(a.bytes_up)} / ${fmtBytes(a.bytes_down)}`;
  [st.dataset.state, st.textContent] = answerState(a, m);
  $("#end-of-turn").textContent = describeEndOfTurn(m.end_of_turn);
  const e2a = m.end_of_speech_to_first_audio_ms;
  const gaps = m.playback_gaps ? ` · ${m.playback_gaps} playback gap${m.playback_gaps > 1 ? "s" : ""} (${Math.round(m.playback_gap_ms)} ms)` : "";
  $("#last-turn h2").textContent = (e2a === null ? "Last turn" : `Last turn · ${Math.round(e2a)} ms to first audio`) + gaps;
}

function renderMemory(history) {
  const ol = $("#memory");
  ol.textContent = "";
  for (const msg of history || []) {
    const li = document.createElement("li");
    li.className = "msg";
    li.dataset.role = msg.role;
    li.textContent = msg.content;
    ol.appendChild(li);
  }
  if (!history || !history.length) {
    const li = document.createElement("li");
    li.className = "empty";
    li.textContent = "nothing yet";
    ol.appendChild(li);
  }
}

// ------------------------------------------------------------------ status, notices, banner

function notice(level, message) {
  const el = document.createElement("div");
  el.className = "notice";
  el.dataset.level = level;
  const text = document.createElement("span");
  text.textContent = message;
  const x = document.createElement("button");
  x.textContent = "×";
  x.title = "dismiss";
  x.onclick = () => el.remove();
  el.append(text, x);
  $("#notices").appendChild(el);
  if (level === "info") setTimeout(() => el.remove(), 8000);
  while ($("#notices").children.length > 6) $("#notices").firstChild.remove();
}

// ------------------------------------------------------------------ talking: hands-free and push-to-talk

function isTyping(e) {
  const t = e.target;
  return t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA" || t.isContentEditable);
}

function setPtt(down) {
  if (view.ptt === down) return;
  update({ ptt: down });
  send({ type: "ptt", down });
}

window.addEventListener("keydown", (e) => {
  if (e.code !== "Space" || isTyping(e) || $("#settings").open) return;
  if (view.mode !== "push-to-talk") return;
  e.preventDefault();
  if (!e.repeat) setPtt(true);
});

window.addEventListener("keyup", (e) => {
  if (e.code !== "Space" || !view.ptt) return;
  e.preventDefault();
  setPtt(false);
});

window.addEventListener("blur", () => setPtt(false));

// The mode shows (and the space bar works) at once; the saved setting follows, or the page says why not.
for (const id of ["#mode-hands-free", "#mode-ptt"]) {
  $(id).addEventListener("click", async (e) => {
    const mode = e.currentTarget.dataset.mode;
    update({ mode, ptt: false });
    const r = await saveSettings({ talk_mode: mode });
    if (!r.ok) { update({ mode: S.settings.talk_mode }); notice("error", `the talk mode was not changed: ${r.error}`); }
  });
}

$("#reset").addEventListener("click", () => send({ type: "reset" }));
$("#stop-reply").addEventListener("click", () => send({ type: "stop_reply" }));
window.addEventListener("keydown", (e) => {
  if (e.code === "Escape" && !isTyping(e) && !$("#settings").open) send({ type: "stop_reply" });
});

// ------------------------------------------------------------------ dropped files

let dragDepth = 0;
window.addEventListener("dragenter", (e) => { e.preventDefault(); dragDepth++; $("#drop-overlay").hidden = false; });
window.addEventListener("dragleave", () => { if (--dragDepth <= 0) { dragDepth = 0; $("#drop-overlay").hidden = true; } });
window.addEventListener("dragover", (e) => e.preventDefault());
window.addEventListener("drop", (e) => {
  e.preventDefault();
  dragDepth = 0;
  $("#drop-overlay").hidden = true;
  const f = e.dataTransfer && e.dataTransfer.files[0];
  if (f) askFile(f);
});

// A file asked before the assistant listens (the browser still waits for a click, or the pipeline is
// starting) is held here and sent once it listens: never refused, never lost.
async function askFile(file) {
  if (view.conn !== "ready" || view.phase === "starting" || view.sound === "needs-click") {
    update({ pendingFile: file });
    if (view.sound !== "needs-click") notice("info", `“${file.name}” will be asked as soon as the assistant listens.`);
    return;
  }
  try {
    const r = await fetch(BASE + "api/file", { method: "POST", body: file, headers: { "X-Filename": file.name.slice(0, 200) } });
    const j = await r.json();
    if (!r.ok) notice("error", j.error || `the file was refused (${r.status})`);
    else notice("info", `Asking ${file.name} (${j.seconds} s of audio)…`);
  } catch (err) {
    notice("error", `the file could not be sent: ${err.message}`);
  }
}

function askPendingFile() {
  const f = view.pendingFile;
  if (!f || view.sound === "needs-click") return;
  update({ pendingFile: null });
  askFile(f);
}
window.trAskFile = askFile; // tests hand a File to the same path a drop takes

// ------------------------------------------------------------------ settings

function applySettings(s) {
  const prev = S.settings;
  S.settings = s;
  update({ mode: s.talk_mode, ptt: s.talk_mode === "push-to-talk" && view.ptt });
  if (prev && prev.echo_cancellation !== s.echo_cancellation && S.hello && S.hello.audio === "browser" && S.micStream) restartMic();
}

function fillSelect(sel, values, current, emptyLabel) {
  sel.textContent = "";
  const opts = emptyLabel !== undefined ? ["", ...values] : values;
  for (const v of opts) {
    const o = document.createElement("option");
    o.value = v;
    o.textContent = v === "" ? emptyLabel : v;
    sel.appendChild(o);
  }
  sel.value = current;
}

function openSettings() {
  const s = S.settings;
  if (!s) return;
  $("#s-cloud").value = s.cloud;
  $("#s-api-key").value = "";
  $("#s-api-key").placeholder = s.api_key_set ? "•••••• stored (leave empty to keep)" : "(none)";
  $("#s-cloud-fraction").value = s.cloud_fraction;
  $("#s-cloud-fraction-out").textContent = `${Math.round(s.cloud_fraction * 100)}%`;
  fillSelect($("#s-check"), S.choices.check || [s.check], s.check);
  fillSelect($("#s-voice"), S.choices.voice || [s.voice], s.voice);
  $("#s-pace").value = s.pace;
  $("#s-pace-out").textContent = `${Number(s.pace).toFixed(2)}×`;
  $("#s-barge-in").checked = s.barge_in;
  $("#s-echo").checked = s.echo_cancellation;
  if (S.devices) {
    fillSelect($("#s-input-device"), S.devices.inputs, s.input_device, "system default");
    fillSelect($("#s-output-device"), S.devices.outputs, s.output_device, "system default");
  }
  $("#settings-error").textContent = "";
  $("#test-result").textContent = "";
  document.querySelectorAll("#settings .bad").forEach((el) => el.classList.remove("bad"));
  $("#settings").showModal();
}

function formChanges() {
  const s = S.settings;
  const c = {};
  const cloud = $("#s-cloud").value.trim();
  if (cloud !== s.cloud) c.cloud = cloud;
  const key = $("#s-api-key").value;
  if (key) c.api_key = key;
  const frac = parseFloat($("#s-cloud-fraction").value);
  if (Math.abs(frac - s.cloud_fraction) > 1e-9) c.cloud_fraction = frac;
  if ($("#s-check").value !== s.check) c.check = $("#s-check").value;
  if ($("#s-voice").value !== s.voice) c.voice = $("#s-voice").value;
  const pace = parseFloat($("#s-pace").value);
  if (Math.abs(pace - s.pace) > 1e-9) c.pace = pace;
  if ($("#s-barge-in").checked !== s.barge_in) c.barge_in = $("#s-barge-in").checked;
  if ($("#s-echo").checked !== s.echo_cancellation) c.echo_cancellation = $("#s-echo").checked;
  if (S.devices) {
    if ($("#s-input-device").value !== s.input_device) c.input_device = $("#s-input-device").value;
    if ($("#s-output-device").value !== s.output_device) c.output_device = $("#s-output-device").value;
  }
  return c;
}

async function saveSettings(changes) {
  if (!Object.keys(changes).length) return { ok: true };
  try {
    const r = await fetch(BASE + "api/settings", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(changes) });
    const j = await r.json();
    if (!r.ok) return { ok: false, error: j.error || `refused (${r.status})`, field: j.field };
    applySettings(j.settings);
    return { ok: true };
  } catch (err) {
    return { ok: false, error: `the settings could not be sent: ${err.message}` };
  }
}

$("#open-settings").addEventListener("click", openSettings);
$("#settings-cancel").addEventListener("click", () => $("#settings").close());
$("#s-cloud-fraction").addEventListener("input", (e) => { $("#s-cloud-fraction-out").textContent = `${Math.round(e.target.value * 100)}%`; });
$("#s-pace").addEventListener("input", (e) => { $("#s-pace-out").textContent = `${Number(e.target.value).toFixed(2)}×`; });
$("#settings-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const btn = $("#settings-save");
  btn.disabled = true;
  $("#settings-error").textContent = "saving…";
  const r = await saveSettings(formChanges());
  btn.disabled = false;
  if (!r.ok) {
    $("#settings-error").textContent = r.error;
    const field = r.field && document.querySelector(`#settings [name="${r.field}"]`);
    if (field) field.classList.add("bad");
    return;
  }
  $("#settings-error").textContent = "";
  $("#settings").close();
  notice("info", "Settings saved; they apply from the next answer.");
});
$("#test-cloud").addEventListener("click", async () => {
  const out = $("#test-result");
  out.dataset.ok = "";
  out.textContent = "testing…";
  try {
    const body = { cloud: $("#s-cloud").value.trim() };
    if ($("#s-api-key").value) body.api_key = $("#s-api-key").value;
    const r = await fetch(BASE + "api/cloud-test", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    const j = await r.json();
    out.dataset.ok = j.ok ? "yes" : "no";
    out.textContent = j.message;
  } catch (err) {
    out.dataset.ok = "no";
    out.textContent = err.message;
  }
});
$("#forget-key").addEventListener("click", async () => {
  const r = await saveSettings({ api_key: "" });
  $("#test-result").textContent = r.ok ? "key forgotten" : r.error;
  if (r.ok) $("#s-api-key").placeholder = "(none)";
});

connect();
