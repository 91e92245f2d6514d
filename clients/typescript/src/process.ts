/**
 * This process, named for a proxy on the same host: `Idem-Process` on a held connection. A
 * proxy in the same PID namespace looks at the process when its held connection drops and
 * restarts the run the moment it has exited instead of waiting out its grace. Linux only;
 * elsewhere undefined, and the proxy waits its grace.
 */

import { readFileSync, statSync } from "node:fs";

let cached: { pid: number; token: string | undefined } | undefined;

/** `<boot id> <pid namespace inode> <pid> <start time in clock ticks>`, as the Python client sends. */
export function processToken(): string | undefined {
  if (cached?.pid === process.pid) return cached.token;
  let token: string | undefined;
  try {
    const boot = readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim();
    const namespace = statSync("/proc/self/ns/pid").ino;
    const stat = readFileSync("/proc/self/stat", "latin1");
    const start = stat.slice(stat.lastIndexOf(")") + 2).split(" ")[19]; // field 22
    token = start ? `${boot} ${namespace} ${process.pid} ${start}` : undefined;
  } catch {
    token = undefined;
  }
  cached = { pid: process.pid, token };
  return token;
}
