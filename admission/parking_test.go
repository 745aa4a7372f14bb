package admission

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

func newParking(t *testing.T, rdb redis.UniversalClient, opts ParkingOptions) *Parking {
	t.Helper()
	w, err := NewWakeups(rdb, WakeupsKey)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewParking(w, opts)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// runParking runs p until the test's bubble ends it, waking no job.
func runParking(t *testing.T, p *Parking) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = p.Run(ctx, RunOptions{}, func(context.Context, JobEntry) error { return nil })
	}()
	return func() { cancel(); <-done }
}

func TestParseEntry(t *testing.T) {
	for _, e := range []Entry{
		JobEntry{Queue: "default", ID: "id"},
		JobEntry{Queue: "q:1", ID: "a:b:c"},
		LineEntry{Rule: "api", Subject: "acct"},
		LineEntry{Rule: "", Subject: ""},
		LineEntry{Rule: "api", Subject: "acct", Passed: 7},
	} {
		got, err := ParseEntry(e.Member())
		if err != nil || got != e {
			t.Errorf("ParseEntry(%q) = %#v, %v; want %#v", e.Member(), got, err, e)
		}
	}
	// The members producers and workers wrote before the types: one ledger.
	if got := (JobEntry{Queue: "q", ID: "id"}).Member(); got != Member("q", "id") {
		t.Errorf("JobEntry member %q, want %q", got, Member("q", "id"))
	}
	if got := (LineEntry{Rule: "r", Subject: "s", Passed: 2}).Member(); got != Member("", "r", "s", "2") {
		t.Errorf("LineEntry member %q, want %q", got, Member("", "r", "s", "2"))
	}
	for _, bad := range []string{"x", Member("", "id"), Member("q", "id", "x"), Member("", "r", "s", "-1"), Member("", "r", "s", "n")} {
		if e, err := ParseEntry(bad); err == nil {
			t.Errorf("ParseEntry(%q) = %#v, want an error", bad, e)
		}
	}
}

// TestParkingPassesOtherLines puts in the ledger the servings of a rule
// this process does not have: a fresh one goes back to the ledger, counted
// (another fleet on the same Redis may have the rule), and one passed on
// maxPassed times is dropped, so that a rule no fleet has any more does
// not go round for ever.
func TestParkingPassesOtherLines(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		p := newParking(t, rdb, ParkingOptions{})
		p.Serve(map[string]*Gate{"api": newGate(t, rdb, Options{}, gcra5)})
		ctx := context.Background()
		now := time.Now()
		fresh, last := LineEntry{Rule: "ghost", Subject: "s"}.Member(), LineEntry{Rule: "ghost", Subject: "t", Passed: maxPassed}.Member()
		for _, m := range []string{fresh, last} {
			if err := rdb.ZAdd(ctx, WakeupsKey, redis.Z{Score: float64(now.UnixMicro()), Member: m}).Err(); err != nil {
				t.Fatal(err)
			}
		}
		stop := runParking(t, p)
		time.Sleep(100 * ms) // taken, the fresh one back with a count
		stop()
		left, err := rdb.ZRange(ctx, WakeupsKey, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		want := LineEntry{Rule: "ghost", Subject: "s", Passed: 1}.Member()
		if len(left) != 1 || left[0] != want {
			t.Errorf("ledger after the ghost servings: %q; want only s's, passed on once (%q), and t's, passed on %d times, dropped", left, want, maxPassed)
		}
	})
}

// A line whose gate the process holding its shard has not (another fleet
// with other rules on the same Redis) goes to a process that has it: the
// holder puts it back and releases the shard, and the other takes both.
// Without the release, the holder would take it back every time and drop
// it after maxPassed tries.
func TestParkingPassesToAnotherFleet(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		served := make(chan string, 10)
		other := newParking(t, redistest.PipeClient(m), ParkingOptions{})
		other.Serve(map[string]*Gate{"other": nil})
		stopOther := runParking(t, other)
		defer stopOther()
		time.Sleep(100 * ms) // other holds the ledger's watch
		a := redistest.PipeClient(m)
		p := newParking(t, a, ParkingOptions{OnServe: func(name, subject string, _ Served) { served <- name + "/" + subject }})
		p.Serve(map[string]*Gate{"api": newGate(t, a, Options{Name: "api"}, gcra5)})
		stop := runParking(t, p)
		defer stop()
		time.Sleep(100 * ms) // p is a standby
		start := time.Now()
		if err := p.Ledger().Add(context.Background(), LineEntry{Rule: "api", Subject: "s"}.Member(), start); err != nil {
			t.Fatal(err)
		}
		select {
		case got := <-served:
			if got != "api/s" {
				t.Errorf("served %s, want api/s", got)
			}
			t.Logf("served by the process with the gate %v after it was added", time.Since(start))
		case <-time.After(10 * time.Second):
			t.Fatal("the line was not served within 10 s by the process that has its gate")
		}
	})
}

