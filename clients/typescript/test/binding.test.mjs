// The run's binding: its token (Idem-Run-Token, /cap/{token}) and trusted tenant
// (Idem-Tenant) go with every call once known, and are absent on a proxy that gives no token.
// A fake runs API records what each call carried; a real proxy with default tenant settings
// shows the quick start making one run whatever the SDK's credential.

import assert from "node:assert/strict";
import { createServer } from "node:http";
import { after, before, test } from "node:test";

import OpenAI from "openai";

import { IdemProxyError, Run, tenantOf } from "../dist/index.js";
import { startProxy, startUpstream } from "./helpers.mjs";

/** A runs API that answers run JSON (with `token` if given) and records each call's headers. */
async function fakeProxy(token) {
  const calls = [];
  let epoch = 0;
  const server = createServer(async (request, response) => {
    for await (const _ of request);
    const path = new URL(request.url, "http://fake").pathname;
    calls.push({ method: request.method, path, headers: request.headers });
    const runId = path.split("/")[2];
    if (path.endsWith("/attach")) {
      response.writeHead(200, { "Content-Type": "application/x-ndjson" });
      response.write(JSON.stringify({ attached: 1, run_id: runId, epoch }) + "\n");
      return; // held open until the client lets go
    }
    const created = request.method === "POST" && path === `/runs/${runId}` && epoch === 0 && calls.length === 1;
    if (path.endsWith("/attempts")) epoch += 1;
    const state = path.endsWith("/complete") ? "completed" : "running";
    response.writeHead(created ? 201 : 200, { "Content-Type": "application/json" });
    response.end(JSON.stringify({ run_id: runId, state, epoch, timeout_s: 60, ...(token ? { token } : {}) }));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    calls,
    close: () => new Promise((resolve) => {
      server.closeAllConnections();
      server.close(resolve);
    }),
  };
}

async function lifecycle(fake, env) {
  const run = await Run.start({ runId: "bound", proxyUrl: fake.url, env, log: null, heartbeat: false, attach: true });
  assert.ok(await run.attachment.waitAttached(5));
  await run.heartbeat();
  await run.close(); // lets the held connection go (detach)
  await run.complete();
  return run;
}

test("a proxy that gives no token: no Idem-Run-Token, no /cap/, the trusted tenant still sent", async () => {
  const fake = await fakeProxy(undefined);
  try {
    const run = await lifecycle(fake, { IDEM_NAMESPACE: "team-a" });
    assert.equal(run.token, undefined);
    assert.equal(run.tenant, "team-a");
    assert.equal(run.url("openai", "/v1"), `${fake.url}/runs/bound/epochs/0/openai/v1`);
    assert.deepEqual(run.headers, { "Idem-Tenant": "team-a" });
    assert.deepEqual(fake.calls.map((c) => `${c.method} ${c.path}`), [
      "POST /runs/bound", "POST /runs/bound/attach", "POST /runs/bound/heartbeat", "POST /runs/bound/detach",
      "POST /runs/bound/complete"]);
    for (const call of fake.calls) {
      assert.equal(call.headers["idem-run-token"], undefined, call.path);
      assert.equal(call.headers["idem-tenant"], "team-a", call.path);
    }
    assert.deepEqual(fake.calls.slice(1).map((c) => c.headers["idem-epoch"]), ["0", "0", "0", "0"]);
  } finally {
    await fake.close();
  }
});

test("a token from the registration goes with every later call, in headers and base URL", async () => {
  const fake = await fakeProxy("ZGVmYXVsdA.c4p_ab-1");
  try {
    const run = await lifecycle(fake, {});
    assert.equal(run.token, "ZGVmYXVsdA.c4p_ab-1");
    assert.equal(run.url("openai", "/v1"), `${fake.url}/runs/bound/epochs/0/cap/ZGVmYXVsdA.c4p_ab-1/openai/v1`);
    assert.deepEqual(run.headers, { "Idem-Run-Token": "ZGVmYXVsdA.c4p_ab-1" });
    assert.equal(run.info.raw.token, undefined); // a credential: not in the snapshot
    assert.ok(!String(run).includes("c4p"));
    const [register, ...rest] = fake.calls;
    assert.equal(register.headers["idem-run-token"], undefined); // not known yet
    assert.deepEqual(rest.map((c) => c.headers["idem-run-token"]), rest.map(() => "ZGVmYXVsdA.c4p_ab-1"));
    assert.ok(rest.every((c) => c.headers["idem-tenant"] === undefined));
  } finally {
    await fake.close();
  }
});

test("a token handed by the supervisor (IDEM_RUN_TOKEN) goes with the first call too", async () => {
  const fake = await fakeProxy(undefined);
  try {
    const env = { IDEM_RUN_ID: "bound", IDEM_EPOCH: "0", IDEM_PROXY_URL: fake.url, IDEM_RUN_TOKEN: "handed.tok-1",
      IDEM_NAMESPACE: "k:abc" };
    const run = await Run.start({ env, log: null, heartbeat: false });
    await run.complete();
    assert.deepEqual(fake.calls.map((c) => [c.path, c.headers["idem-run-token"], c.headers["idem-tenant"]]), [
      ["/runs/bound", "handed.tok-1", undefined], ["/runs/bound/complete", "handed.tok-1", undefined]]);
    // IDEM_RUN_TOKEN of another run is not this run's
    const other = await Run.start({ env, runId: "other", log: null, heartbeat: false });
    assert.equal(other.token, undefined);
  } finally {
    await fake.close();
  }
});

test("a malformed token is an error, and only a trusted tenant's name is sent", async () => {
  const fake = await fakeProxy("not/a token");
  try {
    await assert.rejects(Run.start({ runId: "bound", proxyUrl: fake.url, env: {}, log: null }), IdemProxyError);
  } finally {
    await fake.close();
  }
  for (const shared of [undefined, "", "default", "anonymous", "k:1f2e", "r:abc"]) assert.equal(tenantOf(shared), undefined);
  assert.equal(tenantOf("team-a"), "team-a");
});

// -- the quick start on a real proxy with default tenant settings ------------------------

let upstream;
let proxy;

before(async () => {
  upstream = await startUpstream();
  proxy = await startProxy(upstream, { tenants: { runs: "credential", anonymous: "refuse" } });
});

after(async () => {
  await proxy?.stop();
  await upstream?.close();
});

test("quick start, default tenants: Run plus an SDK with its own credential make one run", async (t) => {
  const start = (token) => Run.start({ runId: "quick-start", proxyUrl: proxy.url, env: {}, log: null, heartbeat: false,
    token });
  const first = await start();
  if (first.token === undefined) {
    t.skip("this idemproxy gives no run token (run binding not in this server)");
    return;
  }
  const ask = async (run) => {
    const llm = new OpenAI({ baseURL: run.url("openai", "/v1"), defaultHeaders: run.headers, apiKey: "sk-agent-own" });
    const { data, response } = await llm.chat.completions
      .create({ model: "gpt-4o-mini", messages: [{ role: "user", content: "plan" }] }).withResponse();
    return [data.choices[0].message.content, response.headers.get("idempotent-replayed")];
  };
  const [text, replayed] = await ask(first);
  assert.equal(replayed, "false");
  // Started again by something that kept the token (the supervisor hands it as IDEM_RUN_TOKEN):
  // a new attempt of the same run. Without it, an anonymous caller's registration is a new run.
  const second = await start(first.token);
  assert.equal(second.epoch, 1);
  assert.deepEqual(await ask(second), [text, "true"]);
  await second.complete();
  const seen = await proxy.adminRun("quick-start");
  assert.equal(seen.state, "completed");
  assert.equal(seen.steps.length, 1);
  assert.equal(upstream.count("chat"), 1);
});
