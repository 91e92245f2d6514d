/**
 * What can go wrong talking to idemproxy's runs API: the Python client's exception tree.
 *
 *     IdemProxyError                  anything this client throws
 *     ├── ProxyUnreachable            no HTTP answer (connection refused, timeout)
 *     └── ProblemError                the proxy refused: an RFC 9457 problem
 *         ├── RunNotFound             404: no such run in this namespace
 *         ├── RunEnded                409 run-ended: completed, failed or dead; never restarted
 *         ├── RunExists               the run id is taken and `resume: false` was asked
 *         └── Superseded              fenced: 412 stale-epoch, a newer epoch seen, or 409
 *                                     attempt-lost; this attempt has been replaced and must stop
 *
 * Match on the classes (or on `ProblemError.slug`), never on the human `detail`.
 */

export const PROBLEM_TYPE_BASE = "https://idemproxy.dev/problems/";

/** Base class of every error this client throws. */
export class IdemProxyError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** The proxy gave no HTTP answer: not listening, unreachable, or too slow. */
export class ProxyUnreachable extends IdemProxyError {}

/** The proxy refused a request; `slug` is the stable problem type. */
export class ProblemError extends IdemProxyError {
  readonly status: number;
  readonly slug: string;
  readonly detail: string;
  readonly body: Readonly<Record<string, unknown>>;

  constructor(status: number, slug: string, detail: string, body: Record<string, unknown> = {}) {
    super(detail ? `${status} ${slug}: ${detail}` : `${status} ${slug}`);
    this.status = status;
    this.slug = slug;
    this.detail = detail;
    this.body = body;
  }
}

/** No run with this id exists in the caller's namespace. */
export class RunNotFound extends ProblemError {}

/** The run is completed, failed or dead: it takes no new attempt and is never restarted. */
export class RunEnded extends ProblemError {}

/** The run id is already registered and the caller asked for a fresh run (`resume: false`). */
export class RunExists extends ProblemError {}

/** A newer attempt of this run exists (higher epoch): this process is fenced and must stop. */
export class Superseded extends ProblemError {}

/** The error for an error answer, from its status and (problem+json) body. */
export function problemFromResponse(status: number, body: unknown): ProblemError {
  const members = body !== null && typeof body === "object" && !Array.isArray(body)
    ? (body as Record<string, unknown>) : {};
  const kind = typeof members.type === "string" ? members.type : "";
  const slug = (kind.startsWith(PROBLEM_TYPE_BASE) ? kind.slice(PROBLEM_TYPE_BASE.length) : kind)
    || `http-${status}`;
  const detail = String(members.detail || members.title || "");
  if (slug === "stale-epoch" || slug === "attempt-lost" || status === 412) {
    return new Superseded(status, slug, detail, members);
  }
  if (slug === "run-ended") return new RunEnded(status, slug, detail, members);
  if (status === 404) return new RunNotFound(status, slug, detail, members);
  return new ProblemError(status, slug, detail, members);
}

/** Whether an error means this attempt is over, so beating or holding on is pointless. */
export function endsAttempt(error: unknown): boolean {
  return error instanceof Superseded || error instanceof RunEnded || error instanceof RunNotFound;
}
