-- wrk's load for every setup of bench/run.py: fenced POSTs rotating over job ids.
--   wrk -s bench/load.lua URL -- PATH JOBS OFFSET GENERATION KEYS [NAME]
-- PATH      the request path
-- JOBS      how many distinct job ids (job-0 .. job-(JOBS-1)); OFFSET is the first
-- GENERATION  a fixed token, or "raise:BASE:EVERY": BASE + how many times EVERY
--           writes the job has had, so every EVERY-th write of a job raises its
--           generation, as a new holder would (BASE must exceed every earlier run's)
-- KEYS      "keys:BASE" gives each write its own Idempotency-Key; "-" gives none
-- NAME      the job ids' prefix ("job-" unless given): one per wrk, when several
--           drive the same store, so each writes its own jobs as holders do
-- Every setup, the baselines included, sends these same requests, so wrk's own cost
-- is the same in each. done() prints one JSON line for the runner.

local path, jobs, offset, fixed, raise_base, raise_every, key_base, name
local counter = 0
local body = '{"amount": 1}'

function init(args)
   path = args[1]
   jobs = tonumber(args[2])
   offset = tonumber(args[3])
   local generation = args[4]
   if generation:sub(1, 6) == "raise:" then
      local base, every = generation:match("^raise:(%d+):(%d+)$")
      raise_base, raise_every = tonumber(base), tonumber(every)
   else
      fixed = generation
   end
   if args[5]:sub(1, 5) == "keys:" then
      key_base = args[5]:sub(6)
   end
   name = args[6] or "job-"
end

function request()
   counter = counter + 1
   local n = offset + counter
   local token = fixed
   if not token then
      -- the job's floor(n / jobs)-th write; its holder changes every raise_every
      token = string.format("%d", raise_base + math.floor(math.floor(n / jobs) / raise_every))
   end
   local headers = {
      ["Content-Type"] = "application/json",
      ["Fencing-Job"] = name .. (n % jobs),
      ["Fencing-Token"] = token,
   }
   if key_base then
      headers["Idempotency-Key"] = key_base .. "-" .. counter
   end
   return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      '{"requests": %d, "duration_us": %d, "non2xx": %d, "socket_errors": %d, '
      .. '"p50_us": %d, "p99_us": %d}\n',
      summary.requests, summary.duration, e.status,
      e.connect + e.read + e.write + e.timeout,
      latency:percentile(50), latency:percentile(99)))
end
