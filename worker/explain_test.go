package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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

// explainRules are the rules of the Explain tests: "booked" books turns a
// minute ahead, "lined" keeps the default horizon (1s), so its backlog
// waits in its subject's line, "places" lets one task run at a time, and
// "prio" is "lined" with a priority from the payload's field p.
const explainRules = `prefix: %q
rules:
  - {name: booked, tasks: ["api:booked"], subject: {payload_field: acct}, algorithm: gcra, limit: 1, period: 10s, horizon: 1m}
  - {name: lined, tasks: ["api:lined"], subject: {payload_field: acct}, algorithm: gcra, limit: 1, period: 10s}
  - {name: places, tasks: ["block:*"], subject: {fixed: all}, algorithm: concurrency, limit: 1, lease: 30s}
  - {name: prio, tasks: ["api:prio"], subject: {payload_field: acct}, algorithm: gcra, limit: 1, period: 10s, priority: {payload_field: p, max_age: 30s}}
`

// explainBed is an asynq server on rdb behind the middleware of
// explainRules, serving queue "default": tasks of types "block:*" run
// until release is closed, the others return at once.
type explainBed struct {
	cfg     *rules.Config
	client  *asynq.Client
	srv     *asynq.Server
	release chan struct{}
}

func newExplainBed(t *testing.T, rdb *redis.Client) *explainBed {
	t.Helper()
	cfg, err := rules.Parse("rules.yaml", fmt.Appendf(nil, explainRules, redistest.Prefix(t)))
	if err != nil {
		t.Fatal(err)
	}
	mw, err := FromRules(cfg, rdb, Options{Asynq: rdb, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	b := &explainBed{cfg: cfg, client: asynq.NewClientFromRedisClient(rdb), release: make(chan struct{})}
	b.srv = asynq.NewServerFromRedisClient(rdb, Configure(asynq.Config{
		Concurrency: 4, Queues: map[string]int{"default": 1}, LogLevel: asynq.FatalLevel, ShutdownTimeout: time.Second,
	}))
	mux := asynq.NewServeMux()
	mux.Use(mw.Wrap)
	mux.HandleFunc("block:", func(ctx context.Context, _ *asynq.Task) error {
		select {
		case <-b.release:
		case <-ctx.Done():
		}
		return nil
	})
	for _, p := range []string{"api:", "other:"} { // (asynq's ServeMux takes no empty pattern)
		mux.HandleFunc(p, func(context.Context, *asynq.Task) error { return nil })
	}
	if err := b.srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mw.Close() })
	return b
}

// stop ends the blocked tasks and the server.
func (b *explainBed) stop() {
	close(b.release)
	b.srv.Shutdown()
}

func (b *explainBed) enqueue(t *testing.T, typ, payload string, opts ...asynq.Option) string {
	t.Helper()
	info, err := b.client.Enqueue(asynq.NewTask(typ, []byte(payload)), append([]asynq.Option{asynq.Retention(time.Hour)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return info.ID
}

// explainUntil explains id until cond holds of the answer, or fails after
// a minute (of the bubble's time).
func explainUntil(t *testing.T, rdb redis.UniversalClient, id string, opts ExplainOptions, what string, cond func(*Explanation) bool) *Explanation {
	t.Helper()
	for end := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		e, err := Explain(context.Background(), rdb, id, opts)
		if err == nil && cond(e) {
			return e
		}
		if time.Now().After(end) {
			t.Fatalf("task %s: after a minute, still not %s: %+v, %v", id, what, e, err)
		}
	}
}

// A parked task is explained with its rule, subject and booked turn (and
// the wake-up that brings it back), or its place in its subject's line,
// and what it last waited for, then and once it has run.
func TestExplainParked(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := newExplainBed(t, rdb)
		defer b.stop()
		opts := ExplainOptions{Rules: b.cfg}
		var ids []string
		for range 3 {
			ids = append(ids, b.enqueue(t, "api:booked", `{"acct": "a1"}`))
		}
		for range 3 {
			ids = append(ids, b.enqueue(t, "api:lined", `{"acct": "b1"}`))
		}
		for _, id := range ids {
			explainUntil(t, rdb, id, opts, "done or parked", doneOrParked)
		}
		var es []*Explanation
		for _, id := range ids {
			e, err := Explain(context.Background(), rdb, id, opts)
			if err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
		}
		booked := byStatus(t, es[:3], 1, 2)
		checkBooked(t, booked)
		checkLined(t, byStatus(t, es[3:], 1, 2))

		// Once run, a task that was parked still says what it waited for.
		p := booked[0]
		done := explainUntil(t, rdb, p.TaskID, opts, "completed", func(e *Explanation) bool { return e.Status == StatusCompleted })
		if w := done.LastWait; w == nil || w.Rule != "booked" || !strings.Contains(done.Text(), `  last parked at `+p.LastErrorAt.Format("2006-01-02T15:04:05.000Z")+` (`) ||
			!strings.Contains(done.Text(), `by rule "booked", subject "a1", until `+p.LastWait.RunsAgainAt.Format("2006-01-02T15:04:05.000Z")+" (") {
			t.Errorf("completed after a park: last wait %+v:\n%s", w, done.Text())
		}
	})
}