// TestParkingRetired: a rule Serve no longer has is retired: its servings
// are dropped at once, not passed on; one given again is served again.
func TestParkingRetired(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		p := newParking(t, rdb, ParkingOptions{})
		g := newGate(t, rdb, Options{}, gcra5)
		p.Serve(map[string]*Gate{"old": g})
		p.Serve(map[string]*Gate{"new": g})
		if _, known, retired := p.gate("old"); known || !retired {
			t.Errorf("old: known %v, retired %v; want retired", known, retired)
		}
		if err := p.line(context.Background(), LineEntry{Rule: "old", Subject: "s"}); err != nil {
			t.Fatal(err)
		}
		if n, _ := p.Ledger().Len(context.Background()); n != 0 {
			t.Errorf("%d entries after a retired rule's serving; want it dropped", n)
		}
		p.Serve(map[string]*Gate{"old": g})
		if _, known, retired := p.gate("old"); !known || retired {
			t.Errorf("old given again: known %v, retired %v; want known", known, retired)
		}
	})
}

// TestParkingJoin: two parkings joined over one job's context (stacked
// middlewares) pass each other the servings of their lines at once: a
// serving of b's line that a takes is served by b's gate, never put back
// for another process.
func TestParkingJoin(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		var mu sync.Mutex
		served := map[string]int{}
		waiting := map[string]int{}
		onServe := func(name, subject string, s Served) {
			mu.Lock()
			defer mu.Unlock()
			served[name] += len(s.Handed)
			waiting[name+"/"+subject] = s.Waiting
		}
		a, b := newParking(t, rdb, ParkingOptions{OnServe: onServe}), newParking(t, rdb, ParkingOptions{OnServe: onServe})
		two := throttle.Rule{Name: "two", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(2).WithBurst(1)}
		gb, err := New(newGate(t, rdb, Options{}, two).Limiter(), Options{Parking: b, Name: "b", Settings: Settings{MaxWait: ms, Horizon: 700 * ms}})
		if err != nil {
			t.Fatal(err)
		}
		a.Serve(map[string]*Gate{})
		b.Serve(map[string]*Gate{"b": gb})
		ctx := b.Join(a.Join(context.Background()))
		if got := b.Join(ctx); got != ctx {
			t.Error("joining a context that carries the parking already made a new one")
		}
		// Three jobs of b: one runs, one parks on a turn, one waits in line.
		var ds []Decision
		for _, id := range []string{"1", "2", "3"} {
			d, err := gb.Admit(ctx, Request{Subject: "s", Caller: throttle.Caller{ID: id, Waiter: JobEntry{Queue: "q", ID: id}.Member()}})
			if err != nil {
				t.Fatal(err)
			}
			ds = append(ds, d)
		}
		if ds[1].Outcome != Park || !ds[1].Woken || ds[2].Outcome != Park || !ds[2].InLine || !ds[2].Woken {
			t.Fatalf("decisions %+v; want run, park woken, park in line", ds)
		}
		slot, err := rdb.ZScore(ctx, WakeupsKey, JobEntry{Queue: "q", ID: "2"}.Member()).Result()
		if err != nil || int64(slot) != ds[1].Slot.UnixMicro() {
			t.Errorf("job 2's wake-up at %v (%v); want its slot %v", slot, err, ds[1].Slot.UnixMicro())
		}
		// Job 3, the line's head, serves it when it comes back
		// (throttle.AdmitRequest.HeadServes); its serving by a process, as
		// a head that never came back has asked for, is what passes here.
		if err := b.ledger.Add(ctx, LineEntry{Rule: "b", Subject: "s"}.Member(), time.Now()); err != nil {
			t.Fatal(err)
		}
		b.running.Store(true) // b's Run would run in its own process; only a looks here
		stop := runParking(t, a)
		time.Sleep(2 * time.Second)
		stop()
		mu.Lock()
		defer mu.Unlock()
		if served["b"] != 1 {
			t.Errorf("turns handed by the servings of b's line: %d; want job 3's", served["b"])
		}
		if w, ok := waiting["b/s"]; !ok || w != 0 {
			t.Errorf("jobs waiting in b's line of s after its last serving: %d (reported %v); want 0", w, ok)
		}
		left, _ := rdb.ZRange(ctx, WakeupsKey, 0, -1).Result()
		for _, m := range left {
			if e, _ := ParseEntry(m); e == (LineEntry{Rule: "b", Subject: "s", Passed: 1}) {
				t.Errorf("b's serving put back for another process: %q", left)
			}
		}
	})
}

