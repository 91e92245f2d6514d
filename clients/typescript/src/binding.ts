/**
 * What binds a call to its run, in one place: the tenant the run lives under (a trusted
 * tenant's name, sent as `Idem-Tenant`) and the run's token, its capability.
 *
 * A proxy that binds runs answers a registration (`POST /runs/{id}`) and a new attempt
 * (`POST /runs/{id}/attempts`) with `"token"`; a supervisor hands it to the process it
 * starts as `IDEM_RUN_TOKEN`. Once known, the token goes with every runs-API call
 * (`Idem-Run-Token`), with every upstream call of the attempt (`run.headers`), and into its
 * base URL (`{proxy}/runs/{run}/epochs/{epoch}/cap/{token}`), so an SDK that only takes a
 * base URL is bound too. A proxy that gives no token (older ones) gets neither.
 */

import { IdemProxyError } from "./errors.js";

export const TENANT_HEADER = "Idem-Tenant";
export const RUN_TOKEN_HEADER = "Idem-Run-Token";
const TOKEN = /^[A-Za-z0-9._-]{1,512}$/;

export class Binding {
  readonly tenant: string | undefined;
  #token: string | undefined;

  constructor(tenant?: string, token?: string) {
    this.tenant = tenant || undefined;
    this.learn(token);
  }

  /** The run's token once known; keep it as secret as a credential. */
  get token(): string | undefined {
    return this.#token;
  }

  /** Take the token from an answer or the environment; a missing one changes nothing. */
  learn(token: unknown): void {
    if (token === undefined || token === null || token === "") return;
    if (typeof token !== "string" || !TOKEN.test(token)) {
      throw new IdemProxyError("the proxy's run token is not 1-512 characters of [A-Za-z0-9._-]");
    }
    this.#token = token;
  }

  /** The headers that tie a call to the run: `Idem-Tenant` and `Idem-Run-Token`, when known. */
  headers(): Record<string, string> {
    const headers: Record<string, string> = {};
    if (this.tenant) headers[TENANT_HEADER] = this.tenant;
    if (this.#token) headers[RUN_TOKEN_HEADER] = this.#token;
    return headers;
  }

  /** The prefix of the attempt's run-scoped URLs. */
  base(proxyUrl: string, runId: string, epoch: number): string {
    const base = `${proxyUrl}/runs/${encodeURIComponent(runId).replaceAll("%3A", ":")}/epochs/${epoch}`;
    return this.#token ? `${base}/cap/${this.#token}` : base;
  }

  toJSON(): object {
    return { tenant: this.tenant, token: this.#token ? "***" : undefined };
  }
}