// checkBooked checks the explanations of two tasks parked on turns booked
// one after the other under rule "booked" for subject a1.
func checkBooked(t *testing.T, parked []*Explanation) {
	t.Helper()
	var turns []time.Time
	for _, e := range parked {
		r := e.Rule
		if r == nil || r.Name != "booked" || r.Subject != "a1" || r.Turn == nil || r.InLine {
			t.Fatalf("booked task: rule %+v, want a turn of rule booked for a1", r)
		}
		if !r.Turn.After(e.Now) || r.Turn.Sub(e.Now) > 20*time.Second {
			t.Errorf("turn %v is not within 20s after now %v", r.Turn, e.Now)
		}
		if e.Wakeup == nil || !e.Wakeup.Equal(*r.Turn) {
			t.Errorf("wake-up %v, want at the turn %v", e.Wakeup, r.Turn)
		}
		checkLastWait(t, e, "booked", "a1", ErrParked)
		checkText(t, e, `is parked in queue "default": waiting for its turn, not failed`, `rule "booked" (limits booked), subject "a1"`,
			"turn booked for "+r.Turn.Format("2006-01-02T15:04:05.000Z")+" (in ", "the wake-up loop moves it to pending just before\n",
			`last parked at `, "retried 0 of 25 (parks are not counted")
		turns = append(turns, *r.Turn)
	}
	slices.SortFunc(turns, time.Time.Compare)
	if gap := turns[1].Sub(turns[0]); gap != 10*time.Second {
		t.Errorf("the two booked turns are %v apart, want the rule's 10s", gap)
	}
}

// checkLined checks the explanations of two tasks waiting in the line of
// rule "lined" for subject b1.
func checkLined(t *testing.T, parked []*Explanation) {
	t.Helper()
	var places []int
	for _, e := range parked {
		r := e.Rule
		if r == nil || !r.InLine || r.Turn != nil || r.LineLength != 2 || r.LineServing == nil {
			t.Fatalf("lined task: rule %+v: want in a line of 2 with a serving, no turn", r)
		}
		// The line's head is woken for its turn, and its return serves
		// the line (throttle.AdmitRequest.HeadServes); the other waits.
		if head := r.Position == 1; head != (e.Wakeup != nil) || head && !e.Wakeup.Equal(*r.LineServing) {
			t.Errorf("lined task at %d: wake-up %v, the line served at %v; want the head's at the serving, none else", r.Position, e.Wakeup, r.LineServing)
		}
		checkLastWait(t, e, "lined", "b1", ErrParkedInLine)
		checkText(t, e, fmt.Sprintf("waiting in its subject's line, no turn booked yet: position %d of 2; the line is next served at ", r.Position),
			"if its line's serving has not woken it")
		places = append(places, r.Position)
	}
	if slices.Sort(places); !slices.Equal(places, []int{1, 2}) {
		t.Errorf("positions in line %v, want 1 and 2", places)
	}
}

func checkText(t *testing.T, e *Explanation, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(e.Text(), w) {
			t.Errorf("text lacks %q:\n%s", w, e.Text())
		}
	}
}

func doneOrParked(e *Explanation) bool {
	return e.Status == StatusCompleted || e.Status == StatusParked && e.Rule != nil && (e.Rule.Turn != nil || e.Rule.InLine)
}

// byStatus checks that es holds completed tasks and parked ones, as many
// as given, and returns the parked.
func byStatus(t *testing.T, es []*Explanation, completed, parked int) []*Explanation {
	t.Helper()
	var c, p []*Explanation
	for _, e := range es {
		switch e.Status {
		case StatusCompleted:
			c = append(c, e)
		case StatusParked:
			p = append(p, e)
		}
	}
	if len(c) != completed || len(p) != parked {
		t.Fatalf("%d completed, %d parked; want %d and %d", len(c), len(p), completed, parked)
	}
	return p
}

