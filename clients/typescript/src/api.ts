/**
 * The agent-facing runs API of idemproxy over the global `fetch`. Each call is described
 * once (`Call`); `RunsAPI.send` adds the binding's headers and the epoch, and translates
 * answers and errors in one place.
 */

import type { Binding } from "./binding.js";
import { IdemProxyError, ProxyUnreachable, problemFromResponse } from "./errors.js";
import { type RunInfo, runInfo } from "./info.js";

export const RUN_HEADER = "Idem-Run";
export const EPOCH_HEADER = "Idem-Epoch";
export const KEY_HEADER = "Idempotency-Key";
export const POLICY_HEADER = "Idem-Policy";
export const PROCESS_HEADER = "Idem-Process";

/** What a run is registered with; undefined leaves the proxy's value (or its default). */
export interface Registration {
  timeoutS?: number;
  graceS?: number;
  maxRestarts?: number;
  hook?: string;
  metadata?: Record<string, unknown>;
}

/** One request of the runs API. */
export interface Call {
  readonly method: "GET" | "POST";
  readonly path: string;
  readonly json?: Record<string, unknown>;
  readonly epoch?: number; // sent as Idem-Epoch, so the proxy can fence a zombie's call
}

/** A successful answer: the run, whether the call created something (201), its token. */
export interface Answer {
  readonly run: RunInfo;
  readonly created: boolean;
  readonly token?: string;
}

export function registrationBody(options: Registration): Record<string, unknown> {
  const fields: Record<string, unknown> = {
    timeout_s: options.timeoutS, grace_s: options.graceS, max_restarts: options.maxRestarts,
    hook: options.hook, metadata: options.metadata,
  };
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined && value !== null));
}

export const calls = {
  register: (runId: string, options: Registration): Call =>
    ({ method: "POST", path: runPath(runId), json: registrationBody(options) }),
  show: (runId: string): Call => ({ method: "GET", path: runPath(runId) }),
  newAttempt: (runId: string): Call => ({ method: "POST", path: `${runPath(runId)}/attempts` }),
  heartbeat: (runId: string, epoch: number): Call => ({ method: "POST", path: `${runPath(runId)}/heartbeat`, epoch }),
  detach: (runId: string, epoch: number): Call => ({ method: "POST", path: `${runPath(runId)}/detach`, epoch }),
  complete: (runId: string, epoch: number): Call => ({ method: "POST", path: `${runPath(runId)}/complete`, epoch }),
  fail: (runId: string, epoch: number): Call => ({ method: "POST", path: `${runPath(runId)}/fail`, epoch }),
};

export function runPath(runId: string): string {
  // Run ids are [A-Za-z0-9._:-]; encoding anyway keeps a bad id from changing the path.
  return `/runs/${encodeURIComponent(runId).replaceAll("%3A", ":")}`;
}

/** Client of the runs API of one proxy, for one run's binding. */
export class RunsAPI {
  constructor(readonly proxyUrl: string, readonly binding: Binding, readonly timeoutMs = 10_000) {}

  /** Send one call; throws a ProblemError, ProxyUnreachable or IdemProxyError. */
  async send(call: Call): Promise<Answer> {
    const headers: Record<string, string> = { Accept: "application/json", ...this.binding.headers() };
    if (call.epoch !== undefined) headers[EPOCH_HEADER] = String(call.epoch);
    let body: string | undefined;
    if (call.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(call.json);
    }
    let response: Response;
    let text: string;
    try {
      response = await fetch(this.proxyUrl + call.path, {
        method: call.method, headers, body, signal: AbortSignal.timeout(this.timeoutMs),
      });
      text = await response.text();
    } catch (error) {
      throw new ProxyUnreachable(`${call.method} ${call.path}: ${describe(error)}`, { cause: error });
    }
    let parsed: unknown = undefined;
    try {
      parsed = text ? JSON.parse(text) : undefined;
    } catch {
      parsed = undefined;
    }
    if (!response.ok) throw problemFromResponse(response.status, parsed);
    if (parsed === null || typeof parsed !== "object" || !("run_id" in parsed)) {
      throw new IdemProxyError(`${call.method} ${call.path}: answer ${response.status} is not run JSON`);
    }
    const members = parsed as Record<string, unknown>;
    return {
      run: runInfo(members),
      created: response.status === 201,
      token: typeof members.token === "string" ? members.token : undefined,
    };
  }
}

function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = (error as { cause?: unknown }).cause;
    return cause instanceof Error ? `${error.message} (${cause.message})` : error.message;
  }
  return String(error);
}
