/*
 * fenceproxy's protocol for one job, as spin checks it (model/check.py runs it).
 *
 * Actors: WORKERS workers that claim, renew, complete, release and write through
 * any of PROXIES proxies; the store, whose transactions are the atomic blocks
 * below; the upstream, which applies the writes it receives in the order they
 * arrive, each after a delay of its own; crashes of proxies; and the store's
 * clock, the only clock any decision reads.
 *
 * Every worker has the same owner name (one worker restarted while its old
 * incarnation is paused somewhere), so only the generation tells their leases
 * apart: the owner check is never what keeps them apart here.
 *
 * Time is counted in ticks of the store's clock. A lease lasts TTL; a route's
 * connect_timeout + timeout is TIMEOUT and its quarantine QUAR; the proxy sends
 * an admitted write within SLACK of its admission (fenceproxy/fence/write.py,
 * TURN_SLACK), so a write's in-flight record lasts HOLD. The upstream is assumed
 * to apply a write, if ever, within TIMEOUT + QUAR of its sending: that is what a
 * route's quarantine says. It rests on the proxy cutting a write at its timeout
 * (fenceproxy/http/http1.py aborts the connection, which resets it, before the record
 * is given back or its quarantine starts): nothing more of the request reaches the
 * upstream after TIMEOUT, so only a request the upstream already has whole can
 * still be applied, within QUAR. The proxy's own timers are read on the store's clock:
 * a proxy whose clock runs slower than the store's by more than the slack is
 * outside the model.
 *
 * With -DORDER_GENERATION the route orders writes by generation (fence.order:
 * generation): each worker has a second writer, so a holder may have two writes
 * in flight at once; the job's in-flight records are a set, one per admitted
 * write, and a write is held back only by a live record of another generation
 * (fenceproxy/leases/model.py, in_the_way). With -DEXTERNAL_LEASES the workers'
 * generations come from a lease service of their own, which knows nothing of the
 * writes in flight: the store learns of a generation from its first write, so
 * that write may meet older ones still in flight.
 *
 * Besides what may reach the upstream, one property of liveness is checked as an
 * assertion: a claim that finds the lease run out waits (write-in-flight) only for
 * writes admitted before a claim first asked, never for one admitted after, so a
 * holder past its lease that keeps writing cannot keep the next holder out. Ghosts
 * mark a record taken while a claim waits (rlate); a claim refused by one fails.
 *
 * Each mutant (-DNAME, listed in model/check.py) is a deliberate protocol bug that
 * must fail. The printf lines tell a counterexample's story when a trail is
 * replayed (pan -r -S); the verifier does not print them.
 */

#ifndef WORKERS
#define WORKERS 2
#endif
#ifndef PROXIES
#define PROXIES 1
#endif
#ifndef MAXGEN
#define MAXGEN 3        /* claims handed out, at most */
#endif
#ifndef MAXT
#define MAXT 3          /* the store's clock runs from 0 to MAXT */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1      /* proxy crashes, at most */
#endif
#ifndef KEYS
#define KEYS 1          /* idempotency keys the workers draw from */
#endif
#define TTL 2
#define TIMEOUT 1
#define QUAR 1
#ifndef SLACK
#define SLACK 0
#endif
#ifdef HOLD_NO_SLACK
#define HOLD (TIMEOUT + QUAR)
#else
#define HOLD (SLACK + TIMEOUT + QUAR)
#endif

#ifdef ORDER_GENERATION
#define WRITERS 2                        /* writes a worker may have going at once */
#else
#define WRITERS 1
#endif
#define NOKEY KEYS                       /* a write without a key */
#define TURNS 8                          /* turn names per writer */
#ifdef ORDER_GENERATION
#define SLOTS 8                          /* writes on the wire at once, at most */
#else
#define SLOTS (2 * WORKERS)
#endif
#define CRASHED 255                      /* the holder a restart would invent */

/* The store's clock (time.time() where the store runs, or PostgreSQL's now). */
byte now;

/* The job's lease (leases table; decisions in fenceproxy/leases/model.py). */
mtype = { NONE, HELD, RELEASED, COMPLETED };
mtype lstate = NONE;
byte lgen;
byte luntil;

/* The fence: the highest generation accepted (fences table). */
byte fence;

#ifdef ORDER_GENERATION
/* The job's in-flight records (inflight table), one per admitted write: which turn
   may have a write at the upstream, of which generation, and until when. */
/* A writer's records live at once: the write it has going, one timed out in the
   last tick, one a crashed proxy dropped; WORKERS = 1 when ordered by generation. */
