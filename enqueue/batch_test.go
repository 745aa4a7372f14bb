package enqueue

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// virtual runs f in a synctest bubble with a miniredis inside it, so Redis
// TIME and every timer follow the bubble's clock.
func virtual(t *testing.T, f func(t *testing.T, rdb *redis.Client)) {
	t.Helper()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) { f(t, rdb) })
}

// fakeClient records what a batch enqueues; fail, if set, decides
// whether the i-th call (0-based) fails.
type fakeClient struct {
	mu    sync.Mutex
	tasks []enqueuedTask
	fail  func(i int) error
}

type enqueuedTask struct {
	task      *asynq.Task
	processAt time.Time // zero if not scheduled
	queue     string
}

func (c *fakeClient) EnqueueContext(_ context.Context, task *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fail != nil {
		if err := c.fail(len(c.tasks)); err != nil {
			return nil, err
		}
	}
	e := enqueuedTask{task: task}
	for _, o := range opts {
		switch o.Type() {
		case asynq.ProcessAtOpt:
			e.processAt = o.Value().(time.Time)
		case asynq.QueueOpt:
			e.queue = o.Value().(string)
		}
	}
	c.tasks = append(c.tasks, e)
	return &asynq.TaskInfo{ID: fmt.Sprint("id-", len(c.tasks)), Queue: cmp.Or(e.queue, "default")}, nil
}

var apiRule = throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(1)}

func newLimiter(t *testing.T, rdb redis.UniversalClient, rules ...throttle.Rule) *throttle.Limiter {
	t.Helper()
	l, err := throttle.New(rdb, throttle.Options{Prefix: throttle.DefaultPrefix}, rules...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// A paced batch books one slot per task, an interval apart, schedules
// each task for its slot and hands the worker a receipt it can redeem.
func TestBatchPaced(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		c := &fakeClient{}
		var seen []Enqueued
		b := Batch{
			Type: "email:send", Count: 10, Payloads: [][]byte{[]byte(`{"to":"x"}`)},
			Pacer:      &Pacer{Limiter: newLimiter(t, rdb, apiRule), Subject: rules.SubjectConfig{Fixed: "acme"}.Of},
			Options:    []asynq.Option{asynq.Queue("mail")},
			OnEnqueued: func(e Enqueued) { seen = append(seen, e) },
		}
		start := time.Now()
		res, err := b.Run(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if res.Enqueued != 10 || !res.LastDue.Equal(start.Add(450*time.Millisecond)) {
			t.Errorf("Result %+v, want 10 enqueued, last due at +450ms", res)
		}
		// The worker's limiter: same Redis, prefix and rule.
		w := newLimiter(t, rdb, apiRule)
		for i, e := range c.tasks {
			want := start.Add(time.Duration(i) * 50 * time.Millisecond)
			if !e.processAt.Equal(want) || e.queue != "mail" || string(e.task.Payload()) != `{"to":"x"}` {
				t.Errorf("task %d: ProcessAt %v, queue %q, payload %s; want +%v, mail, the payload", i, e.processAt.Sub(start), e.queue, e.task.Payload(), want.Sub(start))
			}
			if seen[i].Index != i || seen[i].Count != 10 || !seen[i].Paced || !seen[i].Due.Equal(want) || seen[i].ID == "" {
				t.Errorf("OnEnqueued %d: %+v", i, seen[i])
			}
			receipt := e.task.Headers()[admission.ReceiptHeader]
			a, err := w.Admit(ctx, throttle.AdmitRequest{Subject: "acme", N: 1, Caller: throttle.Caller{Receipt: receipt}, Wait: -1, Tolerance: time.Hour})
			d, ok := a.Delay, a.Status == throttle.Redeemed
			if err != nil || !ok || d != want.Sub(start) {
				t.Errorf("task %d: Redeem = %v, %v, %v; want %v, true", i, d, ok, err, want.Sub(start))
			}
		}
		// The batch used the ledger: the workers' next permit is after it.
		if res, _ := w.Allow(ctx, "acme"); res.Allowed || res.RetryAfter != 500*time.Millisecond {
			t.Errorf("after the batch: allowed=%v RetryAfter=%v; want denied, 500ms", res.Allowed, res.RetryAfter)
		}
	})
}

// Each task's subject comes from its payload, as the workers take it:
// subjects are paced separately.
func TestBatchSubjectPerPayload(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		c := &fakeClient{}
		b := Batch{
			Type:     "sync",
			Payloads: [][]byte{[]byte(`{"t":"a"}`), []byte(`{"t":"b"}`), []byte(`{"t":"a"}`), []byte(`{"t":"b"}`)},
			Pacer:    &Pacer{Limiter: newLimiter(t, rdb, apiRule), Subject: rules.SubjectConfig{PayloadField: "t"}.Of},
		}
		start := time.Now()
		if _, err := b.Run(context.Background(), c); err != nil {
			t.Fatal(err)
		}
		want := []time.Duration{0, 0, 50 * time.Millisecond, 50 * time.Millisecond}
		for i, e := range c.tasks {
			if got := e.processAt.Sub(start); got != want[i] {
				t.Errorf("task %d (%s) due at +%v, want +%v", i, e.task.Payload(), got, want[i])
			}
		}
	})
}

