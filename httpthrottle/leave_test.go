package httpthrottle

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// Two paced requests on consecutive turns of the learned schedule, from
// two processes: the first leaves late (its handler started 1.9ms after
// its turn, within the tolerance that lets it leave on its turn), the
// second on time. What the API sees is the time between their leaves, so
// the second is held back by the first one's lateness: they reach the API
// no closer than 98 % of the learned interval (the API's interval at 95 %
// of its rate is 95 %). Before, the second left on its turn, the learned
// interval less the first one's lateness after it.
func TestPacedLateTurnPushesTheNext(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		up := &limitedUpstream{limit: 20, style: styleIETF}
		trs := learnedFleet(t, m, up, 2)
		decided := time.Now()
		turns := [2]throttle.Admission{admitTurn(t, trs[0], "a"), admitTurn(t, trs[1], "b")}
		iv := turns[1].At.Sub(turns[0].At)
		if iv <= 50*ms {
			t.Fatalf("turns %v apart; want the learned interval, above the API's 50ms", iv)
		}
		late := throttle.DepartureTolerance(iv) - 100*time.Microsecond
		for i := range turns {
			time.Sleep(time.Until(turns[i].At))
			if i == 0 {
				time.Sleep(late)
			}
			tctx := WithTurn(ctx, Turn{At: turns[i].At, Decided: decided})
			if code := getCtx(t, tctx, &http.Client{Transport: trs[i]}, "http://api.example/"); code != http.StatusOK {
				t.Errorf("request %d answered %d; want 200", i, code)
			}
		}
		for i, tr := range trs {
			if st := tr.Stats(); st.OnTurn != 1 {
				t.Errorf("transport %d: %d requests on their turns; want 1", i, st.OnTurn)
			}
		}
		calls, _ := up.log()
		// Leave keeps 98 % of the interval (the learned rate grows by 0.02 %
		// a second too: a microsecond or so).
		if got, want := calls[len(calls)-1]-calls[len(calls)-2], iv*49/50-5*time.Microsecond; got < want {
			t.Errorf("the requests reached the API %v apart; want at least %v, 98 %% of the learned interval", got, want)
		}
	})
}

// A paced request whose handler started late for its turn, on a busy
// machine where each call to Redis takes 0.8ms, still leaves on its turn
// (the departure Admit booked for it), pushed by nothing: the call that
// says it leaves does not make it late, and a lateness of 1.5ms, or of
// 4ms, only holds the next request back. Before, the lateness was checked
// after the call (1.5ms + 0.8ms, past the 2ms tolerance) and the request
// departed on the schedule, an interval or more after its turn, which it
// left a hole (traced at 10 workers: 2-6ms late owners, holes in the
// first seconds that put convergence past 1 s). Nor does a call that
// takes longer than the tolerance itself (12ms, a stalled Redis or a
// starved process): the leave it recorded is the request's, which leaves
// after it; before, it departed on the schedule, leaving its turn as a
// hole behind a leave no request made.
func TestPacedLateOwnerLeavesOnItsTurn(t *testing.T) {
	for _, c := range []struct{ late, rtt time.Duration }{
		{1500 * time.Microsecond, 800 * time.Microsecond},
		{4 * ms, 800 * time.Microsecond},
		{0, 12 * ms},
	} {
		late := c.late
		t.Run(late.String()+"+"+c.rtt.String(), func(t *testing.T) {
			virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
				ctx := context.Background()
				up := &limitedUpstream{limit: 20, style: styleIETF}
				rdb := redistest.PipeClient(m)
				t.Cleanup(func() { _ = rdb.Close() })
				rtt := new(atomic.Int64)
				rdb.AddHook(redistest.Slow{RTT: rtt})
				tr, err := New(mustNew(t, rdb, throttle.Options{}, fast), Options{NoWait: true, Paced: true, Base: up})
				if err != nil {
					t.Fatal(err)
				}
				client := &http.Client{Transport: tr}
				if code := getCtx(t, ctx, client, "http://api.example/"); code != http.StatusOK {
					t.Fatalf("the first request: %d", code)
				}
				time.Sleep(time.Second)
				rtt.Store(int64(c.rtt))
				decided := time.Now()
				a := admitTurn(t, tr, "a")
				time.Sleep(time.Until(a.At) + late)
				if code := getCtx(t, WithTurn(ctx, Turn{At: a.At, Decided: decided}), client, "http://api.example/"); code != http.StatusOK {
					t.Errorf("the request answered %d; want 200", code)
				}
				calls, _ := up.log()
				if got, want := calls[len(calls)-1]-a.At.Sub(epoch), late+c.rtt+2*ms; got > want {
					t.Errorf("the request reached the API %v after its turn; want at most %v (on its turn, late as its handler and its call)", got, want)
				}
				if st := tr.Stats(); st.OnTurn != 1 {
					t.Errorf("%d requests left on their turns; want 1", st.OnTurn)
				}
			})
		})
	}
}

