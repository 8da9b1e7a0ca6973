// A worker in Java (17 or later), with its standard library alone: it holds a job's
// lease from fenceproxy's lease API and sends its writes through the proxy with the
// lease's fencing headers. Run from its source, nothing to build (a JDK, not a JRE):
//
//   java examples/Worker.java --proxy http://127.0.0.1:8080 --job invoice-42 \
//       --owner worker-a --path /billing/charges --body '{"amount": 10}'
//
// It claims the job (waiting while another worker holds it), renews the lease in the
// background, sends its writes with Fencing-Job and Fencing-Token, and completes the
// job. The moment the lease is lost it interrupts the write or the work in progress,
// sends nothing more, and exits 1. It prints one JSON line per event.
//
// Each setting is `--name value` or the environment's WORKER_NAME (WORKER_PROXY, ...):
//   proxy   the proxy's URL                       prefix  the lease API's (/_leases)
//   job     the job's id (required)               owner   this worker's name
//   ttl     the lease's ttl, seconds (30)         wait    seconds to wait for a busy job (60)
//   path    the path each write is POSTed to (required), through the proxy
//   body    each write's JSON body ({})           writes  how many writes (1)
//   work    seconds of work before each write (0)
// Exit status: 0 completed; 1 the lease was lost, or a call refused or failed; 2 a bad setting.
//
// Every request is bounded by HttpRequest.Builder.timeout. Never set expectContinue(true):
// the JDK's client then waits for ever on a server that refuses before the body.