func checkLastWait(t *testing.T, e *Explanation, rule, subject string, cause error) {
	t.Helper()
	w := e.LastWait
	if w == nil || w.Rule != rule || w.Subject != subject || w.Cause != cause.Error() || e.LastErrorAt == nil || e.State != "retry" || e.Retried != 0 {
		t.Errorf("last wait %+v (state %s, retried %d, at %v), want rule %q, subject %q, parked (%v), in asynq's retry set, no retry used", w, e.State, e.Retried, e.LastErrorAt, rule, subject, cause)
	}
}

// A running task, one queued for a place of its concurrency limit, a
// completed one, one archived for want of a subject, a pending one no rule
// applies to, and a copy parked in place of a task with no retry left.
func TestExplainStates(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := newExplainBed(t, rdb)
		defer b.stop()
		opts := ExplainOptions{Rules: b.cfg}
		run := explainUntil(t, rdb, b.enqueue(t, "block:a", ""), opts, "running", func(e *Explanation) bool { return e.Status == StatusRunning && e.Running != nil })
		if run.Rule == nil || !run.Rule.Holding || run.Running.PID == 0 {
			t.Errorf("running task: %+v, rule %+v", run, run.Rule)
		}
		checkText(t, run, `is running in queue "default", on `, `holds a place of concurrency limit "places"`)
		second := explainUntil(t, rdb, b.enqueue(t, "block:b", ""), opts, "queued for a place", func(e *Explanation) bool { return e.Rule != nil && e.Rule.QueuedForPlace == 1 })
		if second.Status != StatusParked {
			t.Errorf("queued task: status %s", second.Status)
		}
		checkText(t, second, `queued for a place of concurrency limit "places": position 1`)

		done := explainUntil(t, rdb, b.enqueue(t, "other:x", ""), opts, "completed", func(e *Explanation) bool { return e.Status == StatusCompleted })
		if done.CompletedAt == nil || done.Rule != nil {
			t.Errorf("completed task: %+v", done)
		}
		checkText(t, done, `completed in queue "default" at `, `no rule applies to type "other:x"`)
		archived := explainUntil(t, rdb, b.enqueue(t, "api:booked", `{}`), opts, "archived", func(e *Explanation) bool { return e.Status == StatusArchived })
		if archived.Rule == nil || !strings.Contains(archived.Rule.SubjectError, `"acct"`) {
			t.Errorf("archived task: rule %+v, want its subject's error", archived.Rule)
		}
		checkPending(t, rdb, b, opts)

		// A task with no retry left parks as a copy; the original is gone.
		explainUntil(t, rdb, b.enqueue(t, "api:booked", `{"acct": "c1"}`), opts, "completed", func(e *Explanation) bool { return e.Status == StatusCompleted })
		orig := b.enqueue(t, "api:booked", `{"acct": "c1"}`, asynq.MaxRetry(0))
		cp := explainUntil(t, rdb, orig, opts, "parked as a copy", func(e *Explanation) bool { return e.Status == StatusParked && e.Rule != nil && e.Rule.Turn != nil })
		if cp.TaskID != orig+"~throttled1" || cp.Asked != orig || cp.Requeues != 1 || cp.State != "scheduled" {
			t.Errorf("copy: %+v", cp)
		}
		checkText(t, cp, "  asked for "+orig+": it was parked as this copy", "parked as a copy 1 times")
	})
}

// checkPending checks a pending task no rule applies to, with the rules
// and without.
func checkPending(t *testing.T, rdb redis.UniversalClient, b *explainBed, opts ExplainOptions) {
	t.Helper()
	pending := b.enqueue(t, "other:y", "", asynq.Queue("idle"))
	e, err := Explain(context.Background(), rdb, pending, opts)
	if err != nil || e.Status != StatusPending || !e.RulesKnown || e.Rule != nil || e.Queue != "idle" {
		t.Fatalf("pending task: %+v, %v", e, err)
	}
	if want := "task " + pending + " (other:y) is pending in queue \"idle\": it runs when a worker is free\n  no rule applies to type \"other:y\"\n"; !strings.HasPrefix(e.Text(), want) {
		t.Errorf("text:\n%s\nwant it to start %q", e.Text(), want)
	}
	e, err = Explain(context.Background(), rdb, pending, ExplainOptions{})
	if err != nil || e.RulesKnown {
		t.Fatalf("without rules: %+v, %v", e, err)
	}
	checkText(t, e, "rule: unknown without the rules file (--config)")
}

