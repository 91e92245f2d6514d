"""An agent of the fault campaign (tests/supervisor/test_fault_campaign.py).

One attempt of one run: steps 1..N, each a model call (every third one streamed) and a tool
call with a side effect, through two proxy replicas, as a load balancer would spread them.
Every attempt starts at step 1 and lets the journal answer what earlier attempts did. Plain
HTTP (``http.client``), so a restart costs little; explicit keys come from the client
library's ``step_key``.

The campaign starts the first attempt (``IDEM_EPOCH=0``); the supervisor's hook starts
every later one with the same environment. Two kinds of run, by the run id's first letter:

- ``x-…`` sends explicit keys (``step_key(run, "chat", step)``) and retries a failed call
  in place with the same key, as a client with retries does.
- ``d-…`` sends no key: the proxy derives one from the run, the request and its occurrence
  in the attempt. A retry in place of a call that reached a proxy would be the call's next
  occurrence, a new key (docs/guarantees.md, "Derived keys count calls per attempt"), so this agent
  retries the way an unmodified, crash-only agent is retried: it starts a new attempt
  (``POST /runs/{id}/attempts``) and begins again at step 1. A refused connection reached
  no proxy, and is retried in place on the other replica.

Every answer it sees, every refusal and every retried error goes to a JSON-lines file under
``<dir>/events`` for the campaign to check. Exit codes: 0 completed, 3 superseded (a newer
attempt fenced this one), 4 an answer no correct proxy gives (logged as an anomaly), 5 out of
time (``CAMPAIGN_DEADLINE``) or told to stop (``<dir>/stop`` exists).
"""

import base64
import http.client
import json
import os
import random
import sys
import time

from idemproxy_client import step_key

RETRIABLE = {409, 502, 503, 504}  # in flight elsewhere, store or upstream unreachable for now
SUPERSEDED, ANOMALY, GAVE_UP = 3, 4, 5


class Superseded(Exception):
    """412: a newer attempt of the run exists; this process must stop."""


class Failed(Exception):
    """A call that did not get an answer this time (a derived-key agent starts a new attempt)."""


class Anomaly(Exception):
    """An answer a correct proxy never gives here."""


