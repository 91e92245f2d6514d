/**
 * `Run`: one agent run behind idemproxy, the twin of the Python client's `Run`.
 *
 *     const run = await Run.start({ timeoutS: 60, hook: "agent" });
 *     const llm = new OpenAI({ baseURL: run.url("openai", "/v1"), defaultHeaders: run.headers });
 *     await run.fetch(run.url("tools", "/charge"), { method: "POST", body,
 *       headers: { "Idempotency-Key": run.key("charge", orderId) } });
 *     await run.complete();
 *
 * `Run.start()` finds or creates the run and learns its epoch (attempt number):
 * - started by the supervisor (`IDEM_RUN_ID` and `IDEM_EPOCH` in the environment, or `epoch`
 *   given): continue that run at that epoch;
 * - otherwise register `runId` (a new random id when none is given). When the run already
 *   exists, this process was started again by something else (a Kubernetes Job, systemd, a
 *   person): a new attempt begins, fencing any earlier process still running. With
 *   `resume: false` an existing run is an error (`RunExists`).
 */

import { randomUUID } from "node:crypto";

import { type Answer, type Call, calls, type Registration, registrationBody, RunsAPI } from "./api.js";
import { Attachment } from "./attach.js";
import { Binding } from "./binding.js";
import { IdemProxyError, RunEnded, RunExists, RunNotFound, Superseded } from "./errors.js";
import { Heartbeats, intervalFor } from "./heartbeat.js";
import { type RunInfo, RunState } from "./info.js";
import { type KeyPart, stepKey } from "./keys.js";
import { DEFAULT_PROXY_URL, type Env, launchFromEnv, tenantOf } from "./launch.js";
import { waitForAssignment } from "./standby.js";

const RUN_ID = /^[A-Za-z0-9._:-]{1,128}$/;
const UPSTREAM_NAME = /^[A-Za-z0-9_.~-]+$/;

/** Where the client's warnings go (default: `console.warn`); `null` in `RunOptions.log` silences them. */
export interface Logger {
  warn(message: string): void;
  info?(message: string): void;
}

export interface RunOptions extends Registration {
  /** 1-128 of `[A-Za-z0-9._:-]`. Default: `IDEM_RUN_ID`, else a new random id. */
  runId?: string;
  /** Default: `IDEM_PROXY_URL`, else `http://127.0.0.1:8787`. */
  proxyUrl?: string;
  /** Continue this attempt instead of starting one (default: `IDEM_EPOCH` when `IDEM_RUN_ID` names this run). */
  epoch?: number;
  /** Start a new attempt when the run exists (default) rather than refuse with `RunExists`. */
  resume?: boolean;
  /** `true` (default): beats every third of the run's timeout; a number: that interval in seconds; `false`: none. */
  heartbeat?: boolean | number;
  /** Hold a connection to the proxy for this attempt (`POST /runs/{id}/attach`), so that the
   * run is restarted within the proxy's `attach_grace_s` of this process dying. For agents no
   * command hook started (a hook-started agent is watched as a child already). */
  attach?: boolean;
  /** Sent as `Idem-Tenant` (honoured from trusted sources only). Default: `IDEM_NAMESPACE`
   * when it names a trusted tenant (not `default`, `anonymous`, `k:…`, `r:…`). */
  tenant?: string;
  /** The run's token (default: `IDEM_RUN_TOKEN` when `IDEM_RUN_ID` names this run, else the one
   * the proxy answers the registration with). */
  token?: string;
  /** Timeout of runs-API calls, in seconds (default 10). */
  httpTimeoutS?: number;
  /** The environment to read `IDEM_*` from (default `process.env`; then, in a standby the
   * supervisor started ahead, `start()` first waits until it names the run). */
  env?: Env;
  log?: Logger | null;
}

const consoleLogger: Logger = { warn: (message) => console.warn(`idemproxy: ${message}`) };
const silent: Logger = { warn: () => {} };

export class Run {
  /** The run's id. */
  readonly runId: string;
  /** The proxy's URL, without a trailing slash. */
  readonly proxyUrl: string;
  /** Why `fail(reason)` was called, if it was. */
  failReason: string | undefined;
  readonly #binding: Binding;
  readonly #api: RunsAPI;
  readonly #options: RunOptions;
  readonly #log: Logger;
  #epoch: number | undefined;
  #info: RunInfo | undefined;
  #beats: Heartbeats | undefined;
  #attachment: Attachment | undefined;
  #ended = false;
  #superseded = false;

