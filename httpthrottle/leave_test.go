package httpthrottle

import (
	"context"
	"net/http"
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
		trs := fleet(t, m, up, 2, fast, Options{NoWait: true, Paced: true})
		for _, tr := range trs { // both learn the rate
			if code := getCtx(t, ctx, &http.Client{Transport: tr}, "http://api.example/"); code != http.StatusOK {
				t.Fatalf("a first request: %d", code)
			}
		}
		time.Sleep(time.Second)
		decided := time.Now()
		var turns [2]throttle.Admission
		for i, id := range []string{"a", "b"} {
			var err error
			if turns[i], err = trs[i].lim.Admit(ctx, throttle.AdmitRequest{Subject: "api.example", N: 1, Caller: throttle.Caller{ID: id}, Wait: time.Second}); err != nil {
				t.Fatal(err)
			}
		}
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
// first seconds that put convergence past 1 s).
func TestPacedLateOwnerLeavesOnItsTurn(t *testing.T) {
	for _, late := range []time.Duration{1500 * time.Microsecond, 4 * ms} {
		t.Run(late.String(), func(t *testing.T) {
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
				rtt.Store(int64(800 * time.Microsecond))
				decided := time.Now()
				a, err := tr.lim.Admit(ctx, throttle.AdmitRequest{Subject: "api.example", N: 1, Caller: throttle.Caller{ID: "a"}, Wait: time.Second})
				if err != nil {
					t.Fatal(err)
				}
				time.Sleep(time.Until(a.At) + late)
				if code := getCtx(t, WithTurn(ctx, Turn{At: a.At, Decided: decided}), client, "http://api.example/"); code != http.StatusOK {
					t.Errorf("the request answered %d; want 200", code)
				}
				calls, _ := up.log()
				if got, want := calls[len(calls)-1]-a.At.Sub(epoch), late+2*ms; got > want {
					t.Errorf("the request reached the API %v after its turn; want at most %v (on its turn, late as its handler)", got, want)
				}
				if st := tr.Stats(); st.OnTurn != 1 {
					t.Errorf("%d requests left on their turns; want 1", st.OnTurn)
				}
			})
		})
	}
}