class Agent:
    def __init__(self, folder: str):
        self.folder = folder
        self.run = os.environ["IDEM_RUN_ID"]
        self.epoch = int(os.environ["IDEM_EPOCH"])
        self.explicit = self.run.startswith("x-")
        self.proxies = [p.split("//", 1)[1] for p in os.environ["CAMPAIGN_PROXIES"].split(",")]
        self.steps = int(os.environ["CAMPAIGN_STEPS"])
        self.deadline = float(os.environ["CAMPAIGN_DEADLINE"])
        self.think = float(os.environ.get("CAMPAIGN_THINK_S", "0.1"))
        self.rng = random.Random(f"{self.run}/{self.epoch}/{os.getpid()}")
        self.turn = self.rng.randrange(len(self.proxies))
        self.connections: dict[str, http.client.HTTPConnection] = {}
        self.auth = f"Bearer sk-campaign-{self.run}"  # one credential per run: its tenant
        name = f"{self.run}.{self.epoch}.{os.getpid()}.jsonl"
        self.events = open(os.path.join(folder, "events", name), "a", buffering=1)

    def say(self, event: str, **fields) -> None:
        self.events.write(json.dumps({"ev": event, "run": self.run, "epoch": self.epoch,
                                      "pid": os.getpid(), "t": time.time(), **fields}) + "\n")

    # -- HTTP ---------------------------------------------------------------------------

    def send(self, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
        """One try on the next replica; raises OSError/HTTPException when there is no answer."""
        self.turn = (self.turn + 1) % len(self.proxies)
        host = self.proxies[self.turn]
        conn = self.connections.get(host)
        if conn is None:
            conn = self.connections[host] = http.client.HTTPConnection(host, timeout=20)
        try:
            conn.request(method, path, body=body, headers={"Authorization": self.auth,
                                                           "Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            del self.connections[host]
            raise

    def anomaly(self, kind: str, status: int, answer: bytes, **fields) -> Anomaly:
        self.say("anomaly", kind=kind, status=status, answer=answer[:500].decode(errors="replace"), **fields)
        return Anomaly(kind, status)

    def check_time(self) -> None:
        if time.time() > self.deadline or os.path.exists(os.path.join(self.folder, "stop")):
            self.say("gave-up")
            sys.exit(GAVE_UP)

    def backoff(self, tries: int) -> None:
        time.sleep(min(0.05 * 2 ** tries, 1.0) * self.rng.uniform(0.5, 1.0))

    # -- one logical call -----------------------------------------------------------------

    def call(self, kind: str, step: int, path: str, payload: dict) -> bytes:
        """The answer to this step's call, retrying until one comes (explicit keys) or
        raising Failed at the first error (derived keys)."""
        body = json.dumps(payload, sort_keys=True).encode()
        key = step_key(self.run, kind, step) if self.explicit else None
        headers = {"Idempotency-Key": key} if key else {}
        for tries in range(10_000):
            self.check_time()
            sent = time.time()
            try:
                status, got, answer = self.send("POST", f"/runs/{self.run}/epochs/{self.epoch}{path}",
                                                body, headers)
            except ConnectionRefusedError:  # never reached a proxy: nothing was counted or claimed
                self.say("error", kind=kind, step=step, what="ConnectionRefusedError", sent=sent)
                self.backoff(tries)
                continue
            except (OSError, http.client.HTTPException) as exc:
                self.say("error", kind=kind, step=step, what=type(exc).__name__, sent=sent)
                status = None
            else:
                if status == 200:
                    self.say("answer", kind=kind, step=step, key=key, path=path, body=body.decode(),
                             replayed=got.get("idempotent-replayed"), sent=sent,
                             answer=base64.b64encode(answer).decode())
                    return answer
                if status == 412:
                    raise Superseded()
                if status not in RETRIABLE:
                    raise self.anomaly(kind, status, answer, step=step)
                self.say("error", kind=kind, step=step, what=str(status), sent=sent,
                         slug=_slug(answer))
            if not self.explicit:
                raise Failed(kind, step, status)
            self.backoff(tries)
        raise Failed(kind, step, "too many tries")

    def steps_of_attempt(self) -> None:
        last = "none"
        for step in range(1, self.steps + 1):
            time.sleep(self.think * self.rng.uniform(0.5, 1.5))
            said = f"run {self.run} step {step}; last tool result {last}"
            chat = {"model": "fake", "messages": [{"role": "user", "content": said}],
                    "metadata": {"run": self.run, "step": str(step)}}
            if step % 3 == 0:
                chat["stream"] = True
            answer = self.call("chat", step, "/openai/v1/chat/completions", chat)
            text = _text(answer)
            result = json.loads(self.call("tool", step, "/tools/side_effect",
                                          {"run": self.run, "step": step, "text": text}))
            last = result["n"]

    # -- the runs API ---------------------------------------------------------------------

    def runs_api(self, path: str, headers: dict) -> tuple[int, bytes]:
        """A runs-API call, retried until the proxy answers with something other than 503."""
        for tries in range(10_000):
            self.check_time()
            try:
                status, _, answer = self.send("POST", path, b"", headers)
            except (OSError, http.client.HTTPException):
                status = None
            if status not in (None, 503):
                return status, answer
            self.backoff(tries)
        raise Failed(path)

    def new_attempt(self) -> None:
        status, answer = self.runs_api(f"/runs/{self.run}/attempts", {})
        if status == 409 and _slug(answer) == "run-ended":  # a newer attempt completed it meanwhile
            raise Superseded()
        if status != 201:
            raise self.anomaly("attempts", status, answer)
        self.epoch = json.loads(answer)["epoch"]
        self.say("attempt")

    def complete(self) -> None:
        status, answer = self.runs_api(f"/runs/{self.run}/complete", {"Idem-Epoch": str(self.epoch)})
        if status == 412:
            raise Superseded()
        if status != 200:
            raise self.anomaly("complete", status, answer)

    def main(self) -> int:
        self.say("start")
        try:
            while True:
                try:
                    self.steps_of_attempt()
                    break
                except Failed:
                    self.new_attempt()  # derived keys: crash-only, a fresh attempt from step 1
            self.complete()
        except Superseded:
            self.say("superseded")
            return SUPERSEDED
        except Anomaly:
            return ANOMALY
        self.say("done")
        open(os.path.join(self.folder, "done", self.run), "w").close()
        return 0


def _text(answer: bytes) -> str:
    """The model's words, from a JSON completion or from the chunks of a stream."""
    if answer.startswith(b"data: "):
        words = []
        for line in answer.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    words.append(choice["delta"].get("content", ""))
        return "".join(words)
    return json.loads(answer)["choices"][0]["message"]["content"]


def _slug(answer: bytes) -> str | None:
    try:
        return json.loads(answer)["type"].rsplit("/", 1)[-1]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


if __name__ == "__main__":
    folder = sys.argv[sys.argv.index("--dir") + 1]  # also in the argv, so the campaign can find us
    with open(os.path.join(folder, "pids", str(os.getpid())), "w") as f:
        f.write(os.environ["IDEM_RUN_ID"])
    sys.exit(Agent(folder).main())
