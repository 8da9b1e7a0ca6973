// A worker in Node.js (20 or later), with its standard library alone: it holds a job's
// lease from fenceproxy's lease API and sends its writes through the proxy with the
// lease's fencing headers.
//
//   node examples/worker.mjs --proxy http://127.0.0.1:8080 --job invoice-42 \
//       --owner worker-a --path /billing/charges --body '{"amount": 10}'
//
// It claims the job (waiting while another worker holds it), renews the lease in the
// background, sends its writes with Fencing-Job and Fencing-Token, and completes the
// job. The moment the lease is lost it aborts the write or the work in progress, sends
// nothing more, and exits 1. It prints one JSON line per event.
//
// Each setting is `--name value` or the environment's WORKER_NAME (WORKER_PROXY, ...):
//   proxy   the proxy's URL                       prefix  the lease API's (/_leases)
//   job     the job's id (required)               owner   this worker's name
//   ttl     the lease's ttl, seconds (30)         wait    seconds to wait for a busy job (60)
//   path    the path each write is POSTed to (required), through the proxy
//   body    each write's JSON body ({})           writes  how many writes (1)
//   work    seconds of work before each write (0)
// Exit status: 0 completed; 1 the lease was lost, or a call refused or failed; 2 a bad setting.

import { setTimeout as sleep } from "node:timers/promises";

const MARGIN = 0.1; // of the ttl: a lease is trusted until its ttl less this share
const REQUEST_TIMEOUT = 10; // seconds, each call to the lease API as a whole
const WRITE_TIMEOUT = 30; // seconds, each write as a whole
const WAITABLE = new Set(["lease-held", "write-in-flight"]); // claim refusals that end

const DEFAULTS = {
  proxy: "http://127.0.0.1:8080", prefix: "/_leases", job: undefined,
  owner: `node-${process.pid}`, ttl: "30", wait: "60", path: undefined, body: "{}",
  writes: "1", work: "0",
};

const now = () => performance.now() / 1000; // monotonic seconds: never the wall clock
let job = "";

function say(event, fields = {}) {
  console.log(JSON.stringify({ event, job, ...fields }));
}

class LeaseLost extends Error {}

const reason = (error) => [error.message, error.cause?.message].filter(Boolean).join(": ");

// A call to the lease API answered with a refusal: `why` is the problem's kind.
class Refused extends Error {
  constructor(action, status, problem) {
    const why = String(problem?.type ?? "").split(":").pop() || `status ${status}`;
    super(`${action} refused: ${why}`);
    Object.assign(this, { action, status, why });
  }
}

function settings(argv, env) {
  const given = {};
  for (let n = 0; n < argv.length; n += 2) {
    const name = argv[n].replace(/^--/, "");
    if (!argv[n].startsWith("--") || !(name in DEFAULTS) || argv[n + 1] === undefined) {
      throw new TypeError(`not a setting: ${argv[n]}`);
    }
    given[name] = argv[n + 1];
  }
  const s = {};
  for (const [name, fallback] of Object.entries(DEFAULTS)) {
    s[name] = given[name] ?? env[`WORKER_${name.toUpperCase()}`] ?? fallback;
    if (s[name] === undefined) {
      throw new TypeError(`--${name} (or WORKER_${name.toUpperCase()}) is required`);
    }
  }
  for (const name of ["ttl", "wait", "work", "writes"]) {
    const number = name === "writes" ? /^[0-9]{1,9}$/ : /^[0-9]{1,9}(\.[0-9]+)?$/;
    if (!number.test(s[name])) throw new TypeError(`--${name}: not a number: ${s[name]}`);
    s[name] = Number(s[name]);
  }
  JSON.parse(s.body); // a SyntaxError now, rather than a 4xx from the API later
  return s;
}

