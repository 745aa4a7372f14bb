package httpthrottle

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// Two paced requests on consecutive turns of the learned schedule, from
// two processes: the first leaves late (its handler started 1.9ms after
// its turn, within the tolerance that lets it leave on its turn), the
// second on time. What the API sees is the time between their leaves, so
// the second is held back by the first one's lateness: they reach the API
// no closer than the learned interval. Before, the second left on its
// turn, the learned interval less the first one's lateness after it.
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
		// The learned rate grows by 0.02 % a second: the interval at the
		// second leave is a microsecond or so shorter than the turns'.
		if got := calls[len(calls)-1] - calls[len(calls)-2]; got < iv-5*time.Microsecond {
			t.Errorf("the requests reached the API %v apart; want at least the learned interval, %v", got, iv)
		}
	})
}