#define RECORDS 6
byte rholder[RECORDS];                   /* 0: none */
byte rexpires[RECORDS];
byte rgen[RECORDS];
bool rlate[RECORDS];                     /* ghost: taken while a claim was waiting */
#else
/* The job's in-flight record (inflight table): which turn may have a write at
   the upstream, and until when. */
byte rholder;                            /* 0: none */
byte rexpires;
bool rlate;                              /* ghost: taken while a claim was waiting */
#endif

/* The job's idempotency keys (idempotency_keys table). */
mtype = { KNONE, KIN, KDONE, KUNKNOWN };
mtype kstate[KEYS];
byte kgen[KEYS];                         /* the fingerprint: the generation that sent it */
byte kholder[KEYS];                      /* the turn that took it */

/* The wire between the proxies and the upstream: a bag, not a queue. */
bool mfull[8];
byte mgen[8];
byte mkey[8];
byte mdead[8];                           /* the upstream applies it only before then */
byte mturn[8];

/* Each proxy process: a crash and restart is a new epoch, its memory gone. */
byte epoch[PROXIES];

/* The answer to each writer's write, as its proxy got it: the turn it answers.
   Writer w + j * WORKERS is worker w's j-th. */
byte answer[WORKERS * WRITERS];
/* The generation each worker was last given, which its writers write with. */
byte wgen[WORKERS];

/* Ghosts: what happened, for the properties. Nothing above reads them. */
byte applied;                            /* highest generation the upstream applied */
byte claimed;                            /* highest generation whose claim was told */
byte issued;                             /* highest generation ever handed out */
bool kapplied[KEYS];                     /* the upstream applied this key's write */
byte bgen[WORKERS];                      /* the lease a worker was told it holds ... */
byte buntil[WORKERS];                    /* ... until then, on the store's clock */
bool waiting;                            /* a claim was refused write-in-flight, none granted since */

#ifdef ORDER_GENERATION
#define live(i) (rholder[i] != 0 && rexpires[i] > now)
#define live_record (live(0) || live(1) || live(2) || live(3) || live(4) || live(5))
#ifdef GEN_OVERTAKE
/* the bug: only a write of a newer generation would hold one back */
#define way(i, t, g) (live(i) && rholder[i] != t && rgen[i] > g)
#else
#define way(i, t, g) (live(i) && rholder[i] != t && rgen[i] != g)
#endif
#define in_way(t, g) (way(0, t, g) || way(1, t, g) || way(2, t, g) || way(3, t, g) \
	|| way(4, t, g) || way(5, t, g))
#define holds(t) (rholder[0] == t || rholder[1] == t || rholder[2] == t || rholder[3] == t \
	|| rholder[4] == t || rholder[5] == t)
#define crashed_record (rholder[0] == CRASHED || rholder[1] == CRASHED \
	|| rholder[2] == CRASHED || rholder[3] == CRASHED || rholder[4] == CRASHED \
	|| rholder[5] == CRASHED)
#define late(i) (live(i) && rlate[i])
#define late_record (late(0) || late(1) || late(2) || late(3) || late(4) || late(5))
#define take(t, g) \
	v = 0; \
	do \
	:: v < RECORDS && rholder[v] != t && live(v) -> v++ \
	:: else -> break \
	od; \
	assert(v < RECORDS); \
	rholder[v] = t; rexpires[v] = now + HOLD; rgen[v] = g; rlate[v] = waiting; v = 0
#define give_back(t) \
	for (v : 0 .. RECORDS - 1) { \
		if \
		:: rholder[v] == t -> rholder[v] = 0; rexpires[v] = 0; rgen[v] = 0; rlate[v] = false \
		:: else \
		fi \
	} \
	v = 0
#define hold_unknown(t) \
	for (v : 0 .. RECORDS - 1) { \
		if \
		:: rholder[v] == t -> rexpires[v] = (now + QUAR > rexpires[v] -> now + QUAR : rexpires[v]) \
		:: else \
		fi \
	} \
	v = 0
#define record_until rexpires[0]
#else
#define live_record (rholder != 0 && rexpires > now)
#define in_way(t, g) (live_record && rholder != t)
#define holds(t) (rholder == t)
#define crashed_record (rholder == CRASHED)
#define late_record (live_record && rlate)
#define take(t, g) rholder = t; rexpires = now + HOLD; rlate = waiting
#define give_back(t) if :: rholder == t -> rholder = 0; rexpires = 0; rlate = false :: else fi
#define hold_unknown(t) \
	if \
	:: rholder == t -> rexpires = (now + QUAR > rexpires -> now + QUAR : rexpires) \
	:: else \
	fi