// An unpaced batch is due at once and carries no receipt.
func TestBatchUnpaced(t *testing.T) {
	c := &fakeClient{}
	b := Batch{Type: "t", Count: 3}
	res, err := b.Run(context.Background(), c)
	if err != nil || res.Enqueued != 3 {
		t.Fatalf("Run = %+v, %v", res, err)
	}
	for i, e := range c.tasks {
		us, err := strconv.ParseInt(e.task.Headers()[admission.EnqueuedHeader], 10, 64)
		if err != nil || time.Since(time.UnixMicro(us)) > time.Minute || time.Since(time.UnixMicro(us)) < 0 {
			t.Errorf("task %d: %s header %q; want the enqueue time", i, admission.EnqueuedHeader, e.task.Headers()[admission.EnqueuedHeader])
		}
		if !e.processAt.IsZero() || len(e.task.Headers()) != 1 || e.task.Payload() != nil {
			t.Errorf("task %d: ProcessAt %v, headers %v, payload %q; want none but the enqueue time", i, e.processAt, e.task.Headers(), e.task.Payload())
		}
	}
}

// A task that fails to enqueue gives its slot back; the batch stops there.
func TestBatchEnqueueFailureRefunds(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		boom := errors.New("boom")
		c := &fakeClient{fail: func(i int) error {
			if i == 2 {
				return boom
			}
			return nil
		}}
		lim := newLimiter(t, rdb, apiRule)
		b := Batch{Type: "t", Count: 5, Pacer: &Pacer{Limiter: lim, Subject: rules.SubjectConfig{Fixed: "s"}.Of}}
		res, err := b.Run(context.Background(), c)
		if !errors.Is(err, boom) || res.Enqueued != 2 {
			t.Fatalf("Run = %+v, %v; want 2 enqueued and boom", res, err)
		}
		// Slots 0 and 50ms are taken; the third, at 100ms, was refunded.
		r, err := lim.ReserveN(context.Background(), "s", 1)
		if err != nil || r.Delay() != 100*time.Millisecond {
			t.Errorf("next reservation: %v, %v; want the refunded slot at 100ms", r.Delay(), err)
		}
	})
}

func TestBatchValidate(t *testing.T) {
	lim := newLimiter(t, redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), apiRule)
	cases := []struct {
		name string
		b    Batch
	}{
		{"no type", Batch{Count: 1}},
		{"negative count", Batch{Type: "t", Count: -1}},
		{"nothing to enqueue", Batch{Type: "t"}},
		{"count above payloads", Batch{Type: "t", Count: 3, Payloads: [][]byte{nil, nil}}},
		{"pacer without limiter", Batch{Type: "t", Count: 1, Pacer: &Pacer{Subject: rules.SubjectConfig{Fixed: "s"}.Of}}},
		{"pacer without subject", Batch{Type: "t", Count: 1, Pacer: &Pacer{Limiter: lim}}},
	}
	for _, c := range cases {
		if _, err := c.b.Run(context.Background(), &fakeClient{}); err == nil {
			t.Errorf("%s: Run succeeded", c.name)
		}
	}
}

