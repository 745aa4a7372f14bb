package throttle

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// sendRecorder counts what a client sends: script commands sent alone,
// pipelines of script commands, and the script commands inside them. While gate is set,
// every send waits for it to close, so a test can hold batches out.
type sendRecorder struct {
	alone, pipelines, piped atomic.Int64
	gate                    atomic.Pointer[chan struct{}]
}

func (r *sendRecorder) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r *sendRecorder) wait() {
	if g := r.gate.Load(); g != nil {
		<-*g
	}
}

func (r *sendRecorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if strings.EqualFold(cmd.Name(), "evalsha") {
			r.wait()
			r.alone.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (r *sendRecorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var scripts int64
		for _, c := range cmds {
			if strings.EqualFold(c.Name(), "evalsha") {
				scripts++
			}
		}
		if scripts > 0 { // not go-redis's own, such as a connection's HELLO
			r.wait()
			r.pipelines.Add(1)
			r.piped.Add(scripts)
		}
		return next(ctx, cmds)
	}
}

func batchSetup(t *testing.T, opts Options) (*Limiter, *sendRecorder, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	rec := &sendRecorder{}
	rdb.AddHook(rec)
	l := mustNew(t, rdb, opts, Rule{Name: "r", Algorithm: GCRA, Limit: Limit{Count: 1, Period: time.Hour, Burst: 1}.WithBurst(10)})
	return l, rec, m
}

// allowAll runs n concurrent Allows on subject and returns how many were
// admitted and the errors.
func allowAll(l *Limiter, ctx context.Context, subject string, n int) (int, []error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	admitted := 0
	var errs []error
	for range n {
		wg.Go(func() {
			res, err := l.Allow(ctx, subject)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			} else if res.Allowed {
				admitted++
			}
		})
	}
	wg.Wait()
	return admitted, errs
}

// heldAllows starts n concurrent Allows on subject "s" while every send is
// held, so that the first maxBatchSenders calls are out and the others
// queue; then it runs during (if set), lets the sends go, and returns how
// many were admitted and the errors.
func heldAllows(t *testing.T, l *Limiter, rec *sendRecorder, n int, during func()) (int, []error) {
	t.Helper()
	gate := make(chan struct{})
	rec.gate.Store(&gate)
	done := make(chan struct{})
	var admitted int
	var errs []error
	go func() {
		admitted, errs = allowAll(l, context.Background(), "s", n)
		close(done)
	}()
	waitFor(t, "calls to queue behind the held sends", func() bool {
		l.batch.mu.Lock()
		defer l.batch.mu.Unlock()
		return l.batch.senders == maxBatchSenders && len(l.batch.pending) > 0
	})
	if during != nil {
		during()
	}
	close(gate)
	<-done
	return admitted, errs
}

// Held batches make the next calls queue; when released they go out
// together, each decided exactly once: 10 of 100 admitted (the burst of a
// 1-per-hour rule), with fewer sends than calls.
func TestBatchedAllowsDecideEachCallOnce(t *testing.T) {
	l, rec, _ := batchSetup(t, Options{})
	admitted, errs := heldAllows(t, l, rec, 100, nil)
	if len(errs) != 0 {
		t.Fatalf("errors: %v", errs)
	}
	if admitted != 10 {
		t.Fatalf("%d of 100 concurrent Allows admitted; want 10, the burst", admitted)
	}
	alone, pipelines, piped := rec.alone.Load(), rec.pipelines.Load(), rec.piped.Load()
	if alone+piped != 100 {
		t.Fatalf("%d EVALSHAs sent alone + %d in pipelines; want 100, one per call", alone, piped)
	}
	if pipelines == 0 || alone+pipelines >= 100 {
		t.Fatalf("%d sends alone and %d pipelines for 100 concurrent calls; want them batched", alone, pipelines)
	}
	l.batch.mu.Lock()
	defer l.batch.mu.Unlock()
	if l.batch.senders != 0 || len(l.batch.pending) != 0 {
		t.Fatalf("after the calls: %d senders, %d queued; want none", l.batch.senders, len(l.batch.pending))
	}
}

// A lone call goes out on its own, as without batching.
func TestLoneAllowIsNotPipelined(t *testing.T) {
	l, rec, _ := batchSetup(t, Options{})
	for range 12 {
		allow(t, l, "s", 1)
	}
	if a, p := rec.alone.Load(), rec.pipelines.Load(); a != 12 || p != 0 {
		t.Fatalf("12 sequential Allows: %d EVALSHAs alone, %d pipelines; want 12 and 0", a, p)
	}
}

// A queued call whose context ends is dropped unsent: it charges nothing.
func TestBatchedAllowCancelledWhileQueued(t *testing.T) {
	l, rec, _ := batchSetup(t, Options{})
	gate := make(chan struct{})
	rec.gate.Store(&gate)
	var held sync.WaitGroup
	for range maxBatchSenders {
		held.Go(func() { _, _ = l.Allow(context.Background(), "s") })
	}
	waitFor(t, "the senders to be held", func() bool {
		l.batch.mu.Lock()
		defer l.batch.mu.Unlock()
		return l.batch.senders == maxBatchSenders
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := l.Allow(ctx, "s")
		errc <- err
	}()
	waitFor(t, "the call to queue", func() bool {
		l.batch.mu.Lock()
		defer l.batch.mu.Unlock()
		return len(l.batch.pending) == 1
	})
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) || !errors.Is(err, ErrRedis) {
		t.Fatalf("Allow cancelled while queued = %v; want context.Canceled (matching ErrRedis)", err)
	}
	close(gate)
	held.Wait()
	waitFor(t, "the senders to finish", func() bool {
		l.batch.mu.Lock()
		defer l.batch.mu.Unlock()
		return l.batch.senders == 0
	})
	if sent := rec.alone.Load() + rec.piped.Load(); sent != maxBatchSenders {
		t.Fatalf("%d EVALSHAs sent; want %d: the cancelled call must not be sent", sent, maxBatchSenders)
	}
	res := allow(t, l, "s", 1)
	if want := 10 - maxBatchSenders - 1; res.Remaining != want {
		t.Fatalf("after %d admitted calls and one cancelled, a new one leaves %d; want %d", maxBatchSenders, res.Remaining, want)
	}
}

// A batch that meets NOSCRIPT (Redis lost its scripts) loads the script
// and sends those calls again: each is decided once.
func TestBatchedAllowReloadsScript(t *testing.T) {
	l, rec, m := batchSetup(t, Options{})
	allow(t, l, "warm", 1) // loads the script
	admitted, errs := heldAllows(t, l, rec, 40, func() {
		admin := redis.NewClient(&redis.Options{Addr: m.Addr()})
		defer admin.Close()
		if err := admin.ScriptFlush(context.Background()).Err(); err != nil {
			t.Error(err)
		}
	})
	if len(errs) != 0 || admitted != 10 {
		t.Fatalf("after SCRIPT FLUSH: %d of 40 admitted, errors %v; want 10 and none", admitted, errs)
	}
}

// NoBatching sends every call alone.
func TestNoBatching(t *testing.T) {
	l, rec, _ := batchSetup(t, Options{NoBatching: true})
	admitted, errs := allowAll(l, context.Background(), "s", 50)
	if len(errs) != 0 || admitted != 10 {
		t.Fatalf("%d of 50 admitted, errors %v; want 10 and none", admitted, errs)
	}
	if a, p := rec.alone.Load(), rec.pipelines.Load(); a != 50 || p != 0 {
		t.Fatalf("NoBatching: %d EVALSHAs alone, %d pipelines; want 50 and 0", a, p)
	}
}

// waitFor polls cond (real time) for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