#define record_until rexpires
#endif
#define lease_live(g) (lgen == (g) && lstate == HELD && now < luntil)
#define forget(k) kstate[k] = KNONE; kgen[k] = 0; kholder[k] = 0
#define drop(i) mfull[i] = false; mgen[i] = 0; mkey[i] = 0; mdead[i] = 0; mturn[i] = 0

/* A turn names one attempt at a write, unlike any other the store or the wire
   still holds (fenceproxy.fence.fencing._new_turn: a process prefix and a counter).
   The model takes the first free name, so names never tell two states apart; a
   late answer to an earlier turn is forgotten when the worker's next write
   starts, since that turn's write has left the wire. */
#define new_turn(w, t) \
	t = 1 + (w) * TURNS; \
	do \
	:: holds(t) || t == mturn[0] || t == mturn[1] || t == mturn[2] || t == mturn[3] \
	   || t == mturn[4] || t == mturn[5] || t == mturn[6] || t == mturn[7] -> t++ \
	:: else -> break \
	od; \
	assert(t <= (w + 1) * TURNS)

/* Property: no two workers are told they hold the job at one instant. */
#define exclusive(w) \
	for (v : 0 .. WORKERS - 1) { \
		assert(v == w || bgen[v] == 0 || buntil[v] <= now) \
	}

/* Properties of what reaches the upstream, checked as it applies a write. */
#define land(i) \
	assert(mgen[i] >= applied);   /* never an older generation after a newer one */ \
	assert(mgen[i] >= claimed);   /* never an old holder's after a newer claim was told */ \
	applied = mgen[i]; \
	if \
	:: mkey[i] != NOKEY -> assert(!kapplied[mkey[i]]); kapplied[mkey[i]] = true \
	:: else \
	fi

active proctype Clock()
{
	byte i;
end:	do
	:: atomic {
		now < MAXT -> now++;
		printf("--- the store's clock reads %d\n", now);
		/* What no longer tells states apart is forgotten: a lease that has run
		   out, a belief that has, a write the upstream may no longer apply. */
		if
		:: luntil <= now -> luntil = 0
		:: else
		fi;
		for (i : 0 .. WORKERS - 1) {
			if
			:: buntil[i] <= now -> bgen[i] = 0; buntil[i] = 0
			:: else
			fi
		}
		for (i : 0 .. SLOTS - 1) {
			if
			:: mfull[i] && mdead[i] <= now -> drop(i)
			:: else
			fi
		}
#ifdef ORDER_GENERATION
		for (i : 0 .. RECORDS - 1) {
			if
			:: rholder[i] != 0 && rexpires[i] <= now ->
				rholder[i] = 0; rexpires[i] = 0; rgen[i] = 0; rlate[i] = false
			:: else
			fi
		}
#endif
		i = 0
	}
	od
}

active proctype Crashes()
{
	byte crashes, p;
end:	do
	:: crashes < MAXCRASH ->
		atomic {
			select(p : 0 .. PROXIES - 1);
			printf("proxy %d crashes and restarts\n", p);
			epoch[p]++;
			crashes++;
#ifdef CRASH_FREES_ALL
			rholder = 0;             /* records tied to the dead proxy's session */
#endif
#ifdef CRASH_HOLDS_ALL
			rholder = CRASHED;       /* a restart that holds every job */
			rexpires = now + HOLD;
#endif
			p = 0
		}
	od
}

active proctype Upstream()
{
	byte i, w;
end:	do
	:: atomic {
		if   /* any write on the wire, whenever it was sent */
		:: mfull[0] -> i = 0
		:: mfull[1] -> i = 1
		:: mfull[2] -> i = 2
		:: mfull[3] -> i = 3
		:: mfull[4] -> i = 4
		:: mfull[5] -> i = 5
		:: mfull[6] -> i = 6
		:: mfull[7] -> i = 7
		fi;
		w = (mturn[i] - 1) / TURNS;     /* the writer */
		if
		:: now < mdead[i] ->
			printf("upstream applies worker %d's write of generation %d\n", w, mgen[i]);
			land(i);
			answer[w] = mturn[i]
		:: now < mdead[i] ->
			printf("upstream applies worker %d's write of generation %d; the answer is lost\n",
				w, mgen[i]);
			land(i)
		:: printf("upstream never applies worker %d's write of generation %d\n", w, mgen[i])
		fi;
		drop(i); i = 0; w = 0
	}
	od
}

