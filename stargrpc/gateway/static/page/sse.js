// Parses text/event-stream (https://html.spec.whatwg.org/#event-stream-interpretation).
//
// Events are read with fetch() rather than EventSource so that credentials can travel in
// an Authorization header. onMessage(event, data) gets each message; onRetry(ms) the
// server's "retry:" field; reading ends when the body does or stopped() turns true.
export async function readEvents(body, onMessage, stopped, onRetry = () => {}) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let message = { event: "message", data: [], id: null };
  for (;;) {
    const { value, done } = await reader.read();
    if (done || stopped()) return;
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (message.data.length) onMessage(message.event, message.data.join("\n"));
        message = { event: "message", data: [], id: null };
        continue;
      }
      if (line.startsWith(":")) continue;  // keep-alive comment
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let text = colon < 0 ? "" : line.slice(colon + 1);
      if (text.startsWith(" ")) text = text.slice(1);
      if (field === "data") message.data.push(text);
      else if (field === "event") message.event = text;
      else if (field === "id") message.id = text;
      else if (field === "retry" && /^\d+$/.test(text)) onRetry(Number(text));
    }
  }
}
