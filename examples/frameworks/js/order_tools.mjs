// What the JavaScript recipes share: the order's prompt and the tools' HTTP calls through a run.

/** The task, with the PLAN line the fake provider (tests/support/fake_provider.py) follows as the model. */
export function orderPrompt({ order, email, amountCents }) {
  const plan = [
    { tool: "send_email", args: { to: email, subject: `Order ${order} is on its way` } },
    { tool: "charge_card", args: { order, amount_cents: amountCents } },
    { tool: "send_receipt", args: { to: email, order } },
  ];
  return `Fulfil order ${order} for ${email}.\nPLAN: ${JSON.stringify(plan)}`;
}

/**
 * `call(tool, payload, ...keyParts)`: POST the payload to the `tools` upstream through the run,
 * under the explicit key `run.key(tool, ...keyParts)` — the same in every attempt, so an
 * attempt that calls again gets the recorded answer. Prints whether the answer was replayed;
 * SIGKILLs the process right after `crashAfter`'s side effect, before the framework hears of it.
 */
export function toolCaller(run, crashAfter) {
  return async (tool, payload, ...keyParts) => {
    const answer = await run.fetch(run.url("tools", `/${tool}`), {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": run.key(tool, ...keyParts) }, // idemproxy
      body: JSON.stringify(payload),
    });
    if (!answer.ok) throw new Error(`${tool} answered ${answer.status}: ${await answer.text()}`);
    const result = await answer.json();
    const served = answer.headers.get("idempotent-replayed") === "true" ? "replayed" : "live";
    console.log(`tool ${tool}: ${served} #${result.n}`);
    if (tool === crashAfter) {
      console.log(`crash: SIGKILL after ${tool}`);
      process.kill(process.pid, "SIGKILL");
    }
    return result;
  };
}
