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
			a, err := w.Admit(ctx, throttle.AdmitRequest{Subject: "acme", N: 1, Receipt: receipt, Wait: -1, Tolerance: time.Hour})
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

// A subject that cannot be derived fails the task before anything is
// booked.
func TestBatchBadSubject(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client) {
		c := &fakeClient{}
		b := Batch{Type: "t", Payloads: [][]byte{[]byte(`{"t":"a"}`), []byte(`{}`)},
			Pacer: &Pacer{Limiter: newLimiter(t, rdb, apiRule), Subject: rules.SubjectConfig{PayloadField: "t"}.Of}}
		res, err := b.Run(context.Background(), c)
		if err == nil || res.Enqueued != 1 {
			t.Fatalf("Run = %+v, %v; want 1 enqueued, then an error", res, err)
		}
	})
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