  private constructor(runId: string, proxyUrl: string, binding: Binding, options: RunOptions) {
    this.runId = runId;
    this.proxyUrl = proxyUrl;
    this.#binding = binding;
    this.#options = options;
    this.#log = options.log === null ? silent : options.log ?? consoleLogger;
    this.#api = new RunsAPI(proxyUrl, binding, (options.httpTimeoutS ?? 10) * 1000);
    this.fetch = this.fetch.bind(this); // usable as an SDK's `fetch` option
  }

  /** Find or create the run, learn this process's epoch, start heartbeats (and the held
   * connection with `attach: true`). See the module comment for which attempt this is. */
  static async start(options: RunOptions = {}): Promise<Run> {
    if (options.env === undefined) await waitForAssignment();
    const launch = launchFromEnv(options.env ?? process.env);
    const handed = launch.runId !== undefined && (options.runId === undefined || options.runId === launch.runId);
    const runId = options.runId ?? launch.runId ?? `run-${randomUUID().replaceAll("-", "")}`;
    if (!RUN_ID.test(runId)) {
      throw new RangeError(`run id must be 1-128 characters of [A-Za-z0-9._:-], got ${JSON.stringify(runId)}`);
    }
    if (options.epoch !== undefined && !(Number.isSafeInteger(options.epoch) && options.epoch >= 0)) {
      throw new RangeError("epoch must be a non-negative integer");
    }
    const proxyUrl = (options.proxyUrl || launch.proxyUrl || DEFAULT_PROXY_URL).replace(/\/+$/, "");
    const binding = new Binding(options.tenant ?? tenantOf(launch.namespace),
      options.token ?? (handed ? launch.token : undefined));
    const run = new Run(runId, proxyUrl, binding, options);
    await run.#begin(options.epoch ?? (handed ? launch.epoch : undefined));
    run.#startBeats();
    if (options.attach) {
      run.#attachment = new Attachment(runId, run.epoch, {
        proxyUrl, binding, onOver: (error) => run.#attemptOver(error), warn: (message) => run.#log.warn(message),
      }).start();
    }
    return run;
  }

  /**
   * Start a run, `await work(run)`, then mark it completed, or failed if `work` throws (the
   * error is thrown on). Like the Python client's `with Run(...) as run:`.
   */
  static async run<T>(options: RunOptions, work: (run: Run) => Promise<T>): Promise<T> {
    const run = await Run.start(options);
    let result: T;
    try {
      result = await work(run);
    } catch (error) {
      try {
        await run.fail(error instanceof Error ? error.message : String(error));
      } catch (refused) {
        run.#log.warn(`run ${run.runId} not marked failed: ${(refused as Error).message}`);
      } finally {
        await run.close();
      }
      throw error;
    }
    try {
      await run.complete();
    } finally {
      await run.close();
    }
    return result;
  }

  // -- identity ------------------------------------------------------------------------

  /** This process's attempt number. */
  get epoch(): number {
    if (this.#epoch === undefined) throw new Error("the run's epoch is known once it has started");
    return this.#epoch;
  }

  /** The latest run JSON seen from the proxy (at start, heartbeat or end). */
  get info(): RunInfo | undefined {
    return this.#info;
  }

  /** True once a newer attempt of this run is known: this process should stop. */
  get superseded(): boolean {
    return this.#superseded;
  }

  /** True once this attempt marked the run, or saw it ended elsewhere. */
  get ended(): boolean {
    return this.#ended;
  }

  /** The `Idem-Tenant` this run's calls carry, if any. */
  get tenant(): string | undefined {
    return this.#binding.tenant;
  }

  /** The run's token, its capability, once known (from the proxy or `IDEM_RUN_TOKEN`):
   * calls that carry it are the run's, whatever their credential. Keep it secret. */
  get token(): string | undefined {
    return this.#binding.token;
  }

  /** The held connection of `attach: true`, while the attempt holds it. */
  get attachment(): Attachment | undefined {
    return this.#attachment;
  }

  /** A stable idempotency key for `step` with `parts` in this run: the same string in every
   * attempt, and the Python client's `run.key(step, *parts)` byte for byte. */
  key(step: string, ...parts: KeyPart[]): string {
    return stepKey(this.runId, step, ...parts);
  }

  // -- where to send requests ----------------------------------------------------------

  /** `{proxy}/runs/{runId}/epochs/{epoch}` (then `/cap/{token}` when the run has a token):
   * the prefix of every run-scoped upstream URL of this attempt. */
  get baseUrl(): string {
    return this.#binding.base(this.proxyUrl, this.runId, this.epoch);
  }

  /** The run-scoped URL of `path` on a configured upstream: `run.url("openai", "/v1")` is the
   * OpenAI SDK's `baseURL`, `run.url("tools", "/email/send")` a tool endpoint. */
  url(upstream: string, path = ""): string {
    if (!UPSTREAM_NAME.test(upstream)) throw new RangeError(`not an upstream name: ${JSON.stringify(upstream)}`);
    const tail = path ? "/" + path.replace(/^\/+/, "") : "";
    return `${this.baseUrl}/${upstream}${tail}`;
  }

  /** Headers every call of this attempt must carry besides its URL (`Idem-Tenant`,
   * `Idem-Run-Token`); empty on a proxy that gives no token, for a shared namespace. A new
   * object each time: give it to an SDK's default headers. */
  get headers(): Record<string, string> {
    return this.#binding.headers();
  }

  /** The global `fetch`, with `run.headers` added to the request's own. */
  fetch(input: string | URL | Request, init: RequestInit = {}): Promise<Response> {
    const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
    for (const [name, value] of Object.entries(this.headers)) headers.set(name, value);
    return fetch(input, { ...init, headers });
  }

  // -- lifecycle -----------------------------------------------------------------------

  /** Tell the proxy this attempt is alive now; throws `Superseded` if it was replaced. */
  async heartbeat(): Promise<RunInfo> {
    const answer = await this.#watching(() => this.#send(calls.heartbeat(this.runId, this.epoch)));
    return this.#seen(answer.run);
  }

  /** The run as the proxy has it now. */
  async refresh(): Promise<RunInfo> {
    const answer = await this.#watching(() => this.#send(calls.show(this.runId)));
    return this.#seen(answer.run);
  }

  /** Mark the run `completed` (never restarted); stops heartbeats and the held connection. */
  complete(): Promise<RunInfo | undefined> {
    return this.#end(RunState.COMPLETED);
  }

  /** Mark the run `failed` (never restarted); stops heartbeats and the held connection.
   * The proxy keeps no reason: `reason` stays on this object (`failReason`) and in the log. */
  fail(reason?: string): Promise<RunInfo | undefined> {
    this.failReason = reason;
    if (reason) this.#log.info?.(`run ${this.runId} failed: ${reason}`);
    return this.#end(RunState.FAILED);
  }

  /** Stop heartbeats and let the held connection go on purpose (its end restarts nothing),
   * leaving the run's state as it is: for a run that another process continues. */
  async close(): Promise<void> {
    await this.#stopBeats();
    await this.#dropAttachment(true);
  }

  toString(): string {
    return `Run(${this.runId}, epoch=${this.#epoch}, proxyUrl=${this.proxyUrl})`;
  }

  // -- inside ----------------------------------------------------------------------------

  /** The one place answers are read for the run's token. */
  async #send(call: Call): Promise<Answer> {
    const answer = await this.#api.send(call);
    this.#binding.learn(answer.token);
    return answer;
  }

  async #begin(handedEpoch: number | undefined): Promise<void> {
    const registration = registrationBody(this.#options);
    let answer: Answer;
    if (handedEpoch !== undefined) {
      // The attempt was started for us (by the supervisor, or explicitly): load the run,
      // registering it if it is unknown, and refuse to work if it ended or moved on.
      try {
        answer = await this.#send(Object.keys(registration).length
          ? calls.register(this.runId, this.#options) : calls.show(this.runId));
      } catch (error) {
        if (!(error instanceof RunNotFound)) throw error;
        answer = await this.#send(calls.register(this.runId, this.#options));
      }
      checked(answer.run, handedEpoch);
      this.#epoch = handedEpoch;
    } else {
      answer = await this.#send(calls.register(this.runId, this.#options));
      if (!answer.created) {
        // Started again by something other than the supervisor: a new attempt fences any
        // earlier process still running.
        if (this.#options.resume === false) {
          throw new RunExists(409, "run-exists", `run ${this.runId} already exists (resume: false)`, answer.run.raw);
        }
        if (answer.run.ended) {
          throw new RunEnded(409, "run-ended", `run ${this.runId} is ${answer.run.state}`, answer.run.raw);
        }
        answer = await this.#send(calls.newAttempt(this.runId));
      }
      this.#epoch = answer.run.epoch;
    }
    this.#info = answer.run;
    this.#log.info?.(`run ${this.runId}: attempt at epoch ${this.#epoch}`);
  }

  #startBeats(): void {
    const { heartbeat = true } = this.#options;
    if (heartbeat === false) return;
    const interval = heartbeat === true ? intervalFor(this.#info?.timeoutS ?? 60) : Number(heartbeat);
    if (!(interval > 0)) return;
    this.#beats = new Heartbeats(() => this.heartbeat(), interval, (error) => this.#attemptOver(error),
      (message) => this.#log.warn(message));
    this.#beats.start();
  }

  async #stopBeats(): Promise<void> {
    const beats = this.#beats;
    this.#beats = undefined;
    await beats?.stop();
  }

  async #end(outcome: RunState): Promise<RunInfo | undefined> {
    await this.#stopBeats(); // no beat may land after the run is marked
    if (this.#ended || this.#superseded) {
      await this.#dropAttachment(false);
      return undefined;
    }
    const call = outcome === RunState.COMPLETED ? calls.complete(this.runId, this.epoch)
      : calls.fail(this.runId, this.epoch);
    let answer: Answer;
    try {
      answer = await this.#watching(() => this.#send(call));
    } catch (error) {
      if (error instanceof RunEnded) { // ended elsewhere: nothing left to mark
        await this.#dropAttachment(false);
        return undefined;
      }
      if (error instanceof Superseded) await this.#dropAttachment(false);
      throw error;
    }
    this.#ended = true;
    this.#info = answer.run;
    await this.#dropAttachment(false); // the attempt is over: its drop restarts nothing
    return answer.run;
  }

  async #dropAttachment(letGo: boolean): Promise<void> {
    const attachment = this.#attachment;
    this.#attachment = undefined;
    if (attachment === undefined) return;
    if (letGo && !this.#ended && !this.#superseded) {
      try {
        await this.#send(calls.detach(this.runId, this.epoch));
      } catch (error) {
        this.#log.warn(`run ${this.runId}: held connection not let go (${(error as Error).message}); `
          + "its end may restart the run");
      }
    }
    await attachment.stop();
  }

  #seen(run: RunInfo): RunInfo {
    this.#info = run;
    try {
      return checked(run, this.epoch);
    } catch (error) {
      this.#attemptOver(error as IdemProxyError);
      throw error;
    }
  }

  /** Note a refusal that shows this attempt is over, and let it throw. */
  async #watching<T>(call: () => Promise<T>): Promise<T> {
    try {
      return await call();
    } catch (error) {
      if (error instanceof Superseded || error instanceof RunEnded) this.#attemptOver(error);
      throw error;
    }
  }

  #attemptOver(error: IdemProxyError): void {
    if (error instanceof Superseded) {
      if (!this.#superseded) {
        this.#log.warn(`run ${this.runId}: this attempt (epoch ${this.#epoch}) was superseded: ${error.message}`);
      }
      this.#superseded = true;
    } else if (error instanceof RunEnded) {
      if (!this.#ended) this.#log.warn(`run ${this.runId} ended elsewhere: ${error.message}`);
      this.#ended = true;
    } else {
      this.#log.warn(`run ${this.runId}: heartbeats stopped: ${error.message}`);
    }
  }
}

/** `run` unless it shows this attempt is over: superseded by a newer epoch, or ended. */
function checked(run: RunInfo, epoch: number): RunInfo {
  if (run.ended) throw new RunEnded(409, "run-ended", `run ${run.runId} is ${run.state}`, run.raw);
  if (run.epoch > epoch) {
    throw new Superseded(412, "stale-epoch", `run ${run.runId} moved on to epoch ${run.epoch}; `
      + `this attempt (epoch ${epoch}) has been superseded`, run.raw);
  }
  return run;
}
