// OpenAI Agents JS through idemproxy: a normal agent, four lines changed.
//
// An order agent with three function tools that act on the world (send an email, charge a
// card, send a receipt). What makes it crash-safe, marked `// idemproxy` below:
//
// 1. `Run.run` around the whole, so a restarted process continues the same run (and it is
//    completed when the agent returns);
// 2. the SDK's default client on the run's base URL (`run.url("openai", "/v1")`, with
//    `run.headers`) through `setDefaultOpenAIClient`: every model call is journaled under a
//    key the proxy derives;
// 3. the tools' HTTP calls through the run (`run.fetch`) with explicit keys (`run.key(...)`):
//    the same key in every attempt, so a replay is the recorded answer;
// 4. the SDK's traces sent through the proxy too (passthrough, never recorded) — or leave them
//    on their default, OpenAI's endpoint, which the journal does not need.
//
// The SDK's own retries stay at their defaults (the OpenAI client retries 408, 409, 429 and
// 5xx; the proxy records none of those), and so does tracing.
//
//     cd examples/frameworks/js && npm ci      # this folder's package.json and lockfile
//     IDEM_RUN_ID=order-45 node examples/frameworks/js/openai_agents_agent.mjs --crash-after charge_card
//
// `--crash-after TOOL` SIGKILLs the process right after that tool's side effect, before the
// SDK hears of it; the supervisor starts this file again (hook `js_openai_agents` in
// examples/frameworks/config.toml) and the new attempt replays up to there, then goes live.

import { parseArgs } from "node:util";

import {
  Agent, BatchTraceProcessor, OpenAITracingExporter, run as runAgent, setDefaultOpenAIClient,
  setOpenAIAPI, setTraceProcessors, tool,
} from "@openai/agents";
import OpenAI from "openai";
import { z } from "zod";
import { Run } from "@idemproxy/client";

import { orderPrompt, toolCaller } from "./order_tools.mjs";

const ORDER = { order: "45", email: "grace@example.com", amountCents: 5100 };
const INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt.";

const { values: args } = parseArgs({
  options: {
    api: { type: "string", default: process.env.AGENT_OPENAI_API ?? "responses" }, // or "chat_completions"
    "crash-after": { type: "string" }, // SIGKILL this process after that tool's call
  },
});

function buildAgent(run) {
  const call = toolCaller(run, args["crash-after"]);
  const sendEmail = tool({
    name: "send_email", description: "Email a customer.",
    parameters: z.object({ to: z.string(), subject: z.string() }),
    execute: async ({ to, subject }) => `email ${(await call("send_email", { to, subject }, to, subject)).n} sent`,
  });
  const chargeCard = tool({
    name: "charge_card", description: "Charge the card on file for an order.",
    parameters: z.object({ order: z.string(), amount_cents: z.number().int() }),
    execute: async ({ order, amount_cents }) =>
      `charge ${(await call("charge_card", { order, amount_cents }, order)).n} made`,
  });
  const sendReceipt = tool({
    name: "send_receipt", description: "Send the receipt of an order.",
    parameters: z.object({ to: z.string(), order: z.string() }),
    execute: async ({ to, order }) => `receipt ${(await call("send_receipt", { to, order }, order)).n} sent`,
  });
  return new Agent({ name: "orders", instructions: INSTRUCTIONS, model: "gpt-4o-mini",
    tools: [sendEmail, chargeCard, sendReceipt] });
}

const output = await Run.run({ hook: "js_openai_agents" }, async (run) => { // idemproxy
  console.log(`run ${run.runId} epoch ${run.epoch}: ${args.api}`);
  const baseURL = run.url("openai", "/v1"); // idemproxy
  // The credential decides the journal's tenant: every attempt sends the same one.
  const apiKey = process.env.OPENAI_API_KEY || "idemproxy-injected";
  setDefaultOpenAIClient(new OpenAI({ baseURL, apiKey, defaultHeaders: run.headers })); // idemproxy
  setOpenAIAPI(args.api);
  setTraceProcessors([new BatchTraceProcessor(new OpenAITracingExporter({ endpoint: `${baseURL}/traces/ingest`, apiKey }))]);
  const result = await runAgent(buildAgent(run), orderPrompt(ORDER));
  return result.finalOutput;
});
console.log(`done: ${output}`);
