-- wrk script for the idemproxy benchmark (driven by bench/loadgen.py).
--
-- Every request is the same POST; what changes is the Idempotency-Key:
--   BENCH_KEY         the same key on every request (replay)
--   BENCH_KEY_PREFIX  a fresh key per request: prefix .. thread .. "-" .. n (record)
--   neither           no key (baseline, passthrough)
-- BENCH_BODY is the body, BENCH_HEADERS "Name: value" lines. At the end one line
-- "BENCH_JSON {...}" carries the counts and latency percentiles (microseconds).

wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY") or ""
for line in (os.getenv("BENCH_HEADERS") or ""):gmatch("[^\n]+") do
  local name, value = line:match("^([^:]+):%s*(.-)%s*$")
  if name then wrk.headers[name] = value end
end

local fixed_key = os.getenv("BENCH_KEY") or ""
if fixed_key ~= "" then wrk.headers["Idempotency-Key"] = fixed_key end

local threads = {}

function setup(thread)
  thread:set("thread_id", #threads + 1)
  table.insert(threads, thread)
end

-- Only defined when keys must differ: wrk sends a request formatted once, in C, when the
-- script has no request() function, which keeps the other scenarios as cheap as can be.
local prefix = os.getenv("BENCH_KEY_PREFIX") or ""
if prefix ~= "" then
  local n, mine = 0, prefix
  function init(args)
    mine = prefix .. tostring(thread_id) .. "-"
  end
  function request()
    n = n + 1
    wrk.headers["Idempotency-Key"] = mine .. n
    return wrk.format()
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,'
      .. '"max_us":%d,"mean_us":%.1f,"errors":{"connect":%d,"read":%d,"write":%d,'
      .. '"status":%d,"timeout":%d}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write,
    e.status, e.timeout))
end
