// Audio worklets of the TokenRouter page: the microphone tap and the reply player.
// They run on the browser's audio thread; they only copy samples and post small messages.

// Microphone -> 16 kHz int16 frames of 20 ms, posted to the page (which sends them on the socket).
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / 16000; // input samples per output sample (1 when the context runs at 16 kHz)
    this.pos = 0;
    this.frame = new Int16Array(320);
    this.n = 0;
  }

  push(v) {
    v = Math.max(-1, Math.min(1, v));
    this.frame[this.n++] = v < 0 ? v * 32768 : v * 32767;
    if (this.n === this.frame.length) {
      this.port.postMessage(this.frame.buffer, [this.frame.buffer]);
      this.frame = new Int16Array(320);
      this.n = 0;
    }
  }

  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch) return true;
    if (this.step === 1) {
      for (let i = 0; i < ch.length; i++) this.push(ch[i]);
      return true;
    }
    // other context rates: average the input samples that fall in each output sample
    for (let i = 0; i < ch.length; i++) {
      this.acc = (this.acc || 0) + ch[i];
      this.cnt = (this.cnt || 0) + 1;
      this.pos += 1;
      if (this.pos >= this.step) {
        this.pos -= this.step;
        this.push(this.acc / this.cnt);
        this.acc = 0;
        this.cnt = 0;
      }
    }
    return true;
  }
}

// The reply: chunks queued as they arrive, played back to back; reports how much it has played.
// Each turn has a sequence number; chunks and flushes of another turn are ignored.
class PlayerProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0;
    this.seq = 0;
    this.played = 0;
    this.paused = false;
    this.sinceReport = 0;
    this.firstSent = false;
    this.peak = 0;
    this.sumSq = 0;
    this.total = 0;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === "turn") {
        this.queue = []; this.offset = 0; this.seq = m.seq; this.played = 0; this.firstSent = false; this.paused = false;
      } else if (m.type === "chunk") {
        if (m.seq === this.seq) this.queue.push(m.samples);
      } else if (m.type === "pause") {
        this.paused = m.paused;
        this.report(false);
      } else if (m.type === "flush") {
        if (m.seq === this.seq) { this.queue = []; this.offset = 0; }
        this.report(false);
      }
    };
  }

  report(first) {
    this.port.postMessage({ seq: this.seq, played: this.played, first, peak: this.peak,
      rms: this.total ? Math.sqrt(this.sumSq / this.total) : 0, total: this.total, queued: this.queue.length });
    this.sinceReport = 0;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let n = 0;
    if (!this.paused) {
      while (n < out.length && this.queue.length) {
        const c = this.queue[0];
        const k = Math.min(out.length - n, c.length - this.offset);
        out.set(c.subarray(this.offset, this.offset + k), n);
        n += k;
        this.offset += k;
        if (this.offset >= c.length) { this.queue.shift(); this.offset = 0; }
      }
    }
    out.fill(0, n);
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (n) {
      for (let i = 0; i < n; i++) { const v = out[i]; this.sumSq += v * v; if (Math.abs(v) > this.peak) this.peak = Math.abs(v); }
      this.total += n;
      this.played += n;
      this.sinceReport += n;
      if (!this.firstSent) { this.firstSent = true; this.report(true); }
      else if (this.sinceReport >= 512 || !this.queue.length) this.report(false);
    }
    return true;
  }
}

registerProcessor("tr-capture", CaptureProcessor);
registerProcessor("tr-player", PlayerProcessor);
