// Run's lifecycle against a real `idemproxy serve`: registration, attempts, replays,
// heartbeats, fencing, the held connection, errors, and a process that exits when done.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import {
  IdemProxyError, ProblemError, ProxyUnreachable, Run, RunEnded, RunExists, RunNotFound, RunState, Superseded,
  stepKey,
} from "../dist/index.js";
import { freePort, moduleCommand, startProxy, startUpstream, until } from "./helpers.mjs";

const DIST = fileURLToPath(new URL("../dist/index.js", import.meta.url));
let upstream;
let proxy;
let runs = 0;
const quiet = { log: null, env: {} }; // no IDEM_* from the test's own environment
const newId = (what) => `ts-${what}-${process.pid}-${++runs}`;

before(async () => {
  upstream = await startUpstream();
  proxy = await startProxy(upstream, { runs: { attach_grace_s: 0.3, attach_keepalive_s: 0.2 } });
});

after(async () => {
  await proxy?.stop();
  await upstream?.close();
});

async function chat(run, content) {
  const response = await run.fetch(run.url("openai", "/v1/chat/completions"), {
    method: "POST", headers: { "Content-Type": "application/json", Authorization: "Bearer sk-test" },
    body: JSON.stringify({ model: "fake", messages: [{ role: "user", content }] }),
  });
  assert.equal(response.status, 200, await response.clone().text());
  return { replayed: response.headers.get("idempotent-replayed"), body: await response.json() };
}

async function tool(run, name, body, key) {
  const response = await run.fetch(run.url("tools", `/${name}`), {
    method: "POST", headers: { "Content-Type": "application/json", "Idempotency-Key": key },
    body: JSON.stringify(body),
  });
  assert.equal(response.status, 200, await response.clone().text());
  return { replayed: response.headers.get("idempotent-replayed"), body: await response.json() };
}

test("a run registers, its calls go through the proxy, and complete() ends it", async () => {
  const runId = newId("complete");
  const run = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, timeoutS: 30, metadata: { steps: 2 } });
  assert.equal(run.runId, runId);
  assert.equal(run.epoch, 0);
  assert.equal(run.info.state, RunState.RUNNING);
  assert.deepEqual(run.info.metadata, { steps: 2 });
  const base = run.token ? `${proxy.url}/runs/${runId}/epochs/0/cap/${run.token}` : `${proxy.url}/runs/${runId}/epochs/0`;
  assert.equal(run.baseUrl, base);
  assert.equal(run.url("openai", "/v1"), `${base}/openai/v1`);
  assert.equal(run.url("openai", "v1"), `${base}/openai/v1`);
  assert.equal(run.url("tools"), `${base}/tools`);
  assert.throws(() => run.url("../admin"), RangeError);
  assert.deepEqual(run.headers, run.token ? { "Idem-Run-Token": run.token } : {});
  assert.equal(run.key("send", "a"), stepKey(runId, "send", "a"));

  const reply = await chat(run, "hello");
  assert.equal(reply.replayed, "false");
  const sent = await tool(run, "send_email", { to: "ada" }, run.key("send_email", "ada"));
  assert.equal(sent.replayed, "false");

  const ended = await run.complete();
  assert.equal(ended.state, "completed");
  assert.ok(run.ended);
  assert.equal(await run.complete(), undefined); // once
  const seen = await proxy.adminRun(runId);
  assert.equal(seen.state, "completed");
  assert.equal(seen.steps.length, 2);
});

test("started again without a supervisor, a run takes a new attempt that replays", async () => {
  const runId = newId("again");
  const first = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false });
  const one = await chat(first, "step 1");
  const sentOne = await tool(first, "charge", { order: 1 }, first.key("charge", 1));
  // the process "dies" here: no complete(), no close()

  const before = { chat: upstream.count("chat"), charge: upstream.count("tool:charge") };
  const second = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false });
  assert.equal(second.epoch, 1);
  const again = await chat(second, "step 1");
  const sentAgain = await tool(second, "charge", { order: 1 }, second.key("charge", 1));
  assert.equal(again.replayed, "true");
  assert.deepEqual(again.body, one.body);
  assert.equal(sentAgain.replayed, "true");
  assert.deepEqual(sentAgain.body, sentOne.body);
  assert.deepEqual({ chat: upstream.count("chat"), charge: upstream.count("tool:charge") }, before);

  // the first attempt is fenced: its calls and its end are refused
  await assert.rejects(first.heartbeat(), Superseded);
  assert.ok(first.superseded);
  assert.equal(await first.complete(), undefined);
  await second.complete();
  assert.equal((await proxy.adminRun(runId)).state, "completed");
});

