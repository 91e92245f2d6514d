// `npm pack` from a clean copy (no dist/, no node_modules of its own) gives a tarball with the
// built files and their .d.ts, no dependencies, that installs offline into a fresh project,
// imports, computes the golden keys and type-checks.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { scriptCommand } from "./helpers.mjs";

const PACKAGE = fileURLToPath(new URL("..", import.meta.url));
const GOLDEN = JSON.parse(readFileSync(new URL("../../golden/step_keys.json", import.meta.url), "utf8"));
const NPM = process.platform === "win32" ? "npm.cmd" : "npm";

const run = (command, args, cwd) => execFileSync(command, args, {
  cwd, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, npm_config_update_notifier: "false" },
});

test("npm pack from a clean copy installs offline into a fresh project", () => {
  const work = mkdtempSync(join(tmpdir(), "idemproxy-pack-"));
  try {
    const clean = join(work, "client");
    mkdirSync(clean);
    for (const name of ["package.json", "package-lock.json", "tsconfig.json", "README.md", "src"]) {
      cpSync(join(PACKAGE, name), join(clean, name), { recursive: true });
    }
    symlinkSync(join(PACKAGE, "node_modules"), join(clean, "node_modules")); // the build tools, offline
    const packed = run(NPM, ["pack", "--silent", "--pack-destination", work], clean);
    const tarball = join(work, packed.trim().split("\n").at(-1));

    const files = run("tar", ["tzf", tarball], work).trim().split("\n").sort();
    for (const name of ["package/package.json", "package/README.md", "package/dist/index.js", "package/dist/index.d.ts",
      "package/dist/run.js", "package/dist/run.d.ts", "package/dist/keys.js"]) {
      assert.ok(files.includes(name), `${name} in ${files}`);
    }
    assert.ok(files.every((name) => name.startsWith("package/dist/") || !name.endsWith(".ts") || name.endsWith(".d.ts")));
    assert.ok(!files.some((name) => name.startsWith("package/src/") || name.startsWith("package/test/")), files);
    const manifest = JSON.parse(run("tar", ["xzOf", tarball, "package/package.json"], work));
    assert.equal(manifest.type, "module");
    assert.equal(manifest.types, "./dist/index.d.ts");
    assert.equal(manifest.dependencies, undefined);

    const fresh = join(work, "fresh");
    mkdirSync(fresh);
    writeFileSync(join(fresh, "package.json"), JSON.stringify({ name: "fresh", private: true, type: "module" }));
    run(NPM, ["install", "--offline", "--no-audit", "--no-fund", "--silent", tarball], fresh);
    const [vector] = GOLDEN.keys;
    writeFileSync(join(fresh, "check.mjs"), `
      import { Run, stepKey, Superseded, ProblemError } from "@idemproxy/client";
      const key = stepKey(${JSON.stringify(vector.run_id)}, ${JSON.stringify(vector.step)}, ...${JSON.stringify(vector.parts)});
      const fenced = new Superseded(412, "stale-epoch", "") instanceof ProblemError;
      console.log(JSON.stringify({ key, run: typeof Run.start, fenced }));
    `);
    const [command, ...args] = scriptCommand("check.mjs");
    assert.deepEqual(JSON.parse(run(command, args, fresh)), { key: vector.key, run: "function", fenced: true });

    writeFileSync(join(fresh, "check.ts"), `
      import { Run, stepKey, type RunOptions, type RunInfo } from "@idemproxy/client";
      const options: RunOptions = { timeoutS: 60, hook: "agent", heartbeat: 5, attach: true };
      export async function main(): Promise<RunInfo | undefined> {
        const run: Run = await Run.start(options);
        const base: string = run.url("openai", "/v1");
        const headers: Record<string, string> = run.headers;
        const key: string = run.key("send_email", "ada@example.com", 3, 10n, { nested: [true, null] });
        await run.fetch(base, { method: "POST", headers: { ...headers, "Idempotency-Key": key } });
        return stepKey(run.runId, "x") ? run.complete() : run.fail("reason");
      }
    `);
    const [runtime, ...tsc] = scriptCommand(join(PACKAGE, "node_modules", "typescript", "bin", "tsc"), "--noEmit",
      "--strict", "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022",
      "--typeRoots", join(PACKAGE, "node_modules", "@types"), "--types", "node", "check.ts");
    run(runtime, tsc, fresh);
  } finally {
    rmSync(work, { recursive: true, force: true });
  }
});
