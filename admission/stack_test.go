package admission

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// stackBed is a queue of jobs under a Stack on virtual time: workers take
// jobs from the pending queue and admit them; a parked job comes back
// when the parking's wake-up loop wakes it, or at its fallback time, as a
// queue's retry would bring it.
type stackBed struct {
	t         *testing.T
	stack     *Stack
	others    []*Stack                 // more stacks over the same limits (as in other processes): the workers share them out
	subsOf    func(id string) []string // a job's subject under each gate
	calls     *redistest.ScriptCalls
	pend      chan string
	mu        sync.Mutex
	parked    map[string]int // job -> its park's number, while parked
	parks     int
	starts    [][]time.Time          // per gate, its turns' slots (Redis clock)
	bySub     map[string][]time.Time // per gate and subject ("gate/subject"), its turns' slots
	ran       map[string]int
	ranAll    chan struct{}
	n         int
	first     int           // the number of run's first job
	after     func()        // if set, called after each admission
	late      time.Duration // if set, how long past want run waits for every job (else want/10 + 10s)
	workers   int           // if set, how many workers run shares out among the stacks (else 8)
	kill      time.Duration // if set, when the last stack's workers stop, as if its process were killed
	requeued  atomic.Int32  // jobs whose admission the kill ended, given to another worker
	lastParks atomic.Int32  // jobs the last stack (the one kill stops) parked
}

// newStackBed builds gates of rules on rdb, recording their parked jobs'
// wake-ups in a parking over ledger (another client, so that only the
// limiters' calls are counted), stacked in the order given.
func newStackBed(t *testing.T, rdb, ledger *redis.Client, n int, subsOf func(id string) []string, rules ...throttle.Rule) (*stackBed, *Parking) {
	b := &stackBed{t: t, subsOf: subsOf, calls: redistest.CountScripts(rdb), pend: make(chan string, n), parked: map[string]int{},
		starts: make([][]time.Time, len(rules)), bySub: map[string][]time.Time{}, ran: map[string]int{}, ranAll: make(chan struct{}), n: n}
	p := newParking(t, ledger, ParkingOptions{})
	gates, byName := make([]*Gate, len(rules)), map[string]*Gate{}
	for i, r := range rules {
		gates[i] = newGate(t, rdb, Options{Parking: p, Name: r.Name}, r)
		byName[r.Name] = gates[i]
	}
	p.Serve(byName)
	var err error
	if b.stack, err = NewStack(gates...); err != nil {
		t.Fatal(err)
	}
	return b, p
}

// addStacks adds k more stacks over gates of the same rules on rdb, as
// other processes would have, parking in p (whose wake-ups any worker
// serves).
func (b *stackBed) addStacks(rdb *redis.Client, p *Parking, k int, rules ...throttle.Rule) {
	for range k {
		gates := make([]*Gate, len(rules))
		for i, r := range rules {
			gates[i] = newGate(b.t, rdb, Options{Parking: p, Name: r.Name}, r)
		}
		s, err := NewStack(gates...)
		if err != nil {
			b.t.Fatal(err)
		}
		b.others = append(b.others, s)
	}
}

// wake moves a parked job back to the pending queue, once per park.
func (b *stackBed) wake(id string, park int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if got, ok := b.parked[id]; ok && got == park {
		delete(b.parked, id)
		b.pend <- id
	}
}

// work admits jobs from the pending queue on s until ctx ends.
func (b *stackBed) work(ctx context.Context, s *Stack) {
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-b.pend:
			b.admit(ctx, s, id)
		}
	}
}

func (b *stackBed) admit(ctx context.Context, s *Stack, id string) {
	member := JobEntry{Queue: "q", ID: id}.Member()
	subs := b.subsOf(id)
	reqs := make([]Request, len(subs))
	for i, s := range subs {
		// (BookAs as the worker sets it: a task books under its own ID.)
		reqs[i] = Request{Subject: s, Caller: throttle.Caller{ID: id, BookAs: id, Waiter: member}}
	}
	d, err := s.Admit(ctx, reqs)
	if b.after != nil {
		b.after()
	}
	if err != nil {
		if ctx.Err() == nil {
			b.t.Errorf("job %s: %v", id, err)
		} else if b.kill > 0 {
			b.requeued.Add(1)
			b.pend <- id // the queue gives a dead worker's task to another (asynq: after its lease)
		}
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if d.Outcome == Park {
		if len(b.others) > 0 && s == b.others[len(b.others)-1] {
			b.lastParks.Add(1)
		}
		b.parks++
		park := b.parks
		b.parked[id] = park
		time.AfterFunc(time.Until(d.At), func() { b.wake(id, park) }) // the queue's own retry
		return
	}
	for i, turn := range d.Turns {
		b.starts[i] = append(b.starts[i], turn.Slot)
		k := fmt.Sprintf("%d/%s", i, subs[i])
		b.bySub[k] = append(b.bySub[k], turn.Slot)
	}
	if b.ran[id]++; len(b.ran) == b.n && b.ran[id] == 1 {
		close(b.ranAll)
	}
}

// TestStackBacklog: a backlog of 300, then 3,000 jobs under a per-key
// limit of 7/s inside a per-tenant limit of 10/s (two gates over two
// subjects, as in two hash slots), 8 workers. Every job runs once; each
// limit holds in every 1 s window on the Redis clock (limit + burst); the
// jobs take the inner limit's time; and a job parks about once and costs
// about three limiter calls (its park on the inner gate, its turn there,
// the outer's turn, plus the servings of the inner line), the same for
// 3,000 as for 300: stacked jobs give no turn back.
func TestStackBacklog(t *testing.T) {
	testStackBacklog(t, 7, 10, 1.02, 3.5)
}

// TestStackSlowerOutside is TestStackBacklog with the limits the other
// way round, 10/s inside 7/s, the inner gate given first: the stack's lead
// is the slower gate, wherever it is given, and the jobs park once.
func TestStackSlowerOutside(t *testing.T) {
	testStackBacklog(t, 10, 7, 1.02, 3.5)
}

// testStackBacklog runs stackBacklog for 300 and 3,000 jobs and checks
// that the limiter calls per job do not grow with the backlog.
func testStackBacklog(t *testing.T, inner, outer int, parks, calls float64) {
	var perCall [2]float64
	for k, n := range []int{300, 3000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			perCall[k] = stackBacklog(t, n, inner, outer, parks, calls)
		})
	}
	if perCall[1] > perCall[0]*1.05+0.05 {
		t.Errorf("%.3f limiter calls per job for 3,000, %.3f for 300: the cost grows with the backlog", perCall[1], perCall[0])
	}
}