// A paced batch checks every task before it books or enqueues any: a
// payload without its subject, with a bad cost, or that the rule refuses
// whatever its state fails the whole batch, naming the payload, and
// leaves both the queue and the ledger untouched.
func TestBatchChecksEveryTaskFirst(t *testing.T) {
	good := func(n int) [][]byte {
		p := make([][]byte, n)
		for i := range p {
			p[i] = fmt.Appendf(nil, `{"t": "a", "n": 1, "i": %d}`, i)
		}
		return p
	}
	with := func(p [][]byte, i int, bad string) [][]byte { p[i] = []byte(bad); return p }
	burst5 := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(5)}
	cases := []struct {
		name     string
		payloads [][]byte
		where    func(int) string
		want     string
	}{
		{"no subject on task 2", with(good(3), 1, `{"n": 1}`), nil, `enqueue: payload 2: subject: payload has no field "t"`},
		{"no subject on line 500", with(good(600), 499, `{"n": 1}`), func(i int) string { return fmt.Sprint("p.jsonl:", i+1) }, `enqueue: p.jsonl:500: subject: payload has no field "t"`},
		{"a bad cost", with(good(3), 2, `{"t": "a", "n": "x"}`), nil, `enqueue: payload 3: cost: payload cost field "n" is a string`},
		{"a cost above the burst", with(good(3), 2, `{"t": "a", "n": 6}`), nil, `enqueue: payload 3: throttle: request exceeds the limit's capacity: rule "api": 6 permits requested, but it admits at most 5 at once`},
		{"a subject too long", with(good(3), 1, `{"t": "`+strings.Repeat("x", 1100)+`", "n": 1}`), nil, `enqueue: payload 2: throttle: invalid subject: 1100 bytes long`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			virtual(t, func(t *testing.T, rdb *redis.Client) {
				lim := newLimiter(t, rdb, burst5)
				fc := &fakeClient{}
				b := Batch{Type: "t", Payloads: c.payloads, Where: c.where,
					Pacer: &Pacer{Limiter: lim, Subject: rules.SubjectConfig{PayloadField: "t"}.Of, Cost: rules.CostConfig{PayloadField: "n"}.Of}}
				if err := b.Validate(); err == nil || !strings.HasPrefix(err.Error(), c.want) {
					t.Errorf("Validate = %v\nwant %s…", err, c.want)
				}
				res, err := b.Run(context.Background(), fc)
				var pe *PayloadError
				if !errors.As(err, &pe) || !strings.HasPrefix(err.Error(), c.want) || res.Enqueued != 0 || len(fc.tasks) != 0 {
					t.Fatalf("Run = %+v, %v (%d enqueued)\nwant nothing enqueued and %s…", res, err, len(fc.tasks), c.want)
				}
				if r, err := lim.AllowN(context.Background(), "a", 0); err != nil || r.Remaining != 5 {
					t.Errorf("the ledger after the refused batch: %+v, %v; want untouched (5 remaining)", r, err)
				}
			})
		})
	}
}

// A batch holds at most MaxCount tasks.
func TestBatchMaxCount(t *testing.T) {
	c := &fakeClient{}
	b := Batch{Type: "t", Count: MaxCount + 1}
	if _, err := b.Run(context.Background(), c); err == nil || !strings.Contains(err.Error(), "at most 10000000") || len(c.tasks) != 0 {
		t.Errorf("Run = %v, %d tasks; want a refusal naming the bound and nothing enqueued", err, len(c.tasks))
	}
}

