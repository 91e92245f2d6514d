// Standbys: with `[hooks.NAME] standby = 1` the supervisor keeps a node process of the hook
// started ahead; Run.start() waits in it until the supervisor names the run over stdin, then
// the process is a hook-started agent. Stopping the supervisor lets an idle standby go.

import assert from "node:assert/strict";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { ADMIN_TOKEN, scriptCommand, startProxy, startUpstream, until } from "./helpers.mjs";

const DIST = fileURLToPath(new URL("../dist/index.js", import.meta.url));
const AGENT = `
import { appendFileSync } from "node:fs";
const said = (event, facts) => appendFileSync(process.argv[2], JSON.stringify({ event, pid: process.pid, ...facts }) + "\\n");
said("up", { standby: process.env.IDEM_STANDBY ?? null, run: process.env.IDEM_RUN_ID ?? null });
const { Run } = await import(${JSON.stringify(DIST)});
const run = await Run.start({ heartbeat: false });
said("assigned", { run: run.runId, epoch: run.epoch, standby: process.env.IDEM_STANDBY ?? null,
  token: run.token !== undefined, base: run.baseUrl.startsWith(process.env.IDEM_RUN_BASE ?? "?") });
await run.complete();
said("done", {});
`;

let dir;
let upstream;
let proxy;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "idemproxy-standby-"));
  writeFileSync(join(dir, "agent.mjs"), AGENT);
  upstream = await startUpstream();
  proxy = await startProxy(upstream, {
    supervisor: { enabled: true, interval_s: 0.2 },
    runs: { timeout_s: 60, grace_s: 30, backoff_base_s: 0.2 },
    "hooks.agent": { command: scriptCommand(join(dir, "agent.mjs"), join(dir, "said.jsonl")), standby: 1,
      log_dir: join(dir, "logs"), allow_tenants: ["default"] },
  });
});

after(async () => {
  await proxy?.stop();
  await upstream?.close();
  rmSync(dir, { recursive: true, force: true });
});

const said = (event) => (existsSync(join(dir, "said.jsonl"))
  ? readFileSync(join(dir, "said.jsonl"), "utf8").trim().split("\n").map((line) => JSON.parse(line))
    .filter((line) => line.event === event)
  : []);

const alive = (pid) => {
  try {
    process.kill(pid, 0);
    return !/\) Z /.test(readFileSync(`/proc/${pid}/stat`, "utf8"));
  } catch {
    return false;
  }
};

test("a standby started ahead is handed the run and continues it as a hook-started agent", async () => {
  const registered = await fetch(`${proxy.url}/runs/r`, { method: "POST", body: JSON.stringify({ hook: "agent" }) });
  assert.equal(registered.status, 201);
  const [up] = await until(() => said("up").length && said("up"), 20, "a standby up");
  assert.equal(up.standby, "1");
  assert.equal(up.run, null);
  await new Promise((resolve) => setTimeout(resolve, 500)); // it says ready once Run.start() waits

  const restarted = await fetch(`${proxy.url}/admin/runs/r/restart`, {
    method: "POST", headers: { Authorization: `Bearer ${ADMIN_TOKEN}` },
  });
  assert.equal(restarted.status, 200, await restarted.clone().text());
  const [assigned] = await until(() => said("assigned").length && said("assigned"), 20, "the run assigned");
  assert.equal(assigned.pid, up.pid); // the process started ahead, not a new one
  assert.deepEqual({ ...assigned, pid: undefined }, {
    event: "assigned", pid: undefined, run: "r", epoch: 1, standby: null, token: assigned.token, base: true,
  });
  await until(() => said("done").length, 20, "the agent done");
  await until(async () => (await proxy.adminRun("r"))?.state === "completed", 10, "the run completed");
});

test("an idle standby exits when its supervisor stops", async () => {
  const idle = await until(() => said("up").find((line) => line.pid !== said("assigned")[0]?.pid && alive(line.pid)),
    20, "a replacement standby up");
  await proxy.stop();
  await until(() => !alive(idle.pid), 10, "the idle standby gone");
});