import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.Executors;
import java.util.concurrent.RejectedExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Worker {
    static final double MARGIN = 0.1; // of the ttl: a lease is trusted until its ttl less this
    static final double REQUEST_TIMEOUT = 10; // seconds, each call to the lease API as a whole
    static final double WRITE_TIMEOUT = 30; // seconds, each write as a whole
    static final Set<String> WAITABLE = Set.of("lease-held", "write-in-flight"); // they end
    static final Map<String, String> DEFAULTS = Map.of(
            "proxy", "http://127.0.0.1:8080", "prefix", "/_leases",
            "owner", "java-" + ProcessHandle.current().pid(), "ttl", "30", "wait", "60",
            "body", "{}", "writes", "1", "work", "0");
    static final List<String> NAMES = List.of(
            "proxy", "prefix", "job", "owner", "ttl", "wait", "path", "body", "writes", "work");

    /** The lease was lost: no write may be sent under it any more. */
    static class LeaseLost extends Exception {
        LeaseLost(String why) { super(why); }
    }

    /** A call answered with a refusal: {@code why} is the problem's kind. */
    static class Refused extends Exception {
        final String why;

        Refused(String action, int status, String problem) {
            this(action, field(problem, "type") == null
                    ? "status " + status : field(problem, "type").replaceAll(".*:", ""));
        }

        private Refused(String action, String why) {
            super(action + " refused: " + why);
            this.why = why;
        }
    }

    /** A claim or renewal granted: trusted until {@code deadline} (System.nanoTime()). */
    record Grant(long generation, String token, double ttl, long deadline) {}

    final HttpClient http = HttpClient.newBuilder()
            .version(HttpClient.Version.HTTP_1_1) // no h2c upgrade: the proxy speaks HTTP/1.1
            .connectTimeout(Duration.ofSeconds(5))
            .build();
    final ScheduledExecutorService renewer = Executors.newSingleThreadScheduledExecutor(task -> {
        Thread thread = new Thread(task, "renewer");
        thread.setDaemon(true);
        return thread;
    });
    final Thread worker = Thread.currentThread();
    final Map<String, String> s;
    volatile Grant grant;
    volatile String lost; // why the lease was lost; null while it is held

    Worker(Map<String, String> settings) { s = settings; }

    static double now() { return System.nanoTime() / 1e9; } // monotonic: never the wall clock

    static long nanos(double seconds) { return (long) (seconds * 1e9); }

    double number(String name) { return Double.parseDouble(s.get(name)); }

    void say(String event, Object... fields) {
        StringBuilder line = new StringBuilder("{\"event\":").append(quote(event));
        line.append(",\"job\":").append(quote(s.get("job")));
        for (int n = 0; n < fields.length; n += 2) {
            Object value = fields[n + 1];
            line.append(',').append(quote((String) fields[n])).append(':');
            line.append(value instanceof Number ? value.toString() : quote(String.valueOf(value)));
        }
        System.out.println(line.append('}'));
    }

    /** One POST to the lease API, over within {@code seconds}: the lease's JSON, or Refused. */
    String call(String action, String body, double seconds)
            throws IOException, InterruptedException, Refused {
        String job = encode(s.get("job")); // never a dot segment: '.' is encoded too
        URI uri = URI.create(s.get("proxy") + s.get("prefix") + "/" + job + "/" + action);
        HttpRequest request = HttpRequest.newBuilder(uri)
                .timeout(Duration.ofNanos(Math.max(1, nanos(seconds))))
                .header("Content-Type", "application/json")
                .POST(HttpRequest.BodyPublishers.ofString(body))
                .build();
        HttpResponse<String> answer = http.send(request, HttpResponse.BodyHandlers.ofString());
        if (answer.statusCode() >= 400) {
            throw new Refused(action, answer.statusCode(), answer.body());
        }
        return answer.body();
    }

    String holder() {
        return "{\"owner\":" + quote(s.get("owner")) + ",\"generation\":" + grant.generation()
                + "}";
    }

    /** A claim or renewal sent at {@code sent} was granted: trusted until then plus the
     * ttl less the margin (the safe side of the store's clock), renewed every ttl/3. */
    void granted(String reply, long sent) {
        double ttl = Double.parseDouble(field(reply, "ttl"));
        grant = new Grant(Long.parseLong(field(reply, "generation")), field(reply, "token"), ttl,
                sent + nanos(ttl * (1 - MARGIN)));
        renewIn(ttl / 3);
    }

    void renewIn(double seconds) {
        try {
            renewer.schedule(this::renew, nanos(seconds), TimeUnit.NANOSECONDS);
        } catch (RejectedExecutionException stopped) {
            // the lease is lost, or being completed or released: no more renewals
        }
    }

    void renew() {
        long sent = System.nanoTime();
        double left = (grant.deadline() - sent) / 1e9;
        if (left <= 0) {
            lose("no renewal was confirmed before the local deadline");
            return;
        }
        try {
            String reply = call("renew", holder(), Math.min(REQUEST_TIMEOUT, left));
            if (System.nanoTime() - grant.deadline() >= 0) {
                lose("the renewal was answered after the local deadline");
                return;
            }
            granted(reply, sent);
            say("renewed", "generation", grant.generation());
        } catch (Refused refused) {
            lose("renewal refused: " + refused.why);
        } catch (IOException failed) { // not reached: try again soon, until the deadline
            say("renewal-failed", "why", String.valueOf(failed));
            renewIn(Math.min(grant.ttl() / 12, 1));
        } catch (InterruptedException stopping) {
            // the worker is stopping
        }
    }

    /** The lease is lost: the worker's write or work in progress is interrupted now. */
    synchronized void lose(String why) {
        if (lost == null) {
            lost = why;
            renewer.shutdown();
            worker.interrupt();
        }
    }

    /** The fencing headers for the next write; LeaseLost once the lease is lost. */
    String[] headers() throws LeaseLost {
        if (System.nanoTime() - grant.deadline() >= 0) lose("the lease is past its local deadline");
        if (lost != null) throw new LeaseLost(lost);
        return new String[] {"Fencing-Job", s.get("job"), "Fencing-Token", grant.token()};
    }

    /** Complete or release: no renewal is sent any more, nor under way. */
    void end(String action) throws Exception {
        renewer.shutdown();
        renewer.awaitTermination(nanos(REQUEST_TIMEOUT), TimeUnit.NANOSECONDS);
        double left = (grant.deadline() - System.nanoTime()) / 1e9;
        if (lost != null) throw new LeaseLost(lost);
        if (left <= 0) throw new LeaseLost("the lease is past its local deadline");
        call(action, holder(), Math.min(REQUEST_TIMEOUT, left));
    }

    /** Claim the job, waiting up to {@code wait} seconds in all while it is held: each
     * claim asks the service to hold it while the job is busy, for at most a third of
     * the ttl, so a grant comes with most of its lease left. */
    void claim() throws IOException, InterruptedException, Refused {
        double until = now() + number("wait");
        while (true) {
            double wait = Math.max(0, Math.min(until - now(), number("ttl") / 3));
            say("claiming", "owner", s.get("owner"), "wait", wait);
            long sent = System.nanoTime();
            String body = "{\"owner\":" + quote(s.get("owner")) + ",\"ttl\":" + number("ttl")
                    + ",\"wait\":" + wait + "}";
            try {
                granted(call("claim", body, wait + REQUEST_TIMEOUT), sent);
                return;
            } catch (Refused refused) {
                if (!WAITABLE.contains(refused.why) || now() >= until) throw refused;
                say("waiting", "why", refused.why);
                // A service that answered sooner than asked (its max_wait) is asked later.
                if ((System.nanoTime() - sent) / 1e9 < wait) {
                    Thread.sleep((long) (Math.min(1, until - now()) * 1000));
                }
            }
        }
    }

    int work() throws IOException, InterruptedException, Refused {
        claim();
        say("claimed", "generation", grant.generation());
        try {
            for (int step = 0; step < number("writes"); step++) {
                Thread.sleep((long) (number("work") * 1000)); // the work itself
                URI uri = URI.create(s.get("proxy") + s.get("path"));
                HttpRequest write = HttpRequest.newBuilder(uri)
                        .timeout(Duration.ofNanos(nanos(WRITE_TIMEOUT)))
                        .headers(headers())
                        .header("Content-Type", "application/json")
                        .header("Idempotency-Key", s.get("job") + "-" + step)
                        .POST(HttpRequest.BodyPublishers.ofString(s.get("body")))
                        .build();
                // Interrupted when the lease is lost: the request is cancelled.
                var answer = http.send(write, HttpResponse.BodyHandlers.ofString());
                int status = answer.statusCode();
                say("wrote", "step", step, "status", status, "generation", grant.generation());
                if (status >= 400) { // a refused write is never a success
                    throw new Refused("write", status, answer.body());
                }
            }
            end("complete");
            say("completed", "generation", grant.generation());
            return 0;
        } catch (Exception error) {
            if (lost != null) {
                say("lost", "generation", grant.generation(), "why", lost);
                return 1;
            }
            failed(error);
            try {
                end("release"); // the next worker need not wait for the lease to run out
                say("released");
            } catch (Exception ignored) {
                // it runs out at its ttl
            }
            return 1;
        }
    }

    void failed(Exception error) {
        say(error instanceof Refused ? "refused" : "failed", "why", String.valueOf(error));
    }

    /** The settings from the environment, then the arguments; IllegalArgumentException. */
    static Map<String, String> settings(String[] args) {
        Map<String, String> settings = new HashMap<>(DEFAULTS);
        for (String name : NAMES) {
            String value = System.getenv("WORKER_" + name.toUpperCase());
            if (value != null) settings.put(name, value);
        }
        for (int n = 0; n < args.length; n += 2) {
            String name = args[n].replaceFirst("^--", "");
            if (!args[n].startsWith("--") || !NAMES.contains(name) || n + 1 == args.length) {
                throw new IllegalArgumentException("not a setting: " + args[n]);
            }
            settings.put(name, args[n + 1]);
        }
        for (String name : NAMES) {
            if (!settings.containsKey(name)) {
                throw new IllegalArgumentException("--" + name + " (or WORKER_"
                        + name.toUpperCase() + ") is required");
            }
        }
        for (String name : List.of("ttl", "wait", "work", "writes")) {
            String number = name.equals("writes") ? "[0-9]{1,9}" : "[0-9]{1,9}(\\.[0-9]+)?";
            if (!settings.get(name).matches(number)) {
                throw new IllegalArgumentException("--" + name + ": not a number: "
                        + settings.get(name));
            }
        }
        return settings;
    }

    public static void main(String[] args) throws InterruptedException {
        Worker worker;
        try {
            worker = new Worker(settings(args));
        } catch (IllegalArgumentException bad) {
            System.err.println("Worker.java: " + bad.getMessage() + " (see the file's top)");
            System.exit(2);
            return;
        }
        int status;
        try {
            status = worker.work();
        } catch (IOException | Refused error) { // the claim refused (job-completed, ...) or failed
            worker.failed(error);
            status = 1;
        }
        System.exit(status);
    }

    // -- a little JSON: enough for the fields read and written here, not a parser --

    /** A top-level string or number field of a JSON object; null when absent. */
    static String field(String json, String name) {
        Matcher found = Pattern.compile("\"" + Pattern.quote(name)
                        + "\"\\s*:\\s*(?:\"((?:[^\"\\\\]|\\\\.)*)\"|([-+.0-9eE]+))")
                .matcher(json == null ? "" : json);
        if (!found.find()) return null;
        return found.group(1) != null ? found.group(1).replaceAll("\\\\(.)", "$1") : found.group(2);
    }

    static String quote(String text) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') out.append('\\').append(c);
            else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
            else out.append(c);
        }
        return out.append('"').toString();
    }

    /** A path segment: every byte but letters, digits, '-', '_' and '~' percent-encoded. */
    static String encode(String segment) {
        StringBuilder out = new StringBuilder();
        for (byte b : segment.getBytes(StandardCharsets.UTF_8)) {
            char c = (char) (b & 0xff);
            boolean plain = c < 128 && (Character.isLetterOrDigit(c) || "-_~".indexOf(c) >= 0);
            out.append(plain ? String.valueOf(c) : String.format("%%%02X", b & 0xff));
        }
        return out.toString();
    }
}