// Plan says, before the first task, how far ahead a paced batch books its
// last slot: exactly where it lands for a gcra rule, also after earlier
// bookings of the subject, which it reads without charging.
func TestBatchPlan(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		lim := newLimiter(t, rdb, apiRule)
		b := Batch{Type: "t", Count: 5000, Pacer: &Pacer{Limiter: lim, Subject: rules.SubjectConfig{Fixed: "acme"}.Of}}
		p, err := b.Plan(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if p.Ahead != 4999*50*time.Millisecond || p.Permits != 5000 || p.Subject != "acme" || p.Rule != "api" || p.Booked != 0 {
			t.Errorf("Plan = %+v; want 5000 permits of acme under api, last at 4m9.95s", p)
		}
		if got, want := p.Describe(), "pacing 5000 tasks at 20/s (rule api): the last is booked about 4m10s ahead"; got != want {
			t.Errorf("Describe = %q, want %q", got, want)
		}
		if r, _ := lim.AllowN(ctx, "acme", 0); r.Remaining != 1 {
			t.Errorf("Plan charged the ledger: %+v", r)
		}

		// 20 booked already (1s of slots): 10 more come after them.
		for range 20 {
			if _, err := lim.ReserveN(ctx, "acme", 1); err != nil {
				t.Fatal(err)
			}
		}
		start := time.Now()
		b.Count = 10
		var seen Plan
		b.OnPlan = func(p Plan) { seen = p }
		res, err := b.Run(ctx, &fakeClient{})
		if err != nil {
			t.Fatal(err)
		}
		if seen.Booked != time.Second || seen.Ahead != res.LastDue.Sub(start) || seen.Ahead != 1450*time.Millisecond {
			t.Errorf("OnPlan got %+v; want booked 1s, ahead 1.45s, the last task's slot (+%v)", seen, res.LastDue.Sub(start))
		}
	})
}

// Over several subjects, the plan is the busiest subject's, with the
// tasks' costs.
func TestBatchPlanSubjects(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		payloads := [][]byte{[]byte(`{"t":"a","n":2}`), []byte(`{"t":"b","n":1}`), []byte(`{"t":"b","n":4}`), []byte(`{"t":"a","n":0}`)}
		b := Batch{Type: "t", Payloads: payloads, Pacer: &Pacer{Limiter: newLimiter(t, rdb, apiRule),
			Subject: rules.SubjectConfig{PayloadField: "t"}.Of, Cost: rules.CostConfig{PayloadField: "n"}.Of}}
		b.Pacer.Limiter = newLimiter(t, rdb, throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(5)})
		p, err := b.Plan(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if p.Subjects != 2 || p.Subject != "b" || p.Permits != 5 || p.Ahead != 0 {
			t.Errorf("Plan = %+v; want 2 subjects, b the busiest with 5 permits, all within the burst", p)
		}
		if got, want := p.Describe(), `pacing 4 tasks over 2 subjects at 20/s (rule api): the last of the busiest, "b" (5 permits), is booked about 0s ahead`; got != want {
			t.Errorf("Describe = %q, want %q", got, want)
		}
	})
}

// A batch that would book further ahead than MaxAhead is refused before
// its first task: nothing is booked or enqueued.
func TestBatchMaxAhead(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		lim := newLimiter(t, rdb, throttle.Rule{Name: "slow", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: time.Second, Burst: 1}})
		c := &fakeClient{}
		b := Batch{Type: "t", Count: 12, MaxAhead: 10 * time.Second, Pacer: &Pacer{Limiter: lim, Subject: rules.SubjectConfig{Fixed: "s"}.Of}}
		_, err := b.Run(context.Background(), c)
		var ae *AheadError
		if !errors.As(err, &ae) || ae.Plan.Ahead != 11*time.Second || len(c.tasks) != 0 {
			t.Fatalf("Run = %v, %d tasks; want an AheadError for 11s and nothing enqueued", err, len(c.tasks))
		}
		want := "enqueue: pacing 12 tasks at 1/s (rule slow): the last is booked about 11s ahead, more than the 10s allowed"
		if !strings.HasPrefix(err.Error(), want) {
			t.Errorf("error %q\nwant %s…", err, want)
		}
		if r, _ := lim.AllowN(context.Background(), "s", 0); r.Remaining != 1 {
			t.Errorf("the refused batch booked: %+v", r)
		}
		b.Count = 11
		if _, err := b.Run(context.Background(), c); err != nil || len(c.tasks) != 11 {
			t.Errorf("a batch booking exactly 10s ahead: %v, %d tasks; want it enqueued", err, len(c.tasks))
		}
	})
}

