/**
 * Idempotency keys minted from a run and a step, so the key exists before the call.
 *
 * A key is a pure function of (run id, step name, arguments): the same run calling the same
 * step with the same arguments gets the same key in every attempt and in every language. It
 * is byte for byte the Python client's `step_key`: the SHA-256 of the JSON text Python's
 * `json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=False)` writes,
 * checked by the shared vectors in clients/golden/step_keys.json.
 *
 * JavaScript values map onto Python's as follows: a `bigint`, or a number that is a safe
 * integer (-0 included), is an integer; any other finite number is a float, written as
 * Python's `repr` writes it (`0.1`, `1e+16`, `1.5e-07`, `9007199254740992.0`). NaN and
 * ±Infinity have no stable form and throw, as do `undefined`, functions, symbols and objects
 * that are not plain (Map, Date, class instances): pass `String(value)` or an id instead.
 */

import { createHash } from "node:crypto";

/** What a key may be built from: values with one obvious, stable text form. */
export type KeyPart =
  | string
  | number
  | bigint
  | boolean
  | null
  | readonly KeyPart[]
  | { readonly [name: string]: KeyPart };

const SCHEME = "idemproxy-key-v1";
const MAX_STEP_LENGTH = 64;
const DIGEST_HEX = 32; // 128 bits: collisions between a run's steps are not a practical concern
const STEP_CHAR = /^[A-Za-z0-9._-]$/;
const LONE_SURROGATE = /\p{Surrogate}/u;

/**
 * The idempotency key of `step` called with `parts` in run `runId`: `<step>:<32 hex digits>`,
 * readable in logs, at most 97 printable ASCII characters. The readable prefix is the step
 * with every code point outside `[A-Za-z0-9._-]` replaced by `_`, cut at 64 code points.
 *
 * @throws RangeError for an empty step, or a string that is not well-formed Unicode (a lone
 *   surrogate has no UTF-8 form).
 * @throws TypeError for a part with no stable text form.
 */
export function stepKey(runId: string, step: string, ...parts: KeyPart[]): string {
  if (typeof runId !== "string") throw new TypeError("the run id must be a string");
  if (typeof step !== "string") throw new TypeError("the step name must be a string");
  if (!step) throw new RangeError("a step name is required");
  const material = "[" + [text(SCHEME), text(runId), text(step), list(parts)].join(",") + "]";
  const digest = createHash("sha256").update(material, "utf8").digest("hex").slice(0, DIGEST_HEX);
  return `${readable(step)}:${digest}`;
}

function readable(step: string): string {
  let out = "";
  let count = 0;
  for (const point of step) {
    // one `_` per code point, as Python's re.sub over a str
    if (count++ === MAX_STEP_LENGTH) break;
    out += STEP_CHAR.test(point) ? point : "_";
  }
  return out;
}

/** Python's JSON text of one value (see the module comment). */
function canonical(value: unknown): string {
  switch (typeof value) {
    case "string":
      return text(value);
    case "boolean":
      return value ? "true" : "false";
    case "bigint":
      return value.toString();
    case "number":
      return number(value);
    case "object":
      if (value === null) return "null";
      if (Array.isArray(value)) return list(value);
      return object(value);
    default:
      throw new TypeError(`${typeof value} has no stable key form; pass a string or an id`);
  }
}

function text(value: string): string {
  // JSON.stringify escapes exactly what Python's json.dumps(ensure_ascii=False) escapes (",
  // \, and control characters, as \u00xx in lower case) except lone surrogates, which Python
  // cannot encode as UTF-8 at all: refused in both.
  if (LONE_SURROGATE.test(value)) {
    throw new RangeError("a string in an idempotency key must be well-formed Unicode (lone surrogate)");
  }
  return JSON.stringify(value);
}

function list(values: readonly unknown[]): string {
  const out: string[] = [];
  for (let i = 0; i < values.length; i++) {
    if (!(i in values)) throw new TypeError("a sparse array has no stable key form");
    out.push(canonical(values[i]));
  }
  return "[" + out.join(",") + "]";
}

function object(value: object): string {
  const proto = Object.getPrototypeOf(value);
  if (proto !== Object.prototype && proto !== null) {
    const name = (value.constructor as { name?: string } | undefined)?.name ?? "object";
    throw new TypeError(`${name} has no stable key form; pass a plain object, a string or an id`);
  }
  if (Object.getOwnPropertySymbols(value).length) {
    throw new TypeError("symbol keys have no stable key form");
  }
  const record = value as Record<string, unknown>;
  const names = Object.keys(record).sort(byCodePoint);
  return "{" + names.map((name) => `${text(name)}:${canonical(record[name])}`).join(",") + "}";
}

/** Python orders str by code point; JavaScript's default sort by UTF-16 code unit differs
 * for characters past U+FFFF against U+E000-U+FFFF. */
function byCodePoint(a: string, b: string): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    const x = a.codePointAt(i)!;
    const y = b.codePointAt(i)!;
    if (x !== y) return x - y;
    if (x > 0xffff) i++; // both are the same surrogate pair
  }
  return a.length - b.length;
}

/** A number as Python writes it: an int for a safe integer, else `repr(float)`. */
function number(value: number): string {
  if (!Number.isFinite(value)) throw new TypeError("NaN and infinity have no stable key form");
  if (Number.isSafeInteger(value)) return Object.is(value, -0) ? "0" : String(value);
  // The shortest digits that read back as this double (both languages pick the same ones),
  // laid out by Python's rule: positional for exponents -4..15, else d.ddde±XX.
  const [mantissa, exp] = Math.abs(value).toExponential().split("e");
  const digits = mantissa!.replace(".", "");
  const exponent = Number(exp);
  const sign = value < 0 ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    const head = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    const power = String(Math.abs(exponent)).padStart(2, "0");
    return `${sign}${head}e${exponent < 0 ? "-" : "+"}${power}`;
  }
  if (exponent < 0) return `${sign}0.${"0".repeat(-exponent - 1)}${digits}`;
  const whole = digits.slice(0, exponent + 1).padEnd(exponent + 1, "0");
  const fraction = digits.slice(exponent + 1) || "0";
  return `${sign}${whole}.${fraction}`;
}
