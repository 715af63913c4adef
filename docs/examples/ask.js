// Ask trioserve one question from JavaScript, as a web page would: the standard
// WebSocket API, JSON frames. Paste it into a page served from http://localhost
// (loopback origins are allowed by default; others need --allowed-origin), or run
// it with Node: `node docs/examples/ask.js ws://127.0.0.1:7862/` (Node 22+; Node 20
// and 21 need --experimental-websocket). With an API key, add ?api_key=KEY to the URL.

const url = globalThis.process?.argv[2] ?? "ws://127.0.0.1:7862/";
const show = globalThis.process
  ? (text) => process.stdout.write(text)
  : (text) => document.body.append(text);

const ws = new WebSocket(url);
ws.onopen = () => {
  ws.send(JSON.stringify({
    action: "infer",
    request_id: 1,
    text: "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    max_new_tokens: 64,
    temperature: 0,
    stream: true,
  }));
};
ws.onmessage = (event) => {
  const frame = JSON.parse(event.data);
  if (frame.response_type === "chunk") {
    show(frame.chunk);
  } else if (frame.response_type === "full") {
    show(`\n[${frame.stop_reason}, ${frame.usage.generated_tokens} tokens]\n`);
    ws.close();
  } else if (frame.response_type === "error") {
    show(`\nerror: ${frame.error.type} at ${frame.error.field}: ${frame.error.message}\n`);
    ws.close();
  }
};
ws.onerror = () => show(`\ncannot talk to ${url}\n`);