test("resume: false refuses an existing run; an ended run takes no attempt", async () => {
  const runId = newId("resume");
  const run = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false });
  await assert.rejects(Run.start({ ...quiet, runId, proxyUrl: proxy.url, resume: false }), (error) =>
    error instanceof RunExists && error instanceof ProblemError && error.slug === "run-exists");
  await run.fail("the task cannot be done");
  assert.equal(run.failReason, "the task cannot be done");
  assert.equal((await proxy.adminRun(runId)).state, "failed");
  await assert.rejects(Run.start({ ...quiet, runId, proxyUrl: proxy.url }), RunEnded);
});

test("a process handed an attempt by the environment continues it at that epoch", async () => {
  const runId = newId("handed");
  const registered = await fetch(`${proxy.url}/runs/${runId}`, { method: "POST", body: "{}" });
  const token = (await registered.json()).token;
  const attempt = await (await fetch(`${proxy.url}/runs/${runId}/attempts`, {
    method: "POST", headers: token ? { "Idem-Run-Token": token } : {},
  })).json();
  assert.equal(attempt.epoch, 1);
  const env = {
    IDEM_RUN_ID: runId, IDEM_EPOCH: "1", IDEM_ATTEMPT: "1", IDEM_PROXY_URL: `${proxy.url}/`,
    IDEM_NAMESPACE: "default", ...(attempt.token ?? token ? { IDEM_RUN_TOKEN: attempt.token ?? token } : {}),
  };
  const run = await Run.start({ env, log: null, heartbeat: false });
  assert.equal(run.runId, runId);
  assert.equal(run.epoch, 1);
  assert.equal(run.proxyUrl, proxy.url);
  assert.equal(run.tenant, undefined); // "default" is no trusted tenant's name
  assert.equal(run.token, env.IDEM_RUN_TOKEN);
  await run.complete();

  // handed an epoch the run has moved past: this process is a zombie from the start
  const zombie = Run.start({ env: { ...env, IDEM_EPOCH: "0" }, log: null, heartbeat: false });
  await assert.rejects(zombie, RunEnded);
});

test("heartbeats reach the proxy from unref'd timers", async () => {
  const runId = newId("beats");
  const run = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: 0.1 });
  const first = (await proxy.adminRun(runId)).last_seen;
  await until(async () => (await proxy.adminRun(runId)).last_seen > first + 0.15, 5, "beats advance last_seen");
  await run.complete();
});

test("a superseded attempt stops beating and never ends the run", async () => {
  const runId = newId("fenced");
  const warnings = [];
  const first = await Run.start({ ...quiet, log: { warn: (m) => warnings.push(m) }, runId, proxyUrl: proxy.url,
    heartbeat: 0.1 });
  const second = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false });
  await until(() => first.superseded, 5, "the first attempt notices");
  assert.match(warnings.join("\n"), /superseded/);
  assert.equal(await first.complete(), undefined);
  assert.equal((await second.refresh()).state, "running");
  // the proxy refuses the zombie's own calls with 412
  const refused = await first.fetch(first.url("openai", "/v1/chat/completions"), {
    method: "POST", body: JSON.stringify({ model: "fake", messages: [] }), headers: { "Content-Type": "application/json" },
  });
  assert.equal(refused.status, 412);
  await second.complete();
});

test("the held connection follows the attempt and ends with it", async () => {
  const runId = newId("attach");
  const run = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false, attach: true });
  assert.ok(await run.attachment.waitAttached(5));
  assert.equal(run.attachment.connections, 1);
  // another attempt supersedes this one: the proxy says so down the held connection
  const other = await Run.start({ ...quiet, runId, proxyUrl: proxy.url, heartbeat: false, attach: true });
  await until(() => run.superseded, 5, "superseded seen on the held connection");
  assert.ok(await other.attachment.waitAttached(5));
  const attachment = other.attachment;
  await other.complete();
  assert.equal(other.attachment, undefined);
  assert.ok(!(await attachment.waitAttached(0)) || attachment.connections >= 1);
  await run.close();
  assert.equal((await proxy.adminRun(runId)).state, "completed");
});

test("refusals and an absent proxy are errors of their own classes", async () => {
  const runId = newId("errors");
  const port = await freePort();
  await assert.rejects(Run.start({ ...quiet, runId, proxyUrl: `http://127.0.0.1:${port}` }), (error) =>
    error instanceof ProxyUnreachable && error instanceof IdemProxyError);
  await assert.rejects(Run.start({ ...quiet, runId: "no spaces", proxyUrl: proxy.url }), RangeError);
  await assert.rejects(Run.start({ ...quiet, runId, proxyUrl: proxy.url, timeoutS: -1 }), (error) =>
    error instanceof ProblemError && error.status === 400 && error.slug === "invalid-body");
  // a handed attempt of a run that is gone is registered again; a show of one is a 404
  const gone = await fetch(`${proxy.url}/runs/${runId}-none`);
  assert.equal(gone.status, 404);
  const { problemFromResponse } = await import("../dist/index.js");
  assert.ok(problemFromResponse(404, {}) instanceof RunNotFound);
  assert.ok(problemFromResponse(412, { type: "https://idemproxy.dev/problems/stale-epoch" }) instanceof Superseded);
  assert.equal(problemFromResponse(409, { type: "https://idemproxy.dev/problems/run-ended" }).slug, "run-ended");
});