// RoundAhead writes durations as a person reads them.
func TestRoundAhead(t *testing.T) {
	for d, want := range map[time.Duration]string{
		1234567 * time.Microsecond:                     "1.235s",
		1234 * time.Microsecond:                        "1ms",
		4*time.Minute + 9950*time.Millisecond:          "4m10s",
		27*time.Hour + 46*time.Minute + 39*time.Second: "27h47m",
		99_999_999 * time.Second:                       "27777h47m (1157.4 days)",
	} {
		if got := RoundAhead(d); got != want {
			t.Errorf("RoundAhead(%v) = %q, want %q", d, got, want)
		}
	}
}

// With a Lead, tasks are scheduled that long before their slot; the
// receipts still name the slot.
func TestBatchLead(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		c := &fakeClient{}
		b := Batch{Type: "t", Count: 3, Pacer: &Pacer{Limiter: newLimiter(t, rdb, apiRule), Subject: rules.SubjectConfig{Fixed: "s"}.Of, Lead: 300 * time.Millisecond}}
		start := time.Now()
		res, err := b.Run(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		for i, e := range c.tasks {
			if got, want := e.processAt.Sub(start), time.Duration(i)*50*time.Millisecond-300*time.Millisecond; got != want {
				t.Errorf("task %d scheduled at %v, want %v", i, got, want)
			}
		}
		if got := res.LastDue.Sub(start); got != 100*time.Millisecond {
			t.Errorf("LastDue +%v, want the last slot, +100ms", got)
		}
		b.Pacer.Lead = -1
		if _, err := b.Run(context.Background(), c); err == nil {
			t.Error("negative Lead accepted")
		}
	})
}

// TestPacerEnqueueWakeups paces single tasks with a wake-up ledger: each is
// booked, keeps its own headers and gains the receipt, is scheduled a second
// after its slot (asynq's schedule is then only the fallback), and is
// recorded in the ledger for its slot on the Redis clock.
func TestPacerEnqueueWakeups(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		w, err := admission.NewWakeups(rdb, admission.WakeupsKey)
		if err != nil {
			t.Fatal(err)
		}
		p := &Pacer{Limiter: newLimiter(t, rdb, apiRule), Subject: rules.SubjectConfig{Fixed: "s"}.Of, Wakeups: w}
		c := &fakeClient{}
		start := time.Now()
		for i := range 3 {
			task := asynq.NewTaskWithHeaders("t", nil, map[string]string{"trace": fmt.Sprint(i)})
			info, err := p.Enqueue(ctx, c, task, asynq.Queue("low"))
			if err != nil || info.ID != fmt.Sprint("id-", i+1) {
				t.Fatalf("Enqueue %d: %v, %v", i, info, err)
			}
		}
		entries, err := rdb.ZRangeWithScores(ctx, admission.WakeupsKey, 0, -1).Result()
		if err != nil || len(entries) != 3 {
			t.Fatalf("ledger %v, %v; want 3 wake-ups", entries, err)
		}
		for i, e := range c.tasks {
			slot := time.Duration(i) * 50 * time.Millisecond
			h := e.task.Headers()
			if h["trace"] != fmt.Sprint(i) || h[admission.ReceiptHeader] == "" || e.queue != "low" {
				t.Errorf("task %d: headers %v, queue %q; want its own header, a receipt, queue low", i, h, e.queue)
			}
			if got := e.processAt.Sub(start); got != slot+time.Second {
				t.Errorf("task %d scheduled at +%v, want its slot %v + 1s", i, got, slot)
			}
			if m, at := entries[i].Member, time.UnixMicro(int64(entries[i].Score)).Sub(start); m != admission.Member("low", fmt.Sprint("id-", i+1)) || at != slot {
				t.Errorf("wake-up %d: %q at +%v; want task id-%d in queue low at +%v", i, m, at, i+1, slot)
			}
		}
	})
}