/* A write through a proxy (Proxy._forward_fenced) by worker who's writer writer,
   of generation gen; its locals are the caller's. */
inline write_through(who, writer, gen)
{
	atomic {
		select(k : 0 .. NOKEY);
		select(p : 0 .. PROXIES - 1);
		if
		:: checked = true    /* a lease-checked route */
		:: checked = false
		fi;
		e = epoch[p];
		answer[writer] = 0;
		new_turn(writer, t);
		if
		:: k == NOKEY -> printf("worker %d sends a write of generation %d to proxy %d\n", who, gen, p)
		:: else -> printf("worker %d sends a write of generation %d with key %d to proxy %d\n",
			who, gen, k, p)
		fi
	};
admit:		/* Store.admit: the key, the fence, the lease and the record, in one transaction */
	atomic {
		if
		:: epoch[p] != e -> goto done
		:: else
		fi;
		if   /* idempotency-key-reused, duplicate-in-flight, -outcome-unknown, a replay */
		:: k != NOKEY && kstate[k] != KNONE ->
			printf("  refused or replayed: key %d is on record\n", k);
			goto done
		:: else
		fi;
#ifndef FENCE_AFTER_FORWARD
		if
		:: gen < fence -> printf("  refused: stale-generation, the fence is %d\n", fence); goto done
		:: else
		fi;
#endif
#ifndef NO_LEASE_CHECK
		if
		:: checked && !lease_live(gen) -> printf("  refused: lease-not-live\n"); goto done
		:: else
		fi;
#endif
		if
		:: in_way(t, gen) ->
			/* busy: only a write that took a record holds its job */
			assert(!crashed_record);
			if
			:: goto admit        /* polls again, up to the route's timeout */
			:: printf("  refused: job-quarantined, the record holds until %d\n", record_until);
			   goto done
			fi
		:: else
		fi;
		/* a lease-checked route admits only the holder of a live lease */
		assert(!checked || lease_live(gen));
		take(t, gen);
#ifndef FENCE_AFTER_FORWARD
		fence = (gen > fence -> gen : fence);
#endif
		if
		:: k != NOKEY -> kstate[k] = KIN; kgen[k] = gen; kholder[k] = t
		:: else
		fi;
		printf("  admitted; its record holds until %d\n", now + HOLD);
		at = now
	};
	/* Sent only within SLACK of the admission: a proxy that stalled gives it back. */
	atomic {
		if
		:: epoch[p] != e -> goto done
#ifndef NO_SEND_DEADLINE
		:: now > at + SLACK ->
			printf("  proxy %d stalled: worker %d's write is given back, not sent\n", p, who);
			if
			:: k != NOKEY && kstate[k] == KIN && kholder[k] == t -> forget(k)
			:: else
			fi;
			give_back(t);
			goto done
#endif
		:: else ->
			v = 0;
			do
			:: mfull[v] -> v++
			:: else -> break
			od;
			assert(v < SLOTS);
			mfull[v] = true; mgen[v] = gen; mkey[v] = k; mturn[v] = t;
			mdead[v] = now + TIMEOUT + QUAR;
			printf("  proxy %d forwards worker %d's write\n", p, who);
			at = now;    /* from here on: when it was sent */
#ifdef EARLY_RELEASE
			give_back(t);
#endif
			v = 0
		fi
	};
	/* The answer, or the route's timeout (which the bounded clock may never reach:
	   waiting here at the end of time is a valid end). */
end_answer:
	if
	:: epoch[p] != e -> goto done
	:: atomic {
		epoch[p] == e && answer[writer] == t ->
		/* the key settles first, then the record is given back */
		if
		:: k != NOKEY && kstate[k] == KIN && kholder[k] == t -> kstate[k] = KDONE
		:: else
		fi;
#ifdef FENCE_AFTER_FORWARD
		fence = (gen > fence -> gen : fence);
#endif
		give_back(t);
		printf("  worker %d's write is answered\n", who);
		goto done
	   }
	:: atomic {
		epoch[p] == e && now >= at + TIMEOUT ->
		/* outcome unknown: the key says so, the record stays for QUAR */
		if
		:: k != NOKEY && kstate[k] == KIN && kholder[k] == t ->
#ifdef KEY_FORGET_ON_TIMEOUT
			forget(k)
#else
			kstate[k] = KUNKNOWN
#endif
		:: else
		fi;
		hold_unknown(t);
#ifdef CLOSE_NOT_ABORT
		/* closed, not aborted: the rest of the body is flushed on, and the
		   upstream may have the request whole at any later time */
		for (v : 0 .. SLOTS - 1) {
			if
			:: mfull[v] && mturn[v] == t -> mdead[v] = MAXT + 2
			:: else
			fi
		}
		v = 0;
#endif
		printf("  worker %d's write timed out: outcome unknown\n", who);
		goto done
	   }
	fi;
done:		atomic { k = 0; p = 0; e = 0; t = 0; at = 0; checked = false; answer[writer] = 0 }
}

