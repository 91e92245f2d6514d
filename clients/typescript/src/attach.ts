/**
 * Holding an attempt's connection to the proxy: `POST /runs/{id}/attach`, kept open.
 *
 * When this process dies, its kernel closes the socket; the proxy waits a short grace
 * (`[runs] attach_grace_s`) and marks the attempt lost, so a supervisor restarts the run at
 * once instead of after `timeout_s` of silence. A connection that breaks while the process
 * lives (a blip, a proxy replica going away) is made again at once, then with backoff, well
 * within the grace. The hold ends by itself when the proxy says the attempt is over (the run
 * ended, a newer attempt exists, the attempt was found lost); `onOver` hears why.
 *
 * It runs on `node:http` rather than `fetch` so that its socket can be unref'd: a held
 * connection never keeps the process alive, like the Python client's daemon thread.
 */

import * as http from "node:http";
import * as https from "node:https";

import { EPOCH_HEADER, PROCESS_HEADER, runPath } from "./api.js";
import { Binding } from "./binding.js";
import { endsAttempt, type IdemProxyError, ProblemError, problemFromResponse, RunEnded, Superseded } from "./errors.js";
import { DEFAULT_PROXY_URL, type Env, launchFromEnv, tenantOf } from "./launch.js";
import { processToken } from "./process.js";

const RECONNECT_S = [0.05, 1.0] as const; // waits between failed tries, first and most
const IDLE_TIMEOUT_MS = 60_000; // the proxy sends a line every few seconds; silence past this is a dead link

export interface AttachmentOptions {
  proxyUrl?: string;
  /** The run's binding (tenant and token); built from `tenant` and `token` when not given. */
  binding?: Binding;
  tenant?: string;
  token?: string;
  /** Why the hold ended by itself: the attempt is over. */
  onOver?: (error: IdemProxyError) => void;
  warn?: (message: string) => void;
}

/** Holds one attempt's connection; see the module comment. */
export class Attachment {
  readonly runId: string;
  readonly epoch: number;
  readonly proxyUrl: string;
  /** Connections the proxy accepted so far. */
  connections = 0;
  /** Why the hold ended by itself, if it did. */
  over: IdemProxyError | undefined;
  readonly #binding: Binding;
  readonly #onOver: ((error: IdemProxyError) => void) | undefined;
  readonly #warn: (message: string) => void;
  #stopped = false;
  #request: http.ClientRequest | undefined;
  #wake: (() => void) | undefined;
  #held: Promise<void> | undefined;
  #attached: Promise<void>;
  #markAttached!: () => void;

