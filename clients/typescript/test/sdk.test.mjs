// SDK retries must not shift derived keys. The OpenAI Node SDK retries inside its fetch
// (X-Stainless-Retry-Count), the AI SDK on its own (maxRetries, 2 by default): an agent on
// either, with retries on and faults injected upstream (500, 429, a dropped connection),
// crashes after step 3 of 6; its next attempt replays steps 1-3 from the journal and goes live
// at step 4, and the upstream saw exactly one successful model call and one tool call per step.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { createOpenAI } from "@ai-sdk/openai";
import { generateText } from "ai";
import OpenAI from "openai";

import { Run } from "../dist/index.js";
import { startProxy, startUpstream } from "./helpers.mjs";

const STEPS = 6;
const CRASH_AT = 3;
const CHAT = "/v1/chat/completions";
// Faults the model upstream answers before each step's success, by attempt (epoch) and step.
// A replayed step never reaches the upstream, so none are planned for epoch 1's steps 1-3.
const FAULTS = {
  0: { 1: [500], 2: [429], 3: ["drop"] },
  1: { 4: [500, 503], 5: [429], 6: [] },
};

let upstream;
let proxy;

before(async () => {
  upstream = await startUpstream();
  proxy = await startProxy(upstream);
});

after(async () => {
  await proxy?.stop();
  await upstream?.close();
});

class Crash extends Error {}

/**
 * The agent: each step a model call through `ask(system, user)` and a tool call with an explicit key. On
 * epoch 0 it "dies" after step CRASH_AT (an exception; it never ends its run). Returns what
 * each step saw.
 */
async function agent(run, ask) {
  const served = [];
  let last = "nothing yet";
  for (let step = 1; step <= STEPS; step++) {
    upstream.fail(CHAT, ...(FAULTS[run.epoch][step] ?? []));
    const reply = await ask("You are a careful agent.", `Step ${step} of ${STEPS}. Last tool result: ${last}.`);
    const sent = await run.fetch(run.url("tools", "/record_step"), {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": run.key("record_step", step) },
      body: JSON.stringify({ step, plan: reply.text }),
    });
    assert.equal(sent.status, 200);
    last = `entry ${(await sent.json()).n}`;
    served.push({ step, model: reply.replayed, tool: sent.headers.get("idempotent-replayed") === "true", text: reply.text });
    if (step === CRASH_AT && run.epoch === 0) throw new Crash(`crash after step ${step}`);
  }
  await run.complete();
  return served;
}

async function crashAndResume(runId, makeAsk) {
  const before = { chat: upstream.count("chat"), tool: upstream.count("tool:record_step") };
  const first = await Run.start({ runId, proxyUrl: proxy.url, env: {}, log: null, heartbeat: false });
  let firstServed;
  await assert.rejects(agent(first, makeAsk(first, (served) => (firstServed = served))), Crash);
  const second = await Run.start({ runId, proxyUrl: proxy.url, env: {}, log: null, heartbeat: false });
  assert.equal(second.epoch, 1);
  const served = await agent(second, makeAsk(second));
  assert.equal((await proxy.adminRun(runId)).state, "completed");
  return {
    served,
    chat: upstream.count("chat") - before.chat,
    tool: upstream.count("tool:record_step") - before.tool,
  };
}

function checkReplay({ served, chat, tool }, firstTexts) {
  assert.deepEqual(served.map((s) => [s.step, s.model, s.tool]), [
    [1, true, true], [2, true, true], [3, true, true], [4, false, false], [5, false, false], [6, false, false]]);
  assert.deepEqual(served.slice(0, CRASH_AT).map((s) => s.text), firstTexts); // the recorded answers
  assert.equal(chat, STEPS); // one successful model call per step, retries and all
  assert.equal(tool, STEPS);
}

test("OpenAI Node SDK with retries: every step before the crash replays", async () => {
  const firstTexts = [];
  const retryCounts = () => upstream.seen.filter((r) => r.path === CHAT)
    .map((r) => r.headers["x-stainless-retry-count"]);
  const seenBefore = retryCounts().length;
  const failedBefore = upstream.count(`failed:${CHAT}`) + upstream.count(`dropped:${CHAT}`);
  const askedAfterCrash = []; // the retry count of each model call the SDK made in the second attempt
  const result = await crashAndResume("ts-sdk-openai", (run) => {
    const llm = new OpenAI({
      baseURL: run.url("openai", "/v1"), defaultHeaders: run.headers, apiKey: "sk-test", maxRetries: 3,
      fetch: (url, init) => {
        if (run.epoch === 1) askedAfterCrash.push(new Headers(init?.headers).get("x-stainless-retry-count"));
        return fetch(url, init);
      },
    });
    return async (system, user) => {
      const messages = [{ role: "system", content: system }, { role: "user", content: user }];
      const { data, response } = await llm.chat.completions.create({ model: "gpt-4o-mini", messages }).withResponse();
      const text = data.choices[0].message.content;
      if (run.epoch === 0) firstTexts.push(text);
      return { text, replayed: response.headers.get("idempotent-replayed") === "true" };
    };
  });
  checkReplay(result, firstTexts);
  assert.equal(upstream.count(`failed:${CHAT}`) + upstream.count(`dropped:${CHAT}`) - failedBefore, 6);
  const counts = retryCounts().slice(seenBefore);
  assert.ok(counts.includes("1") && counts.includes("2"), `retries went through the proxy: ${counts}`);
  // Steps 1-3 were journaled from the SDK's first retries (a fault, then retry 1); after the
  // crash the same steps were asked with retry count 0 and replayed: the count is no part of the key.
  assert.deepEqual(counts.slice(0, 2 * CRASH_AT), ["0", "1", "0", "1", "0", "1"]);
  assert.deepEqual(askedAfterCrash.slice(0, CRASH_AT), ["0", "0", "0"]);
});

test("Vercel AI SDK with its default retries: every step before the crash replays", async () => {
  const firstTexts = [];
  const failedBefore = upstream.count(`failed:${CHAT}`) + upstream.count(`dropped:${CHAT}`);
  let sent = 0; // model calls the SDK itself made, its retries included
  const counted = (url, init) => {
    sent += 1;
    return fetch(url, init);
  };
  const result = await crashAndResume("ts-sdk-ai", (run) => {
    const provider = createOpenAI({
      baseURL: run.url("openai", "/v1"), headers: run.headers, apiKey: "sk-test", fetch: counted,
    });
    return async (system, user) => {
      const { text, response } = await generateText({ model: provider.chat("gpt-4o-mini"), system, prompt: user }); // maxRetries: 2
      if (run.epoch === 0) firstTexts.push(text);
      return { text, replayed: response.headers?.["idempotent-replayed"] === "true" };
    };
  });
  checkReplay(result, firstTexts);
  assert.equal(upstream.count(`failed:${CHAT}`) + upstream.count(`dropped:${CHAT}`) - failedBefore, 6);
  // The retries were the SDK's, not the proxy's: each fault reached the SDK, which sent again.
  // 6 steps live + 6 faults retried + 3 steps replayed after the crash
  assert.equal(sent, STEPS + 6 + CRASH_AT);
});
