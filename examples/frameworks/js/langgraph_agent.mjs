// LangGraph.js through idemproxy: a normal tool-calling graph, three lines changed.
//
// The graph every LangGraph.js tutorial builds: a model node with tools bound, a `ToolNode`,
// and `toolsCondition` between them. What makes it crash-safe, marked `// idemproxy` below:
//
// 1. `Run.run` around the whole, so a restarted process continues the same run (and it is
//    completed when the graph ends);
// 2. `ChatOpenAI` on the run's base URL through its `configuration` (`baseURL` and
//    `defaultHeaders` are handed to the OpenAI client inside): model calls journaled;
// 3. the tools' HTTP calls through the run (`run.fetch`) with explicit keys (`run.key(...)`).
//
// The graph keeps no checkpoint across processes here, so a restarted process runs it from
// the start: the model calls and tool calls the crashed attempt made are answered from the
// journal (nothing paid or charged twice), and the graph goes live where the crash was. With
// a durable checkpointer, the node in flight at the crash runs again: its calls are answered
// from the journal the same way (docs/recipes.md). ChatOpenAI's retries (`maxRetries`, 2 by
// default in the OpenAI client inside) stay on.
//
//     cd examples/frameworks/js && npm ci      # this folder's package.json and lockfile
//     IDEM_RUN_ID=order-46 node examples/frameworks/js/langgraph_agent.mjs --crash-after charge_card
//
// `--crash-after TOOL` SIGKILLs the process right after that tool's side effect; the
// supervisor starts this file again (hook `js_langgraph` in examples/frameworks/config.toml).

import { parseArgs } from "node:util";

import { HumanMessage, SystemMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { END, MessagesAnnotation, START, StateGraph } from "@langchain/langgraph";
import { ToolNode, toolsCondition } from "@langchain/langgraph/prebuilt";
import { ChatOpenAI } from "@langchain/openai";
import { z } from "zod";
import { Run } from "@idemproxy/client";

import { orderPrompt, toolCaller } from "./order_tools.mjs";

const ORDER = { order: "46", email: "barbara@example.com", amountCents: 6600 };
const INSTRUCTIONS = "You fulfil orders: email the customer, charge the card, send the receipt.";

const { values: args } = parseArgs({
  options: { "crash-after": { type: "string" } }, // SIGKILL this process after that tool's call
});

function buildGraph(run) {
  const call = toolCaller(run, args["crash-after"]);
  const tools = [
    tool(async ({ to, subject }) => `email ${(await call("send_email", { to, subject }, to, subject)).n} sent`,
      { name: "send_email", description: "Email a customer.", schema: z.object({ to: z.string(), subject: z.string() }) }),
    tool(async ({ order, amount_cents }) => `charge ${(await call("charge_card", { order, amount_cents }, order)).n} made`,
      { name: "charge_card", description: "Charge the card on file for an order.",
        schema: z.object({ order: z.string(), amount_cents: z.number().int() }) }),
    tool(async ({ to, order }) => `receipt ${(await call("send_receipt", { to, order }, order)).n} sent`,
      { name: "send_receipt", description: "Send the receipt of an order.",
        schema: z.object({ to: z.string(), order: z.string() }) }),
  ];
  const model = new ChatOpenAI({
    model: "gpt-4o-mini",
    apiKey: process.env.OPENAI_API_KEY || "idemproxy-injected", // the credential decides the journal's tenant
    configuration: { baseURL: run.url("openai", "/v1"), defaultHeaders: run.headers }, // idemproxy
  }).bindTools(tools);
  return new StateGraph(MessagesAnnotation)
    .addNode("agent", async ({ messages }) => ({ messages: [await model.invoke(messages)] }))
    .addNode("tools", new ToolNode(tools))
    .addEdge(START, "agent")
    .addConditionalEdges("agent", toolsCondition, ["tools", END])
    .addEdge("tools", "agent")
    .compile();
}

const output = await Run.run({ hook: "js_langgraph" }, async (run) => { // idemproxy
  console.log(`run ${run.runId} epoch ${run.epoch}`);
  const { messages } = await buildGraph(run).invoke({
    messages: [new SystemMessage(INSTRUCTIONS), new HumanMessage(orderPrompt(ORDER))],
  });
  return messages.at(-1).content;
});
console.log(`done: ${output}`);
