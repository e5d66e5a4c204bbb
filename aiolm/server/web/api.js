// The page's side of this server's OpenAI-compatible API: requests with the optional key,
// errors turned into ApiError with the server's own message, and the SSE stream read as events.

export class ApiError extends Error {
  constructor(message, status = 0, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

function headers(key, json = false) {
  const h = {};
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let param = null;
  try {
    const err = (await response.json()).error;
    param = err?.param ?? null;
    if (err?.message) message = `${response.status}${param ? ` (${param})` : ""}: ${err.message}`;
  } catch {
    // not an OpenAI-shaped body: keep the status line
  }
  return new ApiError(message, response.status, param);
}

async function call(path, options) {
  let response;
  try {
    response = await fetch(path, options);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`could not reach the server (${e.message})`);
  }
  if (!response.ok) throw await failure(response);
  return response;
}

/** The served model's card (the first of /v1/models). */
export async function fetchModel(key) {
  const body = await (await call("/v1/models", { headers: headers(key) })).json();
  return body.data[0];
}

// The "data:" payloads of a server-sent event stream, as strings.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

/**
 * Stream one chat completion: yields the parsed chunks (content deltas, then the usage
 * chunk). An error reported inside the stream is thrown as ApiError. `signal` aborts
 * the request, which closes the connection; the server then aborts the generation.
 */
export async function* streamChat(key, request, signal) {
  const body = JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } });
  const response = await call("/v1/chat/completions", { method: "POST", headers: headers(key, true), body, signal });
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message, 0, chunk.error.param ?? null);
    yield chunk;
  }
}
