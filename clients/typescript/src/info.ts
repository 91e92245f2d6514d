/** A run as the proxy reports it (the run JSON of the runs API). */

/** A run's states, each the string the proxy sends. */
export const RunState = {
  RUNNING: "running",
  RESTARTING: "restarting", // the supervisor is starting a new attempt
  COMPLETED: "completed",
  FAILED: "failed",
  DEAD: "dead", // given up: out of restarts, or silent with no hook to start it again
} as const;
export type RunState = (typeof RunState)[keyof typeof RunState];

const ENDED: ReadonlySet<string> = new Set([RunState.COMPLETED, RunState.FAILED, RunState.DEAD]);

/** One snapshot of a run. Times are UNIX seconds; `raw` keeps every member sent but the token. */
export interface RunInfo {
  readonly runId: string;
  readonly state: RunState;
  readonly epoch: number;
  readonly namespace: string;
  readonly restarts: number;
  readonly lastSeen: number;
  readonly startedAt: number;
  readonly timeoutS: number;
  readonly graceS: number;
  readonly maxRestarts: number;
  readonly hook: string | null;
  readonly metadata: Readonly<Record<string, unknown>>;
  readonly createdAt: number;
  readonly endedAt: number | null;
  readonly baseUrl: string | null;
  /** Completed, failed or dead: the run takes no new attempt. */
  readonly ended: boolean;
  readonly raw: Readonly<Record<string, unknown>>;
}

/** Parse the run JSON (members this client does not know are kept in `raw`). */
export function runInfo(body: Record<string, unknown>): RunInfo {
  const { token: _secret, ...raw } = body; // a credential: kept by the Run, not in snapshots
  const state = String(body.state ?? RunState.RUNNING) as RunState;
  const num = (value: unknown, fallback: number) => (value === null || value === undefined || value === ""
    ? fallback : Number(value));
  return Object.freeze({
    runId: String(body.run_id),
    state,
    epoch: num(body.epoch, 0),
    namespace: String(body.namespace ?? "default"),
    restarts: num(body.restarts, 0),
    lastSeen: num(body.last_seen, 0),
    startedAt: num(body.started_at, 0),
    timeoutS: num(body.timeout_s, 0) || 60,
    graceS: num(body.grace_s, 0),
    maxRestarts: num(body.max_restarts, 0),
    hook: typeof body.hook === "string" ? body.hook : null,
    metadata: (body.metadata && typeof body.metadata === "object" ? body.metadata : {}) as Record<string, unknown>,
    createdAt: num(body.created_at, 0),
    endedAt: body.ended_at === null || body.ended_at === undefined ? null : Number(body.ended_at),
    baseUrl: typeof body.base_url === "string" ? body.base_url : null,
    ended: ENDED.has(state),
    raw,
  });
}
