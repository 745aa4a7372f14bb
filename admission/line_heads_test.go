package admission

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// scriptCalls counts a client's script calls that went through and that
// count says to: on the ledger's client, its writes (wake_add.lua and
// wake_drop.lua; the looks are wake_pop.lua's); on the limiter's, all.
// With cut set, the next such call fails instead, unsent (its process
// killed before it).
type scriptCalls struct {
	count func(script string) bool
	n     atomic.Int64
	cut   atomic.Bool
}

func (h *scriptCalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if s, _ := cmd.Args()[min(1, len(cmd.Args())-1)].(string); h.count(s) && h.cut.CompareAndSwap(true, false) {
			err := errors.New("killed")
			cmd.SetErr(err)
			return err
		}
		err := next(ctx, cmd)
		if name := cmd.Name(); err == nil && (name == "evalsha" || name == "eval") {
			if s, _ := cmd.Args()[1].(string); h.count(s) {
				h.n.Add(1)
			}
		}
		return err
	}
}

func (h *scriptCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// ledgerWrite says whether script (its SHA or source) writes the ledger.
func ledgerWrite(script string) bool {
	switch script {
	case wakeAddScript.Hash(), wakeDropScript.Hash(), wakeAddSrc, wakeDropSrc:
		return true
	}
	return false
}

// lineJobs is a queue of jobs over one gate and its Parking, in virtual
// time: a parked job comes back when Parking.Run wakes it, or at its
// Decision.At (the queue's own schedule) if nothing does.
type lineJobs struct {
	t *testing.T
	g *Gate

	mu     sync.Mutex
	wakes  map[string]int           // wake-ups taken, by job ID
	lose   map[string]int           // wake-ups of a job a killed process takes and never acts on
	cut    map[string]func()        // run when a job is woken: its call's wake-up writes are lost
	starts map[string][]time.Time   // when each job ran
	bell   map[string]chan struct{} // a parked job's wake-up
}

func newLineJobs(t *testing.T, g *Gate, ids []string) *lineJobs {
	j := &lineJobs{t: t, g: g, wakes: map[string]int{}, lose: map[string]int{}, starts: map[string][]time.Time{}, bell: map[string]chan struct{}{}}
	for _, id := range ids {
		j.bell[id] = make(chan struct{}, 1)
	}
	return j
}

// wake is the queue's wake function (Parking.Run's).
func (j *lineJobs) wake(_ context.Context, e JobEntry) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.wakes[e.ID]++
	if cut := j.cut[e.ID]; cut != nil {
		cut()
	}
	if j.lose[e.ID] > 0 {
		j.lose[e.ID]--
		return nil
	}
	select {
	case j.bell[e.ID] <- struct{}{}:
	default:
	}
	return nil
}

// admit admits job id once, and reports the decision.
func (j *lineJobs) admit(ctx context.Context, id string) (Decision, bool) {
	d, err := j.g.Admit(ctx, Request{Subject: "tenant", Caller: throttle.Caller{ID: id, Waiter: JobEntry{Queue: "q", ID: id}.Member()}})
	if err != nil {
		j.t.Errorf("job %s: %v", id, err)
		return d, false
	}
	if d.Outcome == Run {
		j.mu.Lock()
		j.starts[id] = append(j.starts[id], time.Now())
		j.mu.Unlock()
	}
	return d, true
}

// until brings parked job id (decision d) back until it runs.
func (j *lineJobs) until(ctx context.Context, id string, d Decision) {
	for d.Outcome == Park {
		timer := time.NewTimer(time.Until(d.At))
		select {
		case <-j.bell[id]:
		case <-timer.C:
		}
		timer.Stop()
		var ok bool
		if d, ok = j.admit(ctx, id); !ok {
			return
		}
	}
}

// runLine admits jobs 1..5 of one tenant together under a rule of one job
// per 2 s and the default horizon (1 s): job 1 runs, the others wait in the
// tenant's line. It returns the jobs once all ran, the limiter's calls (the
// jobs' and the servings') and the ledger's writes.
func runLine(t *testing.T, lose map[string]int, cut string) (j *lineJobs, calls, writes int64) {
	ids := []string{"1", "2", "3", "4", "5"}
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		lrdb := redistest.PipeClient(m) // the ledger's client, counted
		defer lrdb.Close()
		w, c := &scriptCalls{count: ledgerWrite}, &scriptCalls{count: func(string) bool { return true }}
		lrdb.AddHook(w)
		rdb.AddHook(c) // the limiter's: the jobs' admits, and the servings
		p := newParking(t, lrdb, ParkingOptions{})
		rule := throttle.Rule{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: 2 * time.Second, Burst: 1}}
		g := newGate(t, rdb, Options{Parking: p, Name: "lined"}, rule)
		p.Serve(map[string]*Gate{"lined": g})
		j = newLineJobs(t, g, ids)
		j.lose = lose
		j.cut = map[string]func(){cut: func() { w.cut.Store(true) }}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = p.Run(ctx, RunOptions{}, j.wake)
		}()
		var wg sync.WaitGroup
		for _, id := range ids {
			d, ok := j.admit(ctx, id)
			if !ok {
				break
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				j.until(ctx, id, d)
			}()
		}
		wg.Wait()
		cancel()
		<-done
		calls, writes = c.n.Load(), w.n.Load()
	})
	return j, calls, writes
}