  constructor(runId: string, epoch: number, options: AttachmentOptions = {}) {
    this.runId = runId;
    this.epoch = epoch;
    this.proxyUrl = (options.proxyUrl || DEFAULT_PROXY_URL).replace(/\/+$/, "");
    this.#binding = options.binding ?? new Binding(options.tenant, options.token);
    this.#onOver = options.onOver;
    this.#warn = options.warn ?? (() => {});
    this.#attached = new Promise((resolve) => {
      this.#markAttached = resolve;
    });
  }

  /** The attempt a hook started this process for (`IDEM_RUN_ID`, `IDEM_EPOCH`,
   * `IDEM_PROXY_URL`, `IDEM_NAMESPACE`, `IDEM_RUN_TOKEN`). */
  static fromEnv(env: Env = process.env, options: Omit<AttachmentOptions, "proxyUrl" | "binding"> = {}): Attachment {
    const launch = launchFromEnv(env);
    if (launch.runId === undefined || launch.epoch === undefined) {
      throw new RangeError("IDEM_RUN_ID and IDEM_EPOCH name the attempt to hold");
    }
    return new Attachment(launch.runId, launch.epoch, {
      ...options, proxyUrl: launch.proxyUrl, tenant: tenantOf(launch.namespace), token: launch.token,
    });
  }

  /** Start holding (in the background); returns this. */
  start(): this {
    this.#held ??= this.#hold();
    return this;
  }

  /** Whether the proxy accepted a connection within `timeoutS` seconds (the wait, unlike
   * the hold, keeps the process alive). */
  async waitAttached(timeoutS = 10): Promise<boolean> {
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<boolean>((resolve) => {
      timer = setTimeout(() => resolve(false), timeoutS * 1000);
    });
    try {
      return await Promise.race([this.#attached.then(() => true), late]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Close the connection (the proxy then waits out its grace) and end the hold. */
  async stop(): Promise<void> {
    this.#stopped = true;
    this.#request?.destroy();
    this.#wake?.();
    await this.#held;
  }

  async #hold(): Promise<void> {
    let delay = 0;
    while (!this.#stopped) {
      const before = this.connections;
      let over: IdemProxyError | undefined;
      try {
        over = await this.#connection();
      } catch (error) {
        if (this.#stopped) break;
        if (error instanceof ProblemError) {
          if (endsAttempt(error)) over = error;
          else this.#warn(`run ${this.runId}: attach refused (${error.message}); trying again`);
        } // else: the connection broke; make it again
      }
      if (over !== undefined) {
        this.over = over;
        this.#onOver?.(over);
        return;
      }
      if (this.#stopped) break;
      if (this.connections > before) delay = 0; // it was up: try again at once
      await this.#sleep(delay);
      delay = Math.min(Math.max(delay * 2, RECONNECT_S[0]), RECONNECT_S[1]);
    }
  }

  /** One connection, until it ends: why the attempt is over, or undefined (reconnect). */
  #connection(): Promise<IdemProxyError | undefined> {
    return new Promise((resolve, reject) => {
      const url = new URL(this.proxyUrl + runPath(this.runId) + "/attach");
      const headers: Record<string, string> = {
        ...this.#binding.headers(), [EPOCH_HEADER]: String(this.epoch),
        Accept: "application/x-ndjson", "Content-Length": "0",
      };
      const process = processToken(); // a proxy on this host then sees this process exit
      if (process !== undefined) headers[PROCESS_HEADER] = process;
      const transport = url.protocol === "https:" ? https : http;
      const request = transport.request(url, { method: "POST", headers, agent: false, timeout: IDLE_TIMEOUT_MS });
      this.#request = request;
      request.on("socket", (socket) => socket.unref());
      request.on("timeout", () => request.destroy(new Error("the held connection went silent")));
      request.on("error", reject);
      request.on("response", (response) => {
        response.setEncoding("utf8");
        let buffer = "";
        if ((response.statusCode ?? 500) >= 400) {
          response.on("data", (chunk: string) => (buffer += chunk));
          response.on("end", () => reject(problemFromResponse(response.statusCode ?? 500, parse(buffer))));
          return;
        }
        response.on("data", (chunk: string) => {
          buffer += chunk;
          for (let end = buffer.indexOf("\n"); end >= 0; end = buffer.indexOf("\n")) {
            const line = buffer.slice(0, end).trim();
            buffer = buffer.slice(end + 1);
            if (!line) continue;
            const said = parse(line);
            if (said === undefined) {
              request.destroy();
              reject(new Error(`not a JSON line: ${line.slice(0, 200)}`));
              return;
            }
            if ("attached" in said) {
              this.connections++;
              this.#markAttached();
            }
            const over = this.#over(said);
            if (over !== undefined) {
              request.destroy();
              resolve(over);
              return;
            }
          }
        });
        // The proxy is shutting down ({"closing": true}), or the stream was cut: reconnect.
        response.on("end", () => resolve(undefined));
        response.on("error", reject);
      });
      request.end();
    });
  }

  #over(said: Record<string, unknown>): IdemProxyError | undefined {
    if ("ended" in said) {
      return new RunEnded(409, "run-ended", `run ${this.runId} is ${String(said.ended)}`, said);
    }
    if ("superseded" in said) {
      return new Superseded(412, "stale-epoch", `run ${this.runId} moved on to epoch ${String(said.superseded)}; `
        + `this attempt (${this.epoch}) is superseded`, said);
    }
    if ("lost" in said) {
      return new Superseded(409, "attempt-lost", `attempt ${this.epoch} of run ${this.runId} was found lost; `
        + "a new one is starting", said);
    }
    return undefined;
  }

  #sleep(seconds: number): Promise<void> {
    if (seconds <= 0) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, seconds * 1000);
      timer.unref();
      this.#wake = () => {
        clearTimeout(timer);
        resolve();
      };
    });
  }
}

function parse(text: string): Record<string, unknown> | undefined {
  try {
    const value: unknown = JSON.parse(text);
    return value !== null && typeof value === "object" && !Array.isArray(value)
      ? (value as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}