// stackBacklog runs the backlog of TestStackBacklog for n jobs, inner
// and outer per second, checking at most maxParks parks and maxCalls
// limiter calls per job, and returns the limiter calls per job.
func stackBacklog(t *testing.T, n, inner, outer int, maxParks, maxCalls float64) float64 {
	var per float64
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ledger := redistest.PipeClient(m)
		defer ledger.Close()
		b, p := newStackBed(t, rdb, ledger, n, func(string) []string { return []string{"key-1", "acme"} },
			throttle.Rule{Name: "key", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(inner).WithBurst(1)},
			throttle.Rule{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(outer).WithBurst(1)})
		slower := min(inner, outer)
		want := time.Duration(n-1) * time.Second / time.Duration(slower)
		took := b.run(p, want)
		b.mu.Lock()
		defer b.mu.Unlock()
		for i, most := range []int{inner + 1, outer + 1} {
			if got := redistest.MaxInWindow(b.starts[i], time.Second); got > most {
				t.Errorf("gate %d: %d turns in one second on the Redis clock, want at most %d", i, got, most)
			}
		}
		if took > want+2*time.Second {
			t.Errorf("the backlog took %v, want about %v (the inner limit's)", took, want)
		}
		calls := b.calls.Load()
		per = float64(calls) / float64(n)
		parks := float64(b.parks) / float64(n)
		t.Logf("%d jobs in %v (the slower limit alone: %v): %.3f parks and %.3f limiter calls per job; lead gate %d",
			n, took, want, parks, per, b.stack.Lead())
		if parks > maxParks {
			t.Errorf("%.3f parks per job, want at most %.2f", parks, maxParks)
		}
		if per > maxCalls {
			t.Errorf("%.3f limiter calls per job, want at most %.1f", per, maxCalls)
		}
		if lead := map[bool]int{true: 0, false: 1}[inner <= outer]; b.stack.Lead() != lead {
			t.Errorf("lead gate %d at the end, want %d, the tighter limit", b.stack.Lead(), lead)
		}
	})
	return per
}

// run admits the bed's n jobs, given at once, with 8 workers (workers) and the
// parking's wake-up loop, until every job ran or about want has passed;
// it checks that each ran once and returns how long they took.
func (b *stackBed) run(p *Parking, want time.Duration) time.Duration {
	t := b.t
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = p.Run(ctx, RunOptions{}, func(_ context.Context, job JobEntry) error {
			b.mu.Lock()
			park := b.parked[job.ID]
			b.mu.Unlock()
			b.wake(job.ID, park)
			return nil
		})
	})
	stacks := append([]*Stack{b.stack}, b.others...)
	killed := ctx
	if b.kill > 0 {
		var kill context.CancelFunc
		killed, kill = context.WithCancel(ctx)
		time.AfterFunc(b.kill, kill)
	}
	for w := range cmp.Or(b.workers, 8) {
		wctx := ctx
		if w%len(stacks) == len(stacks)-1 {
			wctx = killed
		}
		wg.Go(func() { b.work(wctx, stacks[w%len(stacks)]) })
	}
	start := time.Now()
	for i := range b.n {
		b.pend <- fmt.Sprintf("job-%05d", b.first+i)
	}
	select {
	case <-b.ranAll:
	case <-time.After(want + cmp.Or(b.late, want/10+10*time.Second)):
		b.mu.Lock()
		t.Errorf("after %v: %d of %d jobs ran", time.Since(start), len(b.ran), b.n)
		b.mu.Unlock()
	}
	took := time.Since(start)
	cancel()
	wg.Wait()
	b.mu.Lock()
	defer b.mu.Unlock()
	for id, runs := range b.ran {
		if runs != 1 {
			t.Errorf("job %s ran %d times", id, runs)
		}
	}
	return took
}