// An ID no queue holds, and one that two queues hold.
func TestExplainNotFound(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		_, err := Explain(ctx, rdb, "nope", ExplainOptions{})
		var nf *TaskNotFoundError
		if !errors.As(err, &nf) || !errors.Is(err, asynq.ErrTaskNotFound) || !strings.Contains(err.Error(), "this Redis has no asynq queue") {
			t.Errorf("no queue at all: %v", err)
		}
		client := asynq.NewClientFromRedisClient(rdb)
		for _, q := range []string{"a", "b"} {
			if _, err := client.Enqueue(asynq.NewTask("t", nil), asynq.Queue(q), asynq.TaskID("dup")); err != nil {
				t.Fatal(err)
			}
		}
		_, err = Explain(ctx, rdb, "nope", ExplainOptions{})
		if !errors.As(err, &nf) || nf.ID != "nope" || !slices.Equal(nf.Queues, []string{"a", "b"}) {
			t.Errorf("unknown ID: %v", err)
		}
		if want := `worker: explain: no task "nope" in queues "a", "b", nor a copy "nope~throttled1"`; err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("error %v, want it to start %q", err, want)
		}
		if _, err = Explain(ctx, rdb, "dup", ExplainOptions{}); !errors.Is(err, ErrAmbiguousTask) || !strings.Contains(err.Error(), `"dup" is in queues "a", "b"`) {
			t.Errorf("ID in two queues: %v", err)
		}
		if e, err := Explain(ctx, rdb, "dup", ExplainOptions{Queue: "b"}); err != nil || e.Queue != "b" {
			t.Errorf("with the queue named: %+v, %v", e, err)
		}
		if _, err = Explain(ctx, rdb, "dup", ExplainOptions{Queue: "c"}); !errors.As(err, &nf) {
			t.Errorf("in a queue that does not exist: %v", err)
		}
	})
}

// The keys Explain reads are those a real limiter writes, for a subject
// and rule names that the key encoding escapes: a booking, a place in the
// line, a producer's receipt, and the places of a concurrency limit.
func TestExplainKeys(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		prefix := redistest.Prefix(t)
		limits := []throttle.Rule{{Name: "per second", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: 10 * time.Second, Burst: 1}}, {Name: "daily%", Algorithm: throttle.FixedWindow, Limit: throttle.Limit{Count: 100, Period: 24 * time.Hour}}}
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, limits...)
		if err != nil {
			t.Fatal(err)
		}
		admit := func(id string, horizon time.Duration) throttle.Admission {
			a, err := lim.Admit(ctx, throttle.AdmitRequest{Subject: keysSubject, N: 1, Caller: throttle.Caller{ID: id}, Horizon: horizon})
			if err != nil {
				t.Fatal(err)
			}
			return a
		}
		admit("t0", time.Minute) // granted
		booked := admit("t1", time.Minute)
		if inLine := admit("t2", time.Second); booked.Status != throttle.Booked || booked.InLine || !inLine.InLine {
			t.Fatalf("admissions %v and %+v: want a booking, then a place in line", booked.Status, inLine)
		}
		res, err := lim.PrepayN(ctx, keysSubject, 1, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		receipt, slot := res.Receipt()
		read := ruleReader(t, rdb, prefix, limits)
		if rs := read("t1", nil); rs.Turn == nil || !rs.Turn.Equal(booked.Slot) || rs.InLine {
			t.Errorf("booked: %+v, want turn %v", rs, booked.Slot)
		}
		if rs := read("t2", nil); !rs.InLine || rs.Position != 1 || rs.LineLength != 1 || rs.Turn != nil {
			t.Errorf("in line: %+v", rs)
		}
		if rs := read("t3", map[string]string{admission.ReceiptHeader: receipt}); rs.Receipt == nil || !rs.Receipt.Equal(slot) || rs.Turn != nil {
			t.Errorf("paced: %+v, want receipt %v", rs, slot)
		}
	})
}

// Explain reads a nested rule's line (rules.RuleConfig.Nested): the
// limiter's own, named after the rule, not after its limits.
func TestExplainKeysNested(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		prefix := redistest.Prefix(t)
		limits := []throttle.Rule{{Name: "tenant", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 1, Period: 10 * time.Second, Burst: 1}}}
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix, Line: "key"}, limits...)
		if err != nil {
			t.Fatal(err)
		}
		share := throttle.PerSecond(1).WithBurst(1)
		for _, id := range []string{"t0", "t1"} {
			if _, err := lim.Admit(ctx, throttle.AdmitRequest{Subject: keysSubject, N: 1, Caller: throttle.Caller{ID: id, Share: "k1"}, Horizon: time.Second, ShareLimit: share}); err != nil {
				t.Fatal(err)
			}
		}
		rc := rules.RuleConfig{Name: "key", Nested: true, Subject: rules.SubjectConfig{Fixed: keysSubject}, Limits: limits}
		ledger, _ := admission.NewShardedWakeups(rdb, admission.WakeupsKey, 0)
		rs, err := readRule(ctx, rdb, ledger, prefix, rc, &asynq.TaskInfo{ID: "t1", Queue: "q"})
		if err != nil {
			t.Fatal(err)
		}
		if !rs.InLine || rs.Position != 1 || rs.LineLength != 1 {
			t.Errorf("in the nested rule's line: %+v", rs)
		}
	})
}

