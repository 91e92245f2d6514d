/**
 * @idemproxy/client: make an AI agent replay-safe behind idemproxy.
 *
 *     import { Run } from "@idemproxy/client";
 *
 *     const run = await Run.start({ timeoutS: 120, hook: "agent" });
 *     const llm = new OpenAI({ baseURL: run.url("openai", "/v1"), defaultHeaders: run.headers });
 *     const key = run.key("charge", orderId);        // the same key in every attempt
 *     await run.fetch(run.url("tools", "/charge"), { method: "POST", body,
 *       headers: { "Idempotency-Key": key } });
 *     await run.complete();
 *
 * A crashed run restarted by the supervisor (or started again by anything else) replays its
 * recorded calls from the proxy's journal and goes live where it stopped.
 */

export { EPOCH_HEADER, KEY_HEADER, POLICY_HEADER, RUN_HEADER } from "./api.js";
export type { Registration } from "./api.js";
export { Attachment } from "./attach.js";
export type { AttachmentOptions } from "./attach.js";
export { RUN_TOKEN_HEADER, TENANT_HEADER } from "./binding.js";
export {
  IdemProxyError, ProblemError, problemFromResponse, ProxyUnreachable, RunEnded, RunExists, RunNotFound, Superseded,
} from "./errors.js";
export { RunState } from "./info.js";
export type { RunInfo } from "./info.js";
export { stepKey } from "./keys.js";
export type { KeyPart } from "./keys.js";
export { launchFromEnv, tenantOf } from "./launch.js";
export type { Env, Launch } from "./launch.js";
export { Run } from "./run.js";
export type { Logger, RunOptions } from "./run.js";
export { isStandby, StandbyDismissed, waitForAssignment } from "./standby.js";

export const VERSION = "0.2.0";
