export { stepKey } from "./keys.js";
export type { KeyPart } from "./keys.js";
