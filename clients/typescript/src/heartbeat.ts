/**
 * Background heartbeats, on timers that never keep the process alive.
 *
 * Traffic through the proxy already counts as a heartbeat. These beats cover long work
 * outside it (a tool run locally, a big computation) so the supervisor does not take a busy
 * run for a dead one. A beat that fails for a passing reason (proxy restarting) is retried at
 * the next interval; one that says this attempt is over (superseded, ended, gone) stops the
 * beats for good and is reported through `onStop`.
 */

import { endsAttempt, type IdemProxyError } from "./errors.js";

export const MIN_INTERVAL_S = 0.1;
export const MAX_INTERVAL_S = 30;

/** A third of the run's timeout, so two beats can be lost before the run looks silent. */
export function intervalFor(timeoutS: number): number {
  return Math.min(Math.max(timeoutS / 3, MIN_INTERVAL_S), MAX_INTERVAL_S);
}

export class Heartbeats {
  #timer: NodeJS.Timeout | undefined;
  #beating: Promise<void> | undefined;
  #stopped = false;

  constructor(
    private readonly beat: () => Promise<unknown>,
    readonly intervalS: number,
    private readonly onStop: (error: IdemProxyError) => void,
    private readonly warn: (message: string) => void,
  ) {}

  start(): void {
    this.#schedule();
  }

  /** Stop beating; resolves once a beat in progress has finished. */
  async stop(): Promise<void> {
    this.#stopped = true;
    clearTimeout(this.#timer);
    await this.#beating;
  }

  #schedule(): void {
    if (this.#stopped) return;
    this.#timer = setTimeout(() => {
      this.#beating = this.#once().finally(() => {
        this.#beating = undefined;
      });
    }, this.intervalS * 1000);
    this.#timer.unref(); // a process whose work is done exits, beats or not
  }

  async #once(): Promise<void> {
    try {
      await this.beat();
    } catch (error) {
      if (endsAttempt(error)) {
        this.#stopped = true;
        this.onStop(error as IdemProxyError);
        return;
      }
      this.warn(`heartbeat not delivered (next in ${this.intervalS.toFixed(1)}s): ${(error as Error).message}`);
    }
    this.#schedule();
  }
}