// TestPacerCost books each task's cost: 4, 2 and 0 permits under 20/s burst
// 5 put the second task 2 intervals after the burst and leave the third
// unpaced.
func TestPacerCost(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		rule := throttle.Rule{Name: "api", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(20).WithBurst(5)}
		p := &Pacer{Limiter: newLimiter(t, rdb, rule), Subject: rules.SubjectConfig{Fixed: "s"}.Of, Cost: rules.CostConfig{PayloadField: "n"}.Of}
		c := &fakeClient{}
		start := time.Now()
		for _, n := range []int{4, 2, 0} {
			if _, err := p.Enqueue(context.Background(), c, asynq.NewTask("t", fmt.Appendf(nil, `{"n": %d}`, n))); err != nil {
				t.Fatalf("cost %d: %v", n, err)
			}
		}
		if got := c.tasks[0].processAt.Sub(start); got != 0 {
			t.Errorf("4 under burst 5: scheduled +%v, want now", got)
		}
		if got := c.tasks[1].processAt.Sub(start); got != 50*time.Millisecond {
			t.Errorf("2 more: scheduled +%v, want +50ms (one interval past the burst)", got)
		}
		if e := c.tasks[2]; !e.processAt.IsZero() || e.task.Headers()[admission.ReceiptHeader] != "" {
			t.Errorf("cost 0: %+v; want unpaced, no receipt", e)
		}
		if _, err := p.Enqueue(context.Background(), c, asynq.NewTask("t", []byte(`{"n": "x"}`))); err == nil || !strings.Contains(err.Error(), "cost") {
			t.Errorf("a bad cost: %v; want an error naming the cost", err)
		}
	})
}

// A producer whose limit is not the workers' is refused before its first
// booking, naming the rule and both limits: nothing is booked or
// enqueued. With the workers' own limit the batch runs.
func TestPacerRefusesAnotherLimit(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		ctx := context.Background()
		workers := throttle.Rule{Name: "partner", Algorithm: throttle.GCRA, Limit: throttle.PerSecond(5).WithBurst(1)}
		if err := admission.PublishLimits(ctx, rdb, throttle.DefaultPrefix, []throttle.Rule{workers}); err != nil {
			t.Fatal(err)
		}
		spec := func(rate, burst int) PaceSpec {
			return PaceSpec{Rule: "partner", Limit: throttle.PerSecond(rate).WithBurst(burst), Subject: rules.SubjectConfig{Fixed: "acct"}}
		}

		fast := spec(20, 5)
		p, err := fast.Pacer(rdb, "partner:call", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		c := &fakeClient{}
		_, err = (&Batch{Type: "partner:call", Count: 10, Pacer: p}).Run(ctx, c)
		var mm *admission.LimitMismatchError
		if !errors.As(err, &mm) || mm.Workers != "gcra 5 per 1s (burst 1)" || mm.Ours != "gcra 20 per 1s (burst 5)" {
			t.Fatalf("a batch at 20/s (burst 5) beside workers at 5/s: %v; want a *admission.LimitMismatchError naming both", err)
		}
		if len(c.tasks) != 0 {
			t.Errorf("%d tasks enqueued, want none", len(c.tasks))
		}
		if n := rdb.Exists(ctx, throttle.DefaultPrefix+"{acct}:partner").Val(); n != 0 {
			t.Error("the refused batch booked a turn")
		}

		same := spec(5, 1)
		p, err = same.Pacer(rdb, "partner:call", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		res, err := (&Batch{Type: "partner:call", Count: 10, Pacer: p}).Run(ctx, c)
		if err != nil || res.Enqueued != 10 {
			t.Fatalf("a batch at the workers' limit: %+v, %v; want 10 enqueued", res, err)
		}
	})
}

// A batch paced by a PaceSpec books no slot sooner than Reach after it
// starts, even on an idle rule: the first task needs that long to reach
// a worker, and a slot sooner found it late for its receipt, charged a
// second time at the end of the batch. The rest follow an interval apart.
func TestPaceSpecFirstSlotReachable(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		spec := PaceSpec{Rule: "partner", Limit: throttle.PerSecond(20).WithBurst(1), Subject: rules.SubjectConfig{Fixed: "acct"}}
		p, err := spec.Pacer(rdb, "partner:call", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		var due []time.Duration
		_, err = (&Batch{Type: "partner:call", Count: 3, Pacer: p,
			OnEnqueued: func(e Enqueued) { due = append(due, e.Due.Sub(start)) }}).Run(context.Background(), &fakeClient{})
		if err != nil {
			t.Fatal(err)
		}
		if want := []time.Duration{Reach, Reach + 50*time.Millisecond, Reach + 100*time.Millisecond}; fmt.Sprint(due) != fmt.Sprint(want) {
			t.Errorf("slots after the start: %v, want %v", due, want)
		}
	})
}

