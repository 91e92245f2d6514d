/**
 * A standby: this process was started ahead by the supervisor and waits to be told its run.
 *
 * With `[hooks.NAME] standby = N` the supervisor keeps N processes of the hook's command
 * started, imported and idle, with `IDEM_STANDBY=1`, no `IDEM_RUN_ID`, and a private Unix
 * socket to the supervisor as stdin. `waitForAssignment()` says `ready` on it, reads one JSON
 * line of `IDEM_*` facts and puts them into `process.env`: from then on the process is a
 * hook-started agent. `Run.start()` calls it, so import what you can before it.
 */

import { fstatSync, writeSync } from "node:fs";
import { Socket } from "node:net";

export const STANDBY_ENV = "IDEM_STANDBY";
const READY = "ready\n";

/** The supervisor let this standby go without a run (it stopped or died). */
export class StandbyDismissed extends Error {
  constructor() {
    super("the supervisor let this standby go without a run");
    this.name = "StandbyDismissed";
  }
}

let waiting: Promise<Record<string, string>> | undefined;

/** Whether this process is a standby still waiting for its run. */
export function isStandby(env: Readonly<Record<string, string | undefined>> = process.env): boolean {
  return env[STANDBY_ENV] === "1" && !env.IDEM_RUN_ID;
}

/**
 * If this process is a standby, wait until the supervisor names its run, put the `IDEM_*`
 * facts into `process.env` and return them; otherwise resolve to null at once.
 *
 * When the supervisor goes away first, the process exits with code 0, as a Python standby
 * does (`exit: false` rejects with `StandbyDismissed` instead). `IDEM_STANDBY=1` without the
 * supervisor's channel on stdin (copied by hand) rejects with an Error.
 */
export async function waitForAssignment(options: { exit?: boolean } = {}): Promise<Record<string, string> | null> {
  if (waiting === undefined) {
    if (!isStandby()) return null;
    waiting = assignment().finally(() => {
      waiting = undefined;
    });
  }
  try {
    return await waiting;
  } catch (error) {
    if (error instanceof StandbyDismissed && options.exit !== false) process.exit(0);
    throw error;
  }
}

function assignment(): Promise<Record<string, string>> {
  let socket = false;
  try {
    socket = fstatSync(0).isSocket();
  } catch {
    socket = false;
  }
  if (!socket) {
    return Promise.reject(new Error(`${STANDBY_ENV}=1, but stdin is not a supervisor's standby channel; `
      + `unset ${STANDBY_ENV}`));
  }
  let channel: NodeJS.ReadableStream & { destroy(): void };
  try {
    channel = sayReady();
  } catch (error) {
    const code = (error as NodeJS.ErrnoException).code;
    return Promise.reject(code === "EPIPE" || code === "ECONNRESET" ? new StandbyDismissed() : error);
  }
  return new Promise((resolve, reject) => {
    let line = "";
    let settled = false;
    const settle = (error: Error | undefined, facts?: Record<string, string>) => {
      if (settled) return;
      settled = true;
      channel.destroy(); // the channel is done; as a spawned hook's, stdin gives nothing more
      if (error) reject(error);
      else resolve(facts!);
    };
    channel.setEncoding("utf8");
    channel.on("data", (chunk: string) => {
      line += chunk;
      const end = line.indexOf("\n");
      if (end < 0) return;
      try {
        const facts = parseFacts(line.slice(0, end));
        Object.assign(process.env, facts);
        delete process.env[STANDBY_ENV]; // not handed on to what this agent starts
        settle(undefined, facts);
      } catch (error) {
        settle(error as Error);
      }
    });
    channel.on("end", () => settle(new StandbyDismissed()));
    channel.on("error", (error: NodeJS.ErrnoException) =>
      settle(error.code === "EPIPE" || error.code === "ECONNRESET" ? new StandbyDismissed() : error));
  });
}

/**
 * Say `ready` on the channel (fd 0) and return what reads it. Node and Bun write it with
 * writeSync and read through `process.stdin` (Bun's net.Socket cannot adopt an inherited
 * descriptor); Deno's fs cannot write to a socket (ENOSYS), its net.Socket on fd 0 does both.
 */
function sayReady(): NodeJS.ReadableStream & { destroy(): void } {
  try {
    writeSync(0, READY);
    return process.stdin;
  } catch (error) {
    if ((error as NodeJS.ErrnoException).code !== "ENOSYS") throw error;
  }
  const socket = new Socket({ fd: 0, readable: true, writable: true });
  socket.write(READY);
  return socket;
}

function parseFacts(line: string): Record<string, string> {
  let facts: unknown;
  try {
    facts = JSON.parse(line);
  } catch {
    facts = undefined;
  }
  if (facts === null || typeof facts !== "object" || Array.isArray(facts)
      || !(facts as Record<string, unknown>).IDEM_RUN_ID
      || !Object.entries(facts).every(([name, value]) => name.startsWith("IDEM_") && typeof value === "string")) {
    throw new Error(`not a standby assignment: ${line.slice(0, 200)}`);
  }
  return facts as Record<string, string>;
}