// A request that departs on the schedule (no turn of its own), booked
// between two turns Admit booked, is not sent back behind them because
// the owner of the turn before it left a little late: its departure is
// pushed by that lateness, as Leave pushes the next owner. Before, the
// confirmation before its slot voided it (a request had left less than
// an interval before the slot) and booked it again after every booked
// turn, leaving its slot as a hole; at 10 workers, each owner's usual
// lateness of a few ms voided the departure behind it, again and again,
// and the fleet ran at 60 % of the API's limit for 10-13 s.
func TestDepartureBehindLateOwnerKeepsItsSlot(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		up := &limitedUpstream{limit: 20, style: styleIETF}
		trs := learnedFleet(t, m, up, 3)
		// Past the first seconds after the rate was learned, when a turn's
		// departure is open to a request on the schedule that comes less
		// than an interval after it (b would take a's).
		time.Sleep(3 * time.Second)
		decided := time.Now()
		a := admitTurn(t, trs[0], "a")
		late := 5 * ms // within turnLate (an eighth of the interval)
		// b comes after a's turn, too late to claim it (the tolerance,
		// 2ms), before a's request leaves.
		time.Sleep(time.Until(a.At) + 3*ms)
		done := make(chan time.Duration, 1)
		go func() { // b: no turn, departs on the schedule, after a's turn
			if code := getCtx(t, ctx, &http.Client{Transport: trs[1]}, "http://api.example/"); code != http.StatusOK {
				t.Errorf("b answered %d; want 200", code)
			}
			done <- at()
		}()
		time.Sleep(ms)
		c := admitTurn(t, trs[2], "c")
		iv := c.At.Sub(a.At) / 2
		if iv <= 50*ms {
			t.Fatalf("a's and c's turns %v apart; want two learned intervals (b's slot between)", c.At.Sub(a.At))
		}
		var wg sync.WaitGroup
		for _, o := range []struct {
			tr   *Transport
			turn throttle.Admission
			late time.Duration
		}{{trs[0], a, late}, {trs[2], c, 0}} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Until(o.turn.At) + o.late)
				tctx := WithTurn(ctx, Turn{At: o.turn.At, Decided: decided})
				if code := getCtx(t, tctx, &http.Client{Transport: o.tr}, "http://api.example/"); code != http.StatusOK {
					t.Errorf("an owner answered %d; want 200", code)
				}
			}()
		}
		wg.Wait()
		b := <-done
		if want := a.At.Sub(epoch) + late + iv + 2*ms; b > want {
			t.Errorf("b reached the API %v after a's turn; want at most %v: its slot, an interval after a's, pushed by a's lateness (%v)",
				b-a.At.Sub(epoch), want-a.At.Sub(epoch), late)
		}
		calls, _ := up.log()
		n := len(calls)
		for i := n - 2; i < n; i++ {
			if gap := calls[i] - calls[i-1]; gap < iv*49/50-5*time.Microsecond {
				t.Errorf("requests %d and %d reached the API %v apart; want at least 98 %% of the learned interval %v", i-1, i, gap, iv)
			}
		}
	})
}

