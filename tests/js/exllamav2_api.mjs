// A client in the manner of the public ExLlamaV2Api JavaScript class: one
// WebSocket, a request_id -> handler map, and infer() as an async generator
// that yields every frame of the request, the final frame included, so that
// consumers write `text += m.chunk` and `process.stdout.write(m.chunk)`.
//
// Run by tests/test_js_client.py: `node [--experimental-websocket]
// exllamav2_api.mjs URL`. It drives the scenarios below against a trioserve
// server and prints one JSON object with what it saw; the chunks themselves
// are written to stderr with process.stderr.write(m.chunk), which throws if
// a frame it yields has no string `chunk`.

class ExLlamaV2Api {
  constructor(url) {
    this.url = url;
    this.handlers = new Map();
    this.nextId = 1;
  }

  connect() {
    return new Promise((resolve, reject) => {
      this.ws = new WebSocket(this.url);
      this.ws.onopen = () => resolve();
      this.ws.onerror = (event) => reject(new Error(`cannot connect to ${this.url}`));
      this.ws.onmessage = (event) => {
        const message = JSON.parse(event.data);
        const handler = this.handlers.get(message.request_id);
        if (handler) handler(message);
      };
    });
  }

  close() {
    this.ws.close();
  }

  // One request, one reply.
  request(payload) {
    const request_id = this.nextId++;
    return new Promise((resolve) => {
      this.handlers.set(request_id, (message) => {
        this.handlers.delete(request_id);
        resolve(message);
      });
      this.ws.send(JSON.stringify({ ...payload, request_id }));
    });
  }

  // Every frame of an infer, the final frame (or an error) last.
  async *infer(payload) {
    const request_id = this.nextId++;
    const queue = [];
    let wake = null;
    this.handlers.set(request_id, (message) => {
      queue.push(message);
      if (wake) {
        wake();
        wake = null;
      }
    });
    this.ws.send(JSON.stringify({ action: "infer", ...payload, request_id }));
    try {
      while (true) {
        if (queue.length === 0) await new Promise((resolve) => (wake = resolve));
        const message = queue.shift();
        yield message;
        if (message.response_type !== "chunk") return;
      }
    } finally {
      this.handlers.delete(request_id);
    }
  }
}

const PARIS =
  "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

// The consumer of the public class: append every yielded frame's chunk.
async function consume(api, payload) {
  let text = "";
  const frames = [];
  for await (const m of api.infer(payload)) {
    frames.push(m);
    if (m.response_type === "error") break;
    text += m.chunk;
    process.stderr.write(m.chunk);
  }
  return { text, frames };
}

const api = new ExLlamaV2Api(process.argv[2]);
await api.connect();
const [echo, count, streamed, plain, compact, bad] = await Promise.all([
  api.request({ action: "echo" }),
  api.request({ action: "estimate_token", text: PARIS }),
  consume(api, { text: PARIS, max_new_tokens: 16, temperature: 0, stream: true }),
  consume(api, { text: PARIS, max_new_tokens: 16, temperature: 0 }),
  consume(api, {
    text: PARIS,
    max_new_tokens: 16,
    temperature: 0,
    stream: true,
    compact_chunks: true,
  }),
  consume(api, { text: PARIS, max_new_tokens: 16, temprature: 0 }),
]);
api.close();
process.stdout.write(JSON.stringify({ echo, count, streamed, plain, compact, bad }) + "\n");