// keysSubject is a subject whose every odd byte the key encoding escapes.
const keysSubject = "acct 1/{é}:x"

// ruleReader returns a function that reads what a rule of limits keeps
// about the task id in queue "q" with headers, for keysSubject.
func ruleReader(t *testing.T, rdb redis.UniversalClient, prefix string, limits []throttle.Rule) func(id string, headers map[string]string) *RuleState {
	rc := rules.RuleConfig{Name: "r", Subject: rules.SubjectConfig{Fixed: keysSubject}, Limits: limits}
	return func(id string, headers map[string]string) *RuleState {
		t.Helper()
		ledger, _ := admission.NewShardedWakeups(rdb, admission.WakeupsKey, 0)
		rs, err := readRule(context.Background(), rdb, ledger, prefix, rc, &asynq.TaskInfo{ID: id, Queue: "q", Headers: headers})
		if err != nil {
			t.Fatal(err)
		}
		return rs
	}
}

// The places of a concurrency limit, as Explain reads them: a holder and
// a waiter, each under its wake-up member.
func TestExplainKeysConcurrency(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		ctx := context.Background()
		prefix := redistest.Prefix(t)
		places := []throttle.Rule{{Name: "one at a time", Algorithm: throttle.Concurrency, Limit: throttle.Limit{Count: 1, Period: time.Minute}}}
		lim, err := throttle.New(rdb, throttle.Options{Prefix: prefix}, places...)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range []string{"h", "w"} {
			if _, err := lim.Admit(ctx, throttle.AdmitRequest{Subject: keysSubject, N: 1, Caller: throttle.Caller{ID: id, Waiter: admission.Member("q", id)}}); err != nil {
				t.Fatal(err)
			}
		}
		read := ruleReader(t, rdb, prefix, places)
		if rs := read("h", nil); !rs.Holding || rs.Concurrency != "one at a time" {
			t.Errorf("holder: %+v", rs)
		}
		if rs := read("w", nil); rs.Holding || rs.QueuedForPlace != 1 {
			t.Errorf("waiter: %+v", rs)
		}
		if err := lim.Release(ctx, keysSubject); err != nil {
			t.Fatal(err)
		}
	})
}

// TestExplainPriority: a task of a rule with a priority is explained with
// its level and the rule's age bound, in its subject's line; a task whose
// level cannot be read says why.
func TestExplainPriority(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b := newExplainBed(t, rdb)
		defer b.stop()
		opts := ExplainOptions{Rules: b.cfg}
		explainUntil(t, rdb, b.enqueue(t, "api:prio", `{"acct": "p1", "p": 1}`), opts, "completed", func(e *Explanation) bool { return e.Status == StatusCompleted })
		b.enqueue(t, "api:prio", `{"acct": "p1", "p": 2}`) // booked 10s ahead
		id := b.enqueue(t, "api:prio", `{"acct": "p1", "p": 7}`)
		e := explainUntil(t, rdb, id, opts, "in line", func(e *Explanation) bool { return e.Rule != nil && e.Rule.InLine })
		if e.Rule.Priority == nil || *e.Rule.Priority != 7 || e.Rule.MaxAgeSeconds != 30 {
			t.Errorf("rule state %+v, want priority 7 and an age bound of 30s", e.Rule)
		}
		checkText(t, e, `priority 7 of 0-9 (higher first); after 30s in line it goes before every task that joined after it`, "waiting in its subject's line")
		bad := b.enqueue(t, "api:prio", `{"acct": "p1", "p": "high"}`, asynq.ProcessIn(time.Hour))
		e, err := Explain(context.Background(), rdb, bad, opts)
		if err != nil || e.Rule == nil || e.Rule.Priority != nil || e.Rule.PriorityError == "" {
			t.Fatalf("a task with no readable level: %+v, %v", e, err)
		}
		checkText(t, e, "no priority: ")
	})
}
