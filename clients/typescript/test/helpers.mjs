// Real things for the tests: a fake upstream (an OpenAI-like model API and tools that count
// their calls) and a real `idemproxy serve` with a SQLite journal in a temporary folder.

import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import { createServer as createNetServer } from "node:net";
import { tmpdir } from "node:os";
import { delimiter, join } from "node:path";
import { fileURLToPath } from "node:url";

export const ADMIN_TOKEN = "test-admin-token";
const REPO = fileURLToPath(new URL("../../../", import.meta.url));

/** A free TCP port on 127.0.0.1. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = createNetServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/**
 * The fake upstream. `POST /v1/chat/completions` answers like OpenAI, numbering its replies;
 * `/tools/{name}` counts calls by name and answers `{n}`. `fail(path, ...faults)` makes the next
 * requests to `path` fail, one fault each: a status (500, 429...) or "drop" (the connection is
 * closed with no answer). Every request reaches `calls` (by route) and `seen`.
 */
export async function startUpstream() {
  const calls = new Map();
  const seen = [];
  const faults = new Map();
  let replies = 0;
  const count = (name) => calls.set(name, (calls.get(name) ?? 0) + 1);
  const server = createServer(async (request, response) => {
    const chunks = [];
    for await (const chunk of request) chunks.push(chunk);
    const body = Buffer.concat(chunks).toString("utf8");
    const path = new URL(request.url, "http://upstream").pathname;
    seen.push({ method: request.method, path, headers: request.headers, body });
    const fault = faults.get(path)?.shift();
    if (fault === "drop") {
      count(`dropped:${path}`);
      request.socket.destroy();
      return;
    }
    if (fault !== undefined) {
      count(`failed:${path}`);
      // retry-after-ms: both SDKs then retry at once instead of backing off for seconds
      response.writeHead(fault, { "Content-Type": "application/json", "Retry-After-Ms": "10" });
      response.end(JSON.stringify({ error: { message: `fake ${fault}`, type: "fake" } }));
      return;
    }
    if (request.method === "POST" && path === "/v1/chat/completions") {
      count("chat");
      const asked = JSON.parse(body || "{}");
      const last = asked.messages?.at(-1)?.content ?? "";
      const n = ++replies;
      response.writeHead(200, { "Content-Type": "application/json" });
      response.end(JSON.stringify({
        id: `chatcmpl-${n}`, object: "chat.completion", created: 1_700_000_000, model: asked.model ?? "fake",
        choices: [{ index: 0, message: { role: "assistant", content: `reply ${n} to: ${String(last).slice(0, 60)}` },
          finish_reason: "stop", logprobs: null }],
        usage: { prompt_tokens: 10, completion_tokens: 5, total_tokens: 15 },
      }));
      return;
    }
    if (path.startsWith("/tools/")) {
      const name = `tool:${path.slice("/tools/".length)}`;
      count(name);
      response.writeHead(200, { "Content-Type": "application/json" });
      response.end(JSON.stringify({ n: calls.get(name), received: body ? JSON.parse(body) : null }));
      return;
    }
    response.writeHead(404, { "Content-Type": "application/json" });
    response.end("{}");
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const url = `http://127.0.0.1:${server.address().port}`;
  return {
    url,
    calls,
    seen,
    count: (name) => calls.get(name) ?? 0,
    fail: (path, ...list) => faults.set(path, [...(faults.get(path) ?? []), ...list]),
    close: () => new Promise((resolve) => {
      server.closeAllConnections();
      server.close(resolve);
    }),
  };
}

/** The `idemproxy` to start: `IDEMPROXY_BIN`, else the one on PATH, else the repository's venv. */
export function idemproxyBin() {
  if (process.env.IDEMPROXY_BIN) return process.env.IDEMPROXY_BIN;
  for (const dir of (process.env.PATH ?? "").split(delimiter)) {
    if (dir && existsSync(join(dir, "idemproxy"))) return join(dir, "idemproxy");
  }
  const venv = join(REPO, ".venv", "bin", "idemproxy");
  if (existsSync(venv)) return venv;
  throw new Error("idemproxy not found: put it on PATH or set IDEMPROXY_BIN");
}

function tomlValue(value) {
  if (Array.isArray(value)) return `[${value.map(tomlValue).join(", ")}]`;
  if (typeof value === "string") return JSON.stringify(value);
  return String(value);
}

/**
 * Start `idemproxy serve` on a free port with a SQLite journal, the fake upstream as `openai`
 * (a model) and `tools` (a tool), one shared namespace for runs and anonymous callers (one
 * agent per proxy, as the Python tests choose), short minimum timeouts. `sections` adds or
 * overrides TOML sections: `{ tenants: { runs: "credential" } }`.
 */
export async function startProxy(upstream, sections = {}) {
  const dir = mkdtempSync(join(tmpdir(), "idemproxy-ts-"));
  const port = await freePort();
  const base = {
    server: { host: "127.0.0.1", port, access_log: false },
    store: { url: `sqlite:///${join(dir, "journal.db")}` },
    "upstreams.openai": { url: upstream.url, kind: "model", on_ambiguous: "retry" },
    "upstreams.tools": { url: `${upstream.url}/tools`, kind: "tool", on_ambiguous: "quarantine" },
    tenants: { runs: "shared", anonymous: "shared" },
    runs: { min_timeout_s: 0.01, min_grace_s: 0.01 },
    supervisor: { enabled: false, proxy_url: `http://127.0.0.1:${port}` },
    admin: { token: ADMIN_TOKEN },
  };
  for (const [name, body] of Object.entries(sections)) base[name] = { ...(base[name] ?? {}), ...body };
  const toml = Object.entries(base).map(([name, body]) =>
    `[${name}]\n${Object.entries(body).map(([key, value]) => `${key} = ${tomlValue(value)}`).join("\n")}\n`).join("\n");
  const config = join(dir, "idemproxy.toml");
  writeFileSync(config, toml);
  const output = [];
  const { IDEMPROXY_BIN: _, ...env } = process.env; // the proxy reads IDEMPROXY_* as its options
  const child = spawn(idemproxyBin(), ["serve", "--config", config], {
    cwd: dir, stdio: ["ignore", "pipe", "pipe"], env,
  });
  child.stdout.on("data", (chunk) => output.push(chunk));
  child.stderr.on("data", (chunk) => output.push(chunk));
  const url = `http://127.0.0.1:${port}`;
  const log = () => Buffer.concat(output).toString("utf8");
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`idemproxy exited (${child.exitCode}):\n${log()}`);
    try {
      if ((await fetch(`${url}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error(`idemproxy did not start:\n${log()}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return {
    url,
    dir,
    config,
    log,
    /** The run as operators see it (`GET /admin/runs/{id}`), or null. */
    async adminRun(runId) {
      const response = await fetch(`${url}/admin/runs/${runId}`, { headers: { Authorization: `Bearer ${ADMIN_TOKEN}` } });
      return response.ok ? response.json() : null;
    },
    async stop() {
      if (child.exitCode === null) {
        const exited = new Promise((resolve) => child.once("exit", resolve));
        child.kill("SIGTERM");
        const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
        await exited;
        clearTimeout(timer);
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

let scripts; // the folder of moduleCommand's files, removed when the test process exits

/**
 * The command that runs the ES module `code` (written to a file of its own) on the runtime
 * running these tests, as `[command, ...args]`: `node` and `bun` take the file, `deno` wants
 * `run -A` before it.
 */
export function moduleCommand(code, ...args) {
  if (scripts === undefined) {
    scripts = mkdtempSync(join(tmpdir(), "idemproxy-ts-scripts-"));
    process.once("exit", () => rmSync(scripts, { recursive: true, force: true }));
  }
  const file = join(mkdtempSync(join(scripts, "m-")), "script.mjs");
  writeFileSync(file, code);
  return scriptCommand(file, ...args);
}

/** `[command, ...args]` running the script `file` on the runtime running these tests. */
export function scriptCommand(file, ...args) {
  return [process.execPath, ...(globalThis.Deno ? ["run", "-A"] : []), file, ...args];
}

/** Until `predicate()` is truthy (returned), or fail after `seconds`. */
export async function until(predicate, seconds, what) {
  const deadline = Date.now() + seconds * 1000;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`not within ${seconds}s: ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}