proctype Worker(byte w)
{
	byte g;                  /* the generation it was last given */
	byte k, p, e, t, at, v, ng;
	bool checked;

end:	do
#ifdef EXTERNAL_LEASES
	:: atomic {              /* a generation from a lease service of the workers' own */
		issued < MAXGEN ->
		issued++; g = issued; wgen[w] = g;
		printf("worker %d is given generation %d elsewhere\n", w, g)
	}
#else
	:: atomic {              /* claim: leasing.claim and after_writes, in Store.change_lease */
		if
		:: lstate == COMPLETED -> printf("worker %d: claim refused, job-completed\n", w)
		:: lstate == HELD && now < luntil -> printf("worker %d: claim refused, lease-held\n", w)
#ifndef CLAIM_IGNORES_WRITES
		:: lstate != COMPLETED && !(lstate == HELD && now < luntil) && live_record ->
			printf("worker %d: claim refused, write-in-flight\n", w);
			/* it waits only for writes already out when a claim first asked */
			assert(!late_record);
#ifndef CLAIM_WAITS_FOR_LATER_WRITES
			/* and raises the fence past every generation that may still write: the
			   lease's (every record's is no higher, each coming from a claim) */
			ng = (lgen > fence -> lgen : fence) + 1;
			if
			:: fence > lgen -> waiting = true      /* raised by an earlier ask */
			:: fence <= lgen && ng <= MAXGEN ->
				fence = ng; waiting = true;
				printf("  the fence is raised to %d meanwhile\n", fence)
			:: else                               /* no generation left in the bounds */
			fi;
			ng = 0
#else
			waiting = true
#endif
#endif
		:: else ->
			ng = (lgen > fence -> lgen : fence) + 1;
			if
			:: ng <= MAXGEN ->
				assert(ng > issued);     /* generations never repeat */
				issued = ng;
				lgen = ng; lstate = HELD; luntil = now + TTL;
#ifndef CLAIM_NO_RAISE
				fence = ng;
#endif
				claimed = ng;
				waiting = false;
				printf("worker %d claims generation %d, until %d\n", w, ng, luntil);
				exclusive(w);
				g = ng; wgen[w] = g; bgen[w] = g; buntil[w] = luntil
			:: else
			fi;
			ng = 0
		fi;
		v = 0
	}
#endif
	:: g > 0 -> atomic {     /* renew: leasing.renew */
		if
#ifdef RENEW_NO_GEN_CHECK
		:: lstate == HELD && now < luntil ->
#else
		:: lease_live(g) ->
#endif
			luntil = now + TTL;
			printf("worker %d renews generation %d, until %d\n", w, g, luntil);
			exclusive(w);
			bgen[w] = g; buntil[w] = luntil
		:: else ->
			printf("worker %d: renewal of generation %d refused; the lease is lost\n", w, g);
			bgen[w] = 0; buntil[w] = 0
		fi;
		v = 0
	}
	:: g > 0 -> atomic {     /* complete or release: leasing.complete, leasing.release */
		if
		:: lease_live(g) ->
			if
			:: lstate = COMPLETED; printf("worker %d completes the job\n", w)
			:: lstate = RELEASED; printf("worker %d releases the job\n", w)
			fi;
			luntil = 0
		:: else
		fi;
		bgen[w] = 0; buntil[w] = 0
	}
	:: g > 0 -> write_through(w, w, g)
	od
}

#ifdef ORDER_GENERATION
/* Worker w's second writer: its writes go alongside the worker's own, with the
   generation the worker was last given. */
proctype Writer(byte w)
{
	byte g, k, p, e, t, at, v;
	bool checked;

end:	do
	:: wgen[w] > 0 -> g = wgen[w]; write_through(w, w + WORKERS, g); g = 0
	od
}
#endif

init
{
	byte i;
	atomic {
		for (i : 0 .. KEYS - 1) {
			kstate[i] = KNONE
		}
		for (i : 0 .. WORKERS - 1) {
			run Worker(i)
		}
#ifdef ORDER_GENERATION
		for (i : 0 .. WORKERS - 1) {
			run Writer(i)
		}
#endif
	}
}