// TestGateParksIntoLedger: a gate with a Parking records a parked job's
// wake-up at its slot (Decision.Woken); one whose ledger fails still parks,
// saying why (Decision.ParkErr), not woken.
func TestGateParksIntoLedger(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		p := newParking(t, rdb, ParkingOptions{})
		lim, err := throttle.New(rdb, throttle.Options{}, gcra5)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := New(lim, Options{Parking: p}); err == nil {
			t.Error("a gate with a parking and no name: no error")
		}
		g, err := New(lim, Options{Parking: p, Name: "api", Settings: Settings{Horizon: -1, WaitSlots: 1, MaxWait: ms}})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		job := func(id string) Request {
			return Request{Subject: "s", Caller: throttle.Caller{ID: id, Waiter: JobEntry{Queue: "q", ID: id}.Member()}}
		}
		if d, err := g.Admit(ctx, job("1")); err != nil || d.Outcome != Run {
			t.Fatalf("first job: %+v, %v; want run", d, err)
		}
		d, err := g.Admit(ctx, job("2"))
		if err != nil || d.Outcome != Park || !d.Woken || d.ParkErr != nil {
			t.Fatalf("second job: %+v, %v; want parked, woken", d, err)
		}
		if at, err := rdb.ZScore(ctx, WakeupsKey, JobEntry{Queue: "q", ID: "2"}.Member()).Result(); err != nil || int64(at) != d.Slot.UnixMicro() {
			t.Errorf("wake-up at %v (%v), want the slot %v", at, err, d.Slot.UnixMicro())
		}
		// The ledger's key of another type: the write fails, the park stands.
		m.Del(WakeupsKey)
		m.Set(WakeupsKey, "not a sorted set")
		d, err = g.Admit(ctx, job("3"))
		if err != nil || d.Outcome != Park || d.Woken || d.ParkErr == nil {
			t.Errorf("third job with the ledger broken: %+v, %v; want parked, not woken, with ParkErr", d, err)
		}
	})
}

// TestParkingEmptyLineForgotten: once a serving finds its line empty, the
// line leaves the ledger, so an idle fleet serves it no more (its guard
// used to bring it back every serveGuard, for ever); a job that joins the
// line afterwards still has it served.
func TestParkingEmptyLineForgotten(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		var mu sync.Mutex
		servings := 0
		p := newParking(t, rdb, ParkingOptions{OnServe: func(string, string, Served) { mu.Lock(); servings++; mu.Unlock() }})
		two := throttle.Rule{Name: "two", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(2).WithBurst(1)}
		g, err := New(newGate(t, rdb, Options{}, two).Limiter(), Options{Parking: p, Name: "b", Settings: Settings{MaxWait: ms, Horizon: 700 * ms}})
		if err != nil {
			t.Fatal(err)
		}
		p.Serve(map[string]*Gate{"b": g})
		ctx := p.Join(context.Background())
		admit := func(ids ...string) {
			for _, id := range ids {
				if _, err := g.Admit(ctx, Request{Subject: "s", Caller: throttle.Caller{ID: id, Waiter: JobEntry{Queue: "q", ID: id}.Member()}}); err != nil {
					t.Fatal(err)
				}
			}
		}
		line := LineEntry{Rule: "b", Subject: "s"}.Member()
		admit("1", "2", "3") // runs, parks on a turn, waits in line
		// Job 3, the line's head, would serve it when it comes back
		// (throttle.AdmitRequest.HeadServes); a serving as one that never
		// came back has asked for is what is forgotten here.
		if err := p.ledger.Add(ctx, line, time.Now()); err != nil {
			t.Fatal(err)
		}
		stop := runParking(t, p)
		defer stop()
		time.Sleep(3 * time.Second) // the line served and empty
		mu.Lock()
		first := servings
		mu.Unlock()
		if first == 0 {
			t.Fatal("the line was never served")
		}
		time.Sleep(30 * time.Second) // six guards' worth
		mu.Lock()
		idle := servings - first
		mu.Unlock()
		if idle != 0 {
			t.Errorf("%d servings of an empty line in 30s; want none", idle)
		}
		if at, ok, err := p.ledger.When(ctx, line); err != nil || ok {
			t.Errorf("the empty line is still in the ledger, due %v (%v)", at, err)
		}
		// The line comes back with the next job that joins it: its head,
		// job 6, is woken for its turn, and its return serves it.
		admit("4", "5", "6")
		if at, ok, err := p.ledger.When(ctx, JobEntry{Queue: "q", ID: "6"}.Member()); err != nil || !ok {
			t.Errorf("the head of a line joined again is not in the ledger (%v, %v)", at, err)
		}
	})
}

