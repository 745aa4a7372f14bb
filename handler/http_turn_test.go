package handler

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
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

const turnRules = `
prefix: "turn:"
rules:
  - name: api
    tasks: ["api:call"]
    subject: {fixed: api}
    algorithm: gcra
    limit: 100
    period: 1s
    burst: 1
handlers:
  - task: api:call
    http:
      method: POST
      url: "http://api.example/v1/call"
`

// sentAt records when each request reached the base transport.
type sentAt struct {
	mu sync.Mutex
	at []time.Time
}

func (s *sentAt) RoundTrip(req *http.Request) (*http.Response, error) {
	s.mu.Lock()
	s.at = append(s.at, time.Now())
	s.mu.Unlock()
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: io.NopCloser(strings.NewReader("{}")), Request: req}, nil
}

// In the first seconds after another process learned the API's rate, a
// worker process that has not heard of it yet sends its task's request
// on a turn that Admit booked as the request's departure; its transport
// does not know that, and departs on the schedule, which hands it that
// departure if it asks within DepartureTolerance (2ms) of it. The
// handler started 0.8ms late and each call to Redis takes 0.8ms here:
// before, the handler read the subject's pause first, so the departure
// was asked for 2.4ms after the turn, too late: the request took the
// next free slot, one interval (52.6ms) on, and left its turn's a hole.
// Now the request departs with no read before it (Depart honours the
// pause) and leaves at its turn.
func TestHTTPDepartsOnItsTurn(t *testing.T) {
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis) {
		ctx := context.Background()
		cfg, err := rules.Parse("rules.yaml", []byte(turnRules))
		if err != nil {
			t.Fatal(err)
		}
		hs, err := ParseConfig("rules.yaml", []byte(turnRules))
		if err != nil {
			t.Fatal(err)
		}
		// Another process sent the first request and learned 20/s.
		other, err := cfg.Limiter(rdb, "api", throttle.Options{})
		if err != nil {
			t.Fatal(err)
		}
		d, err := other.Upstream().Depart(ctx, "api", 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := other.Upstream().Learn(ctx, "api", d, throttle.Answer{Quota: 20, Window: time.Second}); err != nil {
			t.Fatal(err)
		}
		slow := redistest.PipeClient(m)
		defer slow.Close()
		rtt := new(atomic.Int64)
		slow.AddHook(redistest.Slow{RTT: rtt})
		base := &sentAt{}
		spec, _ := hs.Handler("api:call")
		h, err := newHTTPHandler(spec, Options{Rules: cfg, Redis: slow, Base: base}, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second) // the worker started a while ago
		rtt.Store(int64(800 * time.Microsecond))
		start := time.Now()
		var a throttle.Admission
		for _, id := range []string{"t0", "t1"} { // t1's turn comes an interval after t0's
			if a, err = h.lim.Admit(ctx, throttle.AdmitRequest{Subject: "api", N: 1, Caller: throttle.Caller{ID: id}, Wait: time.Second}); err != nil {
				t.Fatal(err)
			}
		}
		if a.Status != throttle.Granted || a.Delay <= 0 {
			t.Fatalf("admitted %s in %v; want a turn later, at the learned rate", a.Status, a.Delay)
		}
		time.Sleep(time.Until(a.At) + 800*time.Microsecond) // the handler starts late
		w := admission.Wait{Rule: "api", Subject: "api", Duration: time.Since(start), Turn: a.Slot, At: a.At}
		if err := h.send(admission.WithWait(ctx, w), asynq.NewTask("api:call", []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
		if len(base.at) != 1 {
			t.Fatalf("%d requests sent; want 1", len(base.at))
		}
		if late := base.at[0].Sub(a.At); late > throttle.DepartureTolerance(time.Second/19) {
			t.Errorf("the request left %v after its turn; want within the tolerance (%v): its turn's departure is left a hole", late, throttle.DepartureTolerance(time.Second/19))
		}
	})
}