/** Run `code` (an ES module using the client) in a child node process; resolves to its exit. */
function child(code, env = {}) {
  return new Promise((resolve) => {
    const started = Date.now();
    const [command, ...args] = moduleCommand(`import { Run } from ${JSON.stringify(DIST)};\n${code}`);
    const proc = spawn(command, args, {
      env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"],
    });
    let output = "";
    proc.stdout.on("data", (chunk) => (output += chunk));
    proc.stderr.on("data", (chunk) => (output += chunk));
    const killer = setTimeout(() => proc.kill("SIGKILL"), 15_000);
    proc.on("exit", (code, signal) => {
      clearTimeout(killer);
      resolve({ code, signal, output, seconds: (Date.now() - started) / 1000 });
    });
  });
}

test("nothing keeps the event loop alive after complete() or fail()", async () => {
  for (const end of ["complete()", "fail('given up')"]) {
    const runId = newId("exit");
    const exited = await child(`
      const run = await Run.start({ runId: ${JSON.stringify(runId)}, proxyUrl: ${JSON.stringify(proxy.url)},
        timeoutS: 30, heartbeat: 0.05, attach: true, env: {} });
      await run.attachment.waitAttached(5);
      await new Promise((resolve) => setTimeout(resolve, 200)); // beats go out
      await run.${end};
      console.log("ended at", Date.now());
    `);
    assert.equal(exited.code, 0, exited.output);
    assert.match(exited.output, /ended at (\d+)/);
    const endedAt = Number(/ended at (\d+)/.exec(exited.output)[1]);
    assert.ok(Date.now() - endedAt < 3000, `the process lingered after ${end}`);
    assert.equal((await proxy.adminRun(runId)).state, end.startsWith("complete") ? "completed" : "failed");
  }
});

test("a process that forgets to end its run still exits; the run stays running, as after a crash", async () => {
  const runId = newId("forgot");
  const exited = await child(`
    const run = await Run.start({ runId: ${JSON.stringify(runId)}, proxyUrl: ${JSON.stringify(proxy.url)},
      timeoutS: 30, heartbeat: 0.05, attach: true, env: {} });
    await run.attachment.waitAttached(5);
    console.log("done without complete()");
  `);
  assert.equal(exited.code, 0, exited.output);
  assert.ok(exited.seconds < 10);
  assert.equal((await proxy.adminRun(runId)).state, "running");
});

test("a killed process's held connection marks its attempt lost, its exit seen on this host", async () => {
  const runId = newId("killed");
  const [command, ...args] = moduleCommand(`
    import { Run } from ${JSON.stringify(DIST)};
    const run = await Run.start({ runId: ${JSON.stringify(runId)}, proxyUrl: ${JSON.stringify(proxy.url)},
      timeoutS: 30, heartbeat: false, attach: true, env: {} });
    await run.attachment.waitAttached(5);
    console.log("attached");
    setInterval(() => {}, 1000); // at work
  `);
  const proc = spawn(command, args, { stdio: ["ignore", "pipe", "inherit"] });
  await new Promise((resolve) => proc.stdout.once("data", resolve));
  proc.kill("SIGKILL");
  const lost = await until(async () => (await proxy.adminRun(runId)).history
    .find((event) => event.event === "attachment-lost"), 10, "the attempt marked lost");
  assert.equal(lost.epoch, 0);
  assert.equal(lost.process, "exited"); // Idem-Process named this process as the proxy sees it
});

test("Run.run completes the run when the work returns and fails it when it throws", async () => {
  const done = newId("block-ok");
  assert.equal(await Run.run({ ...quiet, runId: done, proxyUrl: proxy.url }, async (run) => run.epoch + 41), 41);
  assert.equal((await proxy.adminRun(done)).state, "completed");
  const failed = newId("block-fail");
  let inside;
  await assert.rejects(Run.run({ ...quiet, runId: failed, proxyUrl: proxy.url }, async (run) => {
    inside = run;
    throw new Error("the tool is down");
  }), /the tool is down/);
  assert.equal(inside.failReason, "the tool is down");
  assert.equal((await proxy.adminRun(failed)).state, "failed");
});
