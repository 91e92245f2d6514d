/**
 * What the supervisor hands a process it starts, read from the environment: `IDEM_RUN_ID`,
 * `IDEM_EPOCH`, `IDEM_ATTEMPT`, `IDEM_PROXY_URL`, `IDEM_NAMESPACE` and `IDEM_RUN_TOKEN`. A
 * process started with them continues that run at that epoch: the supervisor has already
 * started the new attempt and fenced the old one.
 */

export const DEFAULT_PROXY_URL = "http://127.0.0.1:8787";
export const DEFAULT_NAMESPACE = "default";

/** An environment to read `IDEM_*` from (`process.env` by default). */
export type Env = Readonly<Record<string, string | undefined>>;

/** The `IDEM_*` facts of this process; a field is undefined when not set. */
export interface Launch {
  readonly runId?: string;
  readonly epoch?: number;
  readonly attempt?: number;
  readonly proxyUrl?: string;
  readonly namespace?: string;
  /** `IDEM_RUN_TOKEN`: the run's capability, from the supervisor. */
  readonly token?: string;
}

/** Read the `IDEM_*` variables; throws RangeError if one is malformed. */
export function launchFromEnv(env: Env = process.env): Launch {
  return {
    runId: env.IDEM_RUN_ID || undefined,
    epoch: integer(env, "IDEM_EPOCH"),
    attempt: integer(env, "IDEM_ATTEMPT"),
    proxyUrl: (env.IDEM_PROXY_URL ?? "").replace(/\/+$/, "") || undefined,
    namespace: env.IDEM_NAMESPACE || undefined,
    token: env.IDEM_RUN_TOKEN || undefined,
  };
}

/**
 * The `Idem-Tenant` to send for a run's namespace: only a trusted tenant's name. The shared
 * `default` namespace and a credential's or a run's (`anonymous`, `k:…`, `r:…`) come from the
 * request itself, so naming them is neither needed nor accepted.
 */
export function tenantOf(namespace: string | undefined): string | undefined {
  if (!namespace || namespace === DEFAULT_NAMESPACE || namespace === "anonymous"
      || namespace.startsWith("k:") || namespace.startsWith("r:")) {
    return undefined;
  }
  return namespace;
}

function integer(env: Env, name: string): number | undefined {
  const text = env[name];
  if (text === undefined || text === "") return undefined;
  if (!/^\d{1,15}$/.test(text.trim())) {
    throw new RangeError(`${name} must be a non-negative integer, got ${JSON.stringify(text)}`);
  }
  return Number(text.trim());
}