// TestPacerCosts books each task's turn at its costs per limit, as the
// workers' rule charges them (a policy whose limits have costs of their
// own): a task's turn waits for the limit it would overdraw, and the
// workers redeem it with the same costs, charged nothing more.
func TestPacerCosts(t *testing.T) {
	cfg, err := rules.Parse("rules.yaml", []byte("rules:\n"+
		"  - name: llm\n    tasks: [\"llm:*\"]\n    subject: {fixed: provider}\n    limits:\n"+
		"      - {name: requests, algorithm: gcra, limit: 10, period: 1s}\n"+
		"      - {name: tokens, algorithm: gcra, limit: 1000, period: 1s, cost: {payload_field: tokens}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		spec := PaceSpec{Rules: cfg}
		p, err := spec.Pacer(rdb, "llm:chat", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		c := &fakeClient{}
		start := time.Now()
		for _, n := range []int{800, 300} {
			if _, err := p.Enqueue(context.Background(), c, asynq.NewTask("llm:chat", fmt.Appendf(nil, `{"tokens": %d}`, n))); err != nil {
				t.Fatalf("tokens %d: %v", n, err)
			}
		}
		// 800 now; 300 more need 100 the bucket does not have: 100ms on.
		// (Requests alone would let both go now.)
		want := []time.Duration{Reach, 100*time.Millisecond + Reach}
		for i, e := range c.tasks {
			if got := e.processAt.Sub(start); got < want[i] || got > want[i]+time.Second {
				t.Errorf("task %d scheduled +%v, want at +%v (asynq rounds to seconds)", i, got, want[i])
			}
		}
		lim, err := cfg.Limiter(rdb, "llm", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		receipt := c.tasks[0].task.Headers()[admission.ReceiptHeader]
		time.Sleep(Reach)
		a, err := lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "provider", Costs: throttle.Costs{1, 800}, Caller: throttle.Caller{ID: "x", Receipt: receipt}})
		if err != nil || a.Status != throttle.Redeemed {
			t.Fatalf("redeeming the first receipt: %+v, %v", a, err)
		}
		if _, err := p.Enqueue(context.Background(), c, asynq.NewTask("llm:chat", []byte(`{"tokens": 5000}`))); !errors.Is(err, throttle.ErrExceedsCapacity) {
			t.Errorf("5000 tokens under a burst of 1000: %v; want ErrExceedsCapacity", err)
		}
	})
}

// A rule whose shares have limits of their own (share_limit, and so a
// nested rule) is not paced: its receipts would be turns of the rule's
// limits only, and a paced batch of one share would pass the share's.
func TestPacerRefusesShareLimits(t *testing.T) {
	for name, file := range map[string]string{
		"share_limit": `rules:
  - name: crm
    tasks: ["crm:*"]
    subject: {fixed: crm-key}
    fair_by: {payload_field: tenant}
    share_limit: {limit: 5, period: 1s}
    algorithm: gcra
    limit: 20
    period: 1s
`,
		"nested": `rules:
  - name: key
    tasks: ["crm:*"]
    subject: {payload_field: api_key}
    algorithm: gcra
    limit: 5
    period: 1s
    within: tenant
    nested: true
  - name: tenant
    tasks: ["tenant:*"]
    subject: {payload_field: tenant}
    algorithm: gcra
    limit: 20
    period: 1s
`,
	} {
		cfg, err := rules.Parse("rules.yaml", []byte(file))
		if err != nil {
			t.Fatal(err)
		}
		spec := PaceSpec{Rules: cfg}
		_, err = spec.Pacer(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), "crm:sync", throttle.Options{})
		if err == nil || !strings.Contains(err.Error(), "a limit of its own in the workers' line") || !strings.Contains(err.Error(), "enqueue these tasks without pacing") {
			t.Errorf("%s: %v, want the rule refused for pacing, saying what to do", name, err)
		}
	}
}