// A process killed while it holds a Concurrency rule's place and the
// watch of the ledger shard where that rule's sweep waits does not stall
// the sweep: the other process, a standby of that shard told of the sweep
// when it was booked, takes the shard over when the sweep is overdue by the
// grace, sweeps, and hands the dead process's place, whose lease has
// expired, to the job waiting for it. Two processes, one place, a lease of
// 2 s: the holder takes the place at 1.5 s and is killed at 2.1 s, before
// it renews the lease; the other's job parks for the place at 2 s, its
// sweep due when the lease expires, at 3.5 s. The place is handed on a
// grace (500 ms) after the sweep was due; 1.5 s after it on the reverted
// fleet2, where only the holder's watch lapsing let the standby take over.
// On virtual time, so the instants are exact.
func TestParkingSweepHolderKilled(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		rule := throttle.Rule{Name: "running", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 1, Period: 2 * time.Second}}
		var mu sync.Mutex
		handed := map[string]time.Time{}
		onHandoff := func(waiters []string) {
			mu.Lock()
			defer mu.Unlock()
			for _, w := range waiters {
				handed[w] = time.Now()
			}
		}
		var closers []*throttle.Limiter
		defer func() {
			for _, l := range closers {
				_ = l.Close()
			}
			time.Sleep(time.Minute) // the killed client's dials give up
		}()
		process := func(c redis.UniversalClient) *Gate {
			g := sweepProcess(t, c, rule, onHandoff)
			closers = append(closers, g.Limiter())
			return g
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var wg sync.WaitGroup
		defer wg.Wait()
		defer cancel()
		run := func(ctx context.Context, g *Gate) {
			wg.Go(func() {
				_ = g.opts.Parking.Run(ctx, RunOptions{}, func(context.Context, JobEntry) error { return nil })
			})
		}
		t0 := time.Now()
		holderRdb, kill := killableClient(m)
		defer holderRdb.Close()
		holder := process(holderRdb)
		holderCtx, stopHolder := context.WithCancel(ctx)
		defer stopHolder()
		run(holderCtx, holder) // first: it takes every shard's watch
		time.Sleep(time.Second)
		otherRdb := redistest.PipeClient(m)
		defer otherRdb.Close()
		other := process(otherRdb)
		run(ctx, other)

		time.Sleep(time.Until(t0.Add(1500 * ms)))
		d, err := holder.Admit(ctx, Request{Subject: "all", Caller: throttle.Caller{ID: JobEntry{Queue: "q", ID: "a"}.Member()}})
		if err != nil || d.Outcome != Run {
			t.Fatalf("holder's job: %+v, %v; want it to run", d, err)
		}
		time.Sleep(time.Until(t0.Add(2 * time.Second)))
		waiter := JobEntry{Queue: "q", ID: "b"}.Member()
		d, err = other.Admit(ctx, Request{Subject: "all", Caller: throttle.Caller{ID: waiter}})
		if err != nil || d.Outcome != Park || !d.Woken {
			t.Fatalf("other's job: %+v, %v; want it parked for the place, to be woken", d, err)
		}
		// Before the holder's first renewal of its lease (a third of it in).
		time.Sleep(time.Until(t0.Add(2100 * ms)))
		kill()
		stopHolder()
		time.Sleep(time.Until(t0.Add(15 * time.Second)))
		cancel()
		wg.Wait()

		mu.Lock()
		defer mu.Unlock()
		at, ok := handed[waiter]
		if !ok {
			t.Fatalf("the place was never handed to the waiting job (handed: %v)", handed)
		}
		due := t0.Add(3500 * ms) // the sweep: when the holder's lease expires
		opts := RunOptions{}.withDefaults()
		grace := newRunSchedule(1, opts, true, t0).grace()
		if late, most := at.Sub(due), grace+opts.Tick; late > most {
			t.Errorf("place handed %v after the sweep was due, want at most %v (the grace and a Tick)", late, most)
		}
		t.Logf("holder killed 1.4 s before the sweep was due: the place handed %v after it was due", at.Sub(due))
	})
}

// sweepProcess returns the gate of a process on c with a Parking of its
// own over the default ledger, serving the gate, under rule, its limiter's
// handed places reported to onHandoff. The caller closes its limiter.
func sweepProcess(t *testing.T, c redis.UniversalClient, rule throttle.Rule, onHandoff func([]string)) *Gate {
	t.Helper()
	lim, err := throttle.New(c, throttle.Options{OnHandoff: onHandoff}, rule)
	if err != nil {
		t.Fatal(err)
	}
	p := newParking(t, c, ParkingOptions{})
	g, err := New(lim, Options{Parking: p, Name: rule.Name})
	if err != nil {
		t.Fatal(err)
	}
	p.Serve(map[string]*Gate{rule.Name: g})
	return g
}