// One POST to the lease API, over within `seconds`: the lease's JSON, or Refused.
async function call(s, action, body, seconds) {
  const job = encodeURIComponent(s.job).replaceAll(".", "%2E"); // never a dot segment
  const answer = await fetch(`${s.proxy}${s.prefix}/${job}/${action}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(Math.floor(seconds * 1000)),
  });
  const reply = await answer.json().catch(() => null);
  if (!answer.ok) throw new Refused(action, answer.status, reply);
  return reply;
}

// A held lease: renewed in the background until stop(); `signal` aborts the moment it is lost.
class Lease {
  constructor(s, reply, sent) {
    this.s = s;
    this.controller = new AbortController();
    this.signal = this.controller.signal;
    this.granted(reply, sent);
  }

  // A claim or renewal sent at `sent` was granted: trusted until then plus the ttl
  // less the margin (the safe side of the store's clock), renewed every ttl/3.
  granted(reply, sent) {
    this.generation = reply.generation;
    this.token = reply.token;
    this.ttl = reply.ttl;
    this.deadline = sent + reply.ttl * (1 - MARGIN);
    this.renewIn(reply.ttl / 3);
  }

  renewIn(seconds) {
    if (!this.stopped && !this.signal.aborted) {
      this.timer = setTimeout(() => (this.renewing = this.renew()), seconds * 1000);
    }
  }

  async renew() {
    const sent = now();
    const left = this.deadline - sent;
    if (left <= 0) return this.lose("no renewal was confirmed before the local deadline");
    const body = { owner: this.s.owner, generation: this.generation };
    try {
      const reply = await call(this.s, "renew", body, Math.min(REQUEST_TIMEOUT, left));
      if (now() >= this.deadline) {
        return this.lose("the renewal was answered after the local deadline");
      }
      this.granted(reply, sent);
      say("renewed", { generation: this.generation });
    } catch (error) {
      if (error instanceof Refused) return this.lose(`renewal refused: ${error.why}`);
      // The service could not be reached: try again soon, until the deadline.
      say("renewal-failed", { why: reason(error) });
      this.renewIn(Math.min(this.ttl / 12, 1));
    }
  }

  lose(why) {
    if (this.signal.aborted) return;
    clearTimeout(this.timer);
    this.controller.abort(new LeaseLost(why)); // every fetch and wait given `signal` ends now
  }

  // The fencing headers for the next write; LeaseLost once the lease is lost.
  headers() {
    if (now() >= this.deadline) this.lose("the lease is past its local deadline");
    this.signal.throwIfAborted();
    return { "Fencing-Job": this.s.job, "Fencing-Token": this.token };
  }

  // No more renewals: the one under way, if any, is over before complete or release.
  async stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    await this.renewing;
    this.signal.throwIfAborted();
  }

  async end(action) {
    await this.stop();
    const left = this.deadline - now();
    if (left <= 0) throw new LeaseLost("the lease is past its local deadline");
    const body = { owner: this.s.owner, generation: this.generation };
    await call(this.s, action, body, Math.min(REQUEST_TIMEOUT, left));
  }
}

// Claim the job, waiting up to `wait` seconds in all while it is held: each claim asks
// the service to hold it while the job is busy, for at most a third of the ttl, so a
// grant comes with most of its lease left.
async function claim(s) {
  const until = now() + s.wait;
  for (;;) {
    const wait = Math.max(0, Math.min(until - now(), s.ttl / 3));
    say("claiming", { owner: s.owner, wait });
    const sent = now();
    try {
      const body = { owner: s.owner, ttl: s.ttl, wait };
      const reply = await call(s, "claim", body, wait + REQUEST_TIMEOUT);
      return new Lease(s, reply, sent);
    } catch (error) {
      if (!(error instanceof Refused && WAITABLE.has(error.why)) || now() >= until) throw error;
      say("waiting", { why: error.why });
      // A service that answered sooner than asked (its own max_wait) is asked again later.
      if (now() - sent < wait) await sleep(Math.min(1, until - now()) * 1000);
    }
  }
}

async function work(s) {
  const lease = await claim(s);
  say("claimed", { generation: lease.generation });
  try {
    for (let step = 0; step < s.writes; step++) {
      await sleep(s.work * 1000, undefined, { signal: lease.signal }); // the work itself
      const answer = await fetch(s.proxy + s.path, {
        method: "POST",
        headers: {
          ...lease.headers(),
          "Content-Type": "application/json",
          "Idempotency-Key": `${s.job}-${step}`,
        },
        body: s.body,
        signal: AbortSignal.any([lease.signal, AbortSignal.timeout(WRITE_TIMEOUT * 1000)]),
      });
      const reply = await answer.json().catch(() => null); // a problem, when refused
      say("wrote", { step, status: answer.status, generation: lease.generation });
      if (!answer.ok) throw new Refused("write", answer.status, reply); // never a success
    }
    await lease.end("complete");
    say("completed", { generation: lease.generation });
    return 0;
  } catch (error) {
    if (lease.signal.aborted) {
      say("lost", { generation: lease.generation, why: lease.signal.reason.message });
      return 1;
    }
    say(error instanceof Refused ? "refused" : "failed", { why: reason(error) });
    // The next worker need not wait for the lease to run out.
    await lease.end("release").then(() => say("released"), () => {});
    return 1;
  }
}

async function main() {
  let s;
  try {
    s = settings(process.argv.slice(2), process.env);
  } catch (error) {
    console.error(`worker.mjs: ${error.message} (see the file's top)`);
    return 2;
  }
  job = s.job;
  try {
    return await work(s);
  } catch (error) { // the claim refused (job-completed, ...) or failed
    say(error instanceof Refused ? "refused" : "failed", { why: reason(error) });
    return 1;
  }
}

process.exit(await main());