// TestLineHeadsServe: the members of a line serve it (a member back for
// its turn books it and the line's next head's wake-up in its one call),
// so a parked job in a line of several costs two limiter calls (the Admit
// that puts it in line, the one that takes its turn) and one ledger write
// (its wake-up), not a serving's call and writes of its own (3 calls and
// about 3 writes each before: the serving's guard, the booked job's
// wake-up, the next serving, the guard's removal). Each job is woken once
// and runs once, on time, the limit held.
func TestLineHeadsServe(t *testing.T) {
	j, calls, writes := runLine(t, nil, "")
	const parked = 4
	t.Logf("%d parked jobs: %d limiter calls, %d ledger writes", parked, calls-1, writes)
	if got := calls - 1; got > 2*parked {
		t.Errorf("limiter calls for %d parked jobs: %d (%.2f each); want at most 2 each", parked, got, float64(got)/parked)
	}
	if writes > parked {
		t.Errorf("ledger writes for %d parked jobs: %d (%.2f each); want at most 1 each", parked, writes, float64(writes)/parked)
	}
	start := j.starts["1"][0]
	for i, id := range []string{"1", "2", "3", "4", "5"} {
		if n := len(j.starts[id]); n != 1 {
			t.Fatalf("job %s ran %d times; want once", id, n)
		}
		if got, want := j.starts[id][0].Sub(start), time.Duration(i)*2*time.Second; got != want {
			t.Errorf("job %s ran at %v; want its turn, %v", id, got, want)
		}
		if w := j.wakes[id]; id != "1" && w != 1 {
			t.Errorf("job %s woken %d times; want once", id, w)
		}
	}
}

// TestLineHeadKilled: the process that takes the wake-up of a line's head
// dies before it wakes the job (its wake-up is lost to the ledger): the
// job comes back at its fallback (Decision.At, the queue's own schedule)
// and serves the line from there; no job is lost or run twice, the limit
// holds, and the jobs after it are woken as before.
func TestLineHeadKilled(t *testing.T) {
	j, _, _ := runLine(t, map[string]int{"3": 1}, "")
	ranOnceApart(t, j)
	if j.wakes["3"] != 1 || j.wakes["4"] != 1 || j.wakes["5"] != 1 {
		t.Errorf("wake-ups taken %v; want one each of jobs 3 (lost), 4 and 5", j.wakes)
	}
}

// TestLineHeadKilledBeforeWrites: the process of a line's head dies after
// its call served the line and ran it, before it recorded the next head's
// wake-up (job 2's call names job 3; the write is lost): job 3 comes back
// at its fallback and serves the line from there; every job runs once, the
// limit held, and job 3 was never woken.
func TestLineHeadKilledBeforeWrites(t *testing.T) {
	j, _, _ := runLine(t, nil, "2")
	ranOnceApart(t, j)
	if j.wakes["3"] != 0 || j.wakes["4"] != 1 || j.wakes["5"] != 1 {
		t.Errorf("wake-ups taken %v; want none of job 3 (its write lost), one each of 4 and 5", j.wakes)
	}
}

// ranOnceApart checks that jobs 1 to 5 ran once each, at least the rule's
// 2 s apart, and job 3 after its turn (4 s after job 1) by its fallback.
func ranOnceApart(t *testing.T, j *lineJobs) {
	t.Helper()
	var starts []time.Time
	for _, id := range []string{"1", "2", "3", "4", "5"} {
		if n := len(j.starts[id]); n != 1 {
			t.Fatalf("job %s ran %d times; want once", id, n)
		}
		starts = append(starts, j.starts[id][0])
	}
	slices.SortFunc(starts, time.Time.Compare)
	for i := 1; i < len(starts); i++ {
		if gap := starts[i].Sub(starts[i-1]); gap < 2*time.Second {
			t.Errorf("two jobs ran %v apart; the rule allows one per 2s", gap)
		}
	}
	if got := j.starts["3"][0].Sub(j.starts["1"][0]); got <= 4*time.Second || got > 10*time.Second {
		t.Errorf("job 3, whose wake-up was lost, ran at %v; want after its turn (4s), by its fallback", got)
	}
}
