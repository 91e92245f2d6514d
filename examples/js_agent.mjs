// A JavaScript agent on the official OpenAI Node SDK, made replay-safe with @idemproxy/client.
//
// Each step is a model call (journaled by the proxy under a key it derives itself) and a tool
// POST (journaled under an explicit key from run.key). Started with --crash-at K it kills
// itself with SIGKILL after step K, like an OOM kill: no cleanup, no goodbye. The supervisor
// notices and starts it again through a command hook that runs `node` (in examples/config.toml
// terms: [hooks.js_agent] command = ["node", "examples/js_agent.mjs"]); the new attempt
// replays steps 1..K from the journal, nothing reaches the provider or the tool twice, and it
// goes live at step K+1.
//
//     npm install @idemproxy/client openai
//     IDEM_RUN_ID=js-1 node examples/js_agent.mjs --steps 6 --crash-at 3
//
// Each step prints whether its calls were "replayed" from the journal or "live".

import { parseArgs } from "node:util";

import OpenAI from "openai";
import { Run } from "@idemproxy/client";

const DEFAULT_STEPS = 6;
const SYSTEM = "You are a careful agent. Answer in one sentence what to do next.";

const { values: args } = parseArgs({
  options: {
    steps: { type: "string" }, // kept with the run, so a restarted attempt does the same task
    "crash-at": { type: "string" }, // SIGKILL this process after step K
    hook: { type: "string", default: "js_agent" },
  },
});

/** How the proxy answered: from its journal, or by calling the upstream. */
const served = (headers) => (headers.get("idempotent-replayed") === "true" ? "replayed" : "live");

// The task's inputs live with the run (its metadata): the attempt the supervisor starts gets
// no arguments and reads them back from the proxy.
const run = await Run.start({
  hook: args.hook,
  metadata: args.steps !== undefined ? { steps: Number(args.steps) } : undefined,
});
const steps = Number(run.info?.metadata.steps ?? DEFAULT_STEPS);
console.log(`run ${run.runId} epoch ${run.epoch}: ${steps} steps`);

const llm = new OpenAI({
  baseURL: run.url("openai", "/v1"), // {proxy}/runs/{run}/epochs/{epoch}[/cap/{token}]/openai/v1
  defaultHeaders: run.headers,
  apiKey: process.env.OPENAI_API_KEY ?? "idemproxy-injected", // the proxy may inject the real one
});

let lastResult = "nothing yet";
for (let step = 1; step <= steps; step++) {
  const { data, response } = await llm.chat.completions.create({
    model: "gpt-4o-mini",
    messages: [
      { role: "system", content: SYSTEM },
      { role: "user", content: `Step ${step} of ${steps}. Last tool result: ${lastResult}.` },
    ],
  }).withResponse();
  const plan = data.choices[0].message.content ?? "";
  // The key exists before the call and is the same in every attempt: a restarted attempt's
  // POST meets the crashed one's journal entry.
  const sent = await run.fetch(run.url("tools", "/record_step"), {
    method: "POST",
    headers: { "Content-Type": "application/json", "Idempotency-Key": run.key("record_step", step) },
    body: JSON.stringify({ step, plan }),
  });
  if (!sent.ok) throw new Error(`record_step answered ${sent.status}: ${await sent.text()}`);
  lastResult = `entry ${(await sent.json()).n}`;
  console.log(`step ${step}/${steps}: model ${served(response.headers)}, tool ${served(sent.headers)}: ${plan}`);
  if (step === Number(args["crash-at"])) {
    console.log(`crash: SIGKILL after step ${step}`);
    process.kill(process.pid, "SIGKILL");
  }
}

const ended = await run.complete(); // never restarted again; nothing keeps the process alive
console.log(`done: ${steps} steps, run ${run.runId} is ${ended?.state ?? "?"}`);