// A request that reaches the wire late after its departure (a process's
// first request dials a connection after its slot: traced 4.8 ms on
// loopback while ten worker processes start) says when it did, and the
// next request, on the schedule, leaves an interval after that rather
// than an interval after the slot. Before, the second reached the API the
// first one's lateness closer than the learned interval to it, under the
// API's interval: a 429.
func TestLateWritePushesTheNext(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		const dial = 8 * ms
		trs, calls := lateWrite(t, m, dial)
		n := len(calls)
		iv := time.Duration(float64(time.Second) / trs[1].LearnedRate())
		if gap := calls[n-1] - calls[n-2]; gap < iv-100*time.Microsecond {
			t.Errorf("the request after one %v late reached the API %v after it; want at least the learned interval, %v", dial, gap, iv)
		}
		if got := trs[0].Stats().WroteLate; got != 1 {
			t.Errorf("WroteLate = %d; want 1", got)
		}
		if got := trs[1].Stats().WroteLate; got != 0 {
			t.Errorf("the second transport's WroteLate = %d; want 0", got)
		}
	})
}

// A request that reaches the wire within throttle.DepartureTolerance of
// its departure (2 ms at 20/s) is on time: no call to say so (with 1 ms,
// a loaded machine's timer jitter made 121-298 such calls in 1,500
// requests), and the next, an interval after its slot, is still more than
// the API's interval after it.
func TestLateWriteWithinToleranceIsOnTime(t *testing.T) {
	virtual(t, func(t *testing.T, _ *redis.Client, m *miniredis.Miniredis) {
		trs, calls := lateWrite(t, m, 1500*time.Microsecond)
		if got := trs[0].Stats().WroteLate + trs[1].Stats().WroteLate; got != 0 {
			t.Errorf("WroteLate = %d; want 0 for a request 1.5 ms late", got)
		}
		if gap := calls[len(calls)-1] - calls[len(calls)-2]; gap < 50*ms {
			t.Errorf("the request after one 1.5 ms late reached the API %v after it; want at least its 50 ms", gap)
		}
	})
}

// lateWrite has a fleet of two transports that learned a 20/s API each
// send a request, the first reaching the wire dial late, and returns them
// and the API's log.
func lateWrite(t *testing.T, m *miniredis.Miniredis, dial time.Duration) ([]*Transport, []time.Duration) {
	ctx := context.Background()
	up := &limitedUpstream{limit: 20, style: styleIETF}
	cold := &coldDial{next: up}
	trs := learnedFleet(t, m, cold, 2)
	cold.delay.Store(int64(dial))
	var wg sync.WaitGroup
	for i, tr := range trs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * ms) // the second is booked after the first
			if code := getCtx(t, ctx, &http.Client{Transport: tr}, "http://api.example/"); code != http.StatusOK {
				t.Errorf("request %d answered %d; want 200", i, code)
			}
		}()
	}
	wg.Wait()
	calls, _ := up.log()
	return trs, calls
}

// coldDial is a base transport whose next request reaches the wire delay
// after RoundTrip is called, as over a connection dialled first, and says
// so to the request's httptrace hooks, as http.Transport does.
type coldDial struct {
	next  http.RoundTripper
	delay atomic.Int64 // ns, for the next request only
}

func (c *coldDial) RoundTrip(req *http.Request) (*http.Response, error) {
	if d := time.Duration(c.delay.Swap(0)); d > 0 {
		time.Sleep(d)
	}
	if tr := httptrace.ContextClientTrace(req.Context()); tr != nil && tr.WroteHeaders != nil {
		tr.WroteHeaders()
	}
	return c.next.RoundTrip(req)
}

// learnedFleet returns n paced transports (Options.Paced) over up, each of
// which has had one request answered, a second ago: the fleet has learned
// the API's rate, and each process knows it.
func learnedFleet(t *testing.T, m *miniredis.Miniredis, up http.RoundTripper, n int) []*Transport {
	t.Helper()
	trs := fleet(t, m, up, n, fast, Options{NoWait: true, Paced: true})
	for _, tr := range trs {
		if code := getCtx(t, context.Background(), &http.Client{Transport: tr}, "http://api.example/"); code != http.StatusOK {
			t.Fatalf("a first request: %d", code)
		}
	}
	time.Sleep(time.Second)
	return trs
}

// admitTurn takes a turn of api.example for the caller id on tr's limiter.
func admitTurn(t *testing.T, tr *Transport, id string) throttle.Admission {
	t.Helper()
	a, err := tr.lim.Admit(context.Background(), throttle.AdmitRequest{Subject: "api.example", N: 1, Caller: throttle.Caller{ID: id}, Wait: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return a
}
