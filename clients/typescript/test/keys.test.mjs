// run.key / stepKey against the golden vectors the Python client is checked by too.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { stepKey } from "../dist/index.js";

const GOLDEN = JSON.parse(readFileSync(new URL("../../golden/step_keys.json", import.meta.url), "utf8"));

/** A golden part as a JavaScript value: {"$bigint"} a BigInt, {"$float"} NaN or ±Infinity. */
function decode(value) {
  if (Array.isArray(value)) return value.map(decode);
  if (value !== null && typeof value === "object") {
    const names = Object.keys(value);
    if (names.length === 1 && names[0] === "$bigint") return BigInt(value.$bigint);
    if (names.length === 1 && names[0] === "$float") return Number(value.$float);
    return Object.fromEntries(names.map((name) => [name, decode(value[name])]));
  }
  return value;
}

test("every golden key is the Python client's, byte for byte", () => {
  assert.ok(GOLDEN.keys.length >= 20);
  for (const vector of GOLDEN.keys) {
    assert.equal(stepKey(vector.run_id, vector.step, ...decode(vector.parts)), vector.key, vector.name);
  }
});

test("every golden error throws", () => {
  for (const vector of GOLDEN.errors) {
    assert.throws(() => stepKey(vector.run_id, vector.step, ...decode(vector.parts)),
      (error) => error instanceof TypeError || error instanceof RangeError, vector.name);
  }
});

test("a key is readable, short and a valid Idempotency-Key", () => {
  for (const vector of GOLDEN.keys) {
    assert.match(vector.key, /^[A-Za-z0-9._-]{1,64}:[0-9a-f]{32}$/);
    assert.ok(vector.key.length <= 97);
  }
});

test("JavaScript's own spellings of Python's values give Python's keys", () => {
  const key = (...parts) => stepKey("r", "s", ...parts);
  assert.equal(key(-0), key(0));
  assert.equal(key(5), key(5n));
  assert.equal(key(2 ** 64), key(18446744073709551616)); // unsafe: both the float 1.8446744073709552e+19
  assert.notEqual(key(2 ** 53), key(2n ** 53n)); // the float 9007199254740992.0 and the int differ
  assert.equal(key({ b: 1, a: 2 }), key({ a: 2, b: 1 }));
  assert.equal(key(Object.assign(Object.create(null), { a: 1 })), key({ a: 1 }));
  assert.notEqual(key([1, 2]), key([2, 1]));
  assert.notEqual(key("1"), key(1));
  assert.equal(stepKey("r", "s"), key());
});

test("values with no stable form are refused", () => {
  const refused = [undefined, [undefined], { a: undefined }, () => 1, Symbol("x"), new Map(), new Set(),
    new Date(0), new (class Thing {})(), [, 1], new Uint8Array(2), { [Symbol("k")]: 1 }];
  for (const value of refused) {
    assert.throws(() => stepKey("r", "s", value), TypeError, String(typeof value));
  }
  assert.throws(() => stepKey("r", ""), RangeError);
  assert.throws(() => stepKey(1, "s"), TypeError);
});
