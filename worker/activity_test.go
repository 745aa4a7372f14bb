package worker

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The activity counts decisions per second for ActivitySpan, and by
// outcome for good.
func TestActivitySeconds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second))) // at a second's start
		start := time.Now()
		m.decided("r", admission.LabelAdmitted)
		m.decided("r", admission.LabelRedeemed)
		m.decided("r", admission.LabelParked)
		time.Sleep(2500 * time.Millisecond)
		m.decided("r", admission.LabelWaited)
		m.decided("r", admission.LabelError)
		m.decided("other", admission.LabelParked)

		r := m.Activity().Rule("r")
		if o := m.Activity().Rule("other"); o.Rule != "other" || o.Decisions[admission.LabelParked] != 1 || len(o.Decisions) != 1 {
			t.Errorf("rule other: %+v; want 1 parked", o)
		}
		if n := m.Activity().Rule("none"); len(n.Decisions) != 0 || len(n.Seconds) != activitySeconds || n.Seconds[0].Admitted != 0 {
			t.Errorf("a rule without decisions: %+v; want no decisions and %d empty seconds", n, activitySeconds)
		}
		if r.Admitted() != 3 || r.Decisions[admission.LabelParked] != 1 || r.Decisions[admission.LabelError] != 1 || len(r.Decisions) != 5 {
			t.Errorf("decisions %v, admitted %d; want 3 admitted (admitted, redeemed, waited), 1 parked, 1 error", r.Decisions, r.Admitted())
		}
		if len(r.Seconds) != activitySeconds {
			t.Fatalf("%d seconds; want %d", len(r.Seconds), activitySeconds)
		}
		last, first := r.Seconds[len(r.Seconds)-1], r.Seconds[len(r.Seconds)-3]
		if !first.Start.Equal(start) || first.Admitted != 2 || first.Parked != 1 {
			t.Errorf("the first second %+v; want it to start at %v with 2 admitted, 1 parked", first, start)
		}
		if !last.Start.Equal(start.Add(2*time.Second)) || last.Admitted != 1 || last.Parked != 0 {
			t.Errorf("the current second %+v; want 1 admitted (the error is neither)", last)
		}

		// Past the span, the seconds count nothing, and the totals stay.
		time.Sleep(ActivitySpan)
		m.decided("r", admission.LabelAdmitted)
		r = m.Activity().Rule("r")
		total := 0
		for _, s := range r.Seconds {
			total += s.Admitted + s.Parked
		}
		if total != 1 || r.Seconds[len(r.Seconds)-1].Admitted != 1 || r.Admitted() != 4 {
			t.Errorf("after the span: %d in the seconds, %d admitted in all; want the one just admitted, and 4", total, r.Admitted())
		}
	})
}

// The turns booked ahead are the turn book's, parked or handed by a
// line's serving: spread over the seconds they are due in, the soonest to
// within a grain, the furthest exact; and they are those of
// jobthrottle_booked_turns.
func TestActivityTurnsAhead(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg := prometheus.NewRegistry()
		m, _ := NewMetrics(reg)
		time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second)))
		now := time.Now()
		for _, ahead := range []time.Duration{2500 * time.Millisecond, 90 * time.Second} {
			m.parkedOn("r", admission.Decision{Admission: throttle.Admission{Status: throttle.Booked, At: now.Add(ahead)}}, ahead)
		}
		m.parkedOn("r", admission.Decision{Admission: throttle.Admission{Status: throttle.Held, At: now.Add(time.Second)}}, time.Second) // counted when booked
		m.lineServed("r", "s", admission.Served{Handed: map[string]time.Time{"a": now.Add(250 * time.Millisecond), "b": now.Add(2700 * time.Millisecond)}})
		r := m.Activity().Rule("r")
		next := now.Add(300*time.Millisecond - time.Nanosecond) // the end of 0.25 s's grain
		if r.TurnsAhead != 4 || !r.NextTurn.Equal(next) || !r.LastTurn.Equal(now.Add(90*time.Second)) {
			t.Errorf("%d turns ahead, next %v, last %v; want 4, %v, %v", r.TurnsAhead, r.NextTurn.Sub(now), r.LastTurn.Sub(now), next.Sub(now), 90*time.Second)
		}
		if len(r.Ahead) != int(ActivityAhead/time.Second) || r.Ahead[0].Parked != 1 || r.Ahead[2].Parked != 2 || !r.Ahead[2].Start.Equal(now.Add(2*time.Second)) {
			t.Errorf("ahead %+v; want 1 turn in the current second, 2 in the third", r.Ahead[:3])
		}
		if got := scrape(t, reg)["jobthrottle_booked_turns"]["rule=r"]; got != float64(r.TurnsAhead) {
			t.Errorf("jobthrottle_booked_turns = %v; the activity says %d", got, r.TurnsAhead)
		}
		time.Sleep(3 * time.Second)
		if r := m.Activity().Rule("r"); r.TurnsAhead != 1 || r.LastTurn.Sub(r.NextTurn) >= turnGrain {
			t.Errorf("3s later: %d turns ahead, next %v, last %v; want the one 90s ahead", r.TurnsAhead, r.NextTurn, r.LastTurn)
		}
	})
}

// Through a middleware under asynq, the activity counts what
// jobthrottle_decisions_total counts, a turn ahead for each park until it
// comes, and each admission in the second it was made.
func TestActivityAgreesWithMetrics(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		// A horizon of 10m books every turn at once: each task parks once.
		b, m, stop := activityBed(t, rdb, "10m")
		defer stop()
		agree := func(when string) RuleActivity {
			t.Helper()
			r := m.Activity().Rule("api")
			for _, o := range []string{admission.LabelAdmitted, admission.LabelWaited, admission.LabelRedeemed, admission.LabelParked, admission.LabelDeferred, admission.LabelRefunded, admission.LabelError} {
				if got, want := r.Decisions[o], testutil.ToFloat64(m.decisions.WithLabelValues("api", o)); float64(got) != want {
					t.Errorf("%s: activity %s = %d; jobthrottle_decisions_total says %v", when, o, got, want)
				}
			}
			return r
		}
		eventually(t, 5*time.Second, "9 tasks parked", func() bool { return m.Activity().Rule("api").Decisions[admission.LabelParked] == 9 })
		if r := agree("parked"); r.TurnsAhead != 9 || r.LastTurn.Sub(r.NextTurn).Round(time.Second) != 8*time.Second {
			t.Errorf("%d turns ahead, from %v to %v; want 9, about a second apart", r.TurnsAhead, r.NextTurn, r.LastTurn)
		}
		eventually(t, 15*time.Second, "10 tasks ran", func() bool { return len(b.runs()) == 10 })
		time.Sleep(turnGrain) // a turn counts until at most a grain after it
		r := agree("ran")
		admitted := 0
		for _, s := range r.Seconds {
			admitted += s.Admitted
		}
		if r.TurnsAhead != 0 || r.Admitted() != 10 || admitted != 10 {
			t.Errorf("after the runs: %d turns ahead, %d admitted, %d in the seconds; want 0, 10, 10", r.TurnsAhead, r.Admitted(), admitted)
		}
	})
}

// activityBed serves 10 tasks of rule api, 1 a second, with the horizon
// given, under asynq on rdb (in a Virtual bubble), and returns the bed,
// the metrics, and a func that stops it.
func activityBed(t *testing.T, rdb *redis.Client, horizon string) (*bed, *Metrics, func()) {
	b := bedOn(t, rdb)
	cfg := parseRules(t, `prefix: "`+b.prefix+`"
rules:
  - {name: api, tasks: [api], subject: {fixed: all}, algorithm: gcra, limit: 1, period: 1s, max_wait: 1ms, horizon: `+horizon+`}
`)
	m, _ := NewMetrics(prometheus.NewRegistry())
	mw, err := FromRules(cfg, rdb, Options{Asynq: rdb, Logger: quiet, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	srv := b.serve(mw, asynq.Config{})
	for range 10 {
		b.enqueue("api", "")
	}
	return b, m, func() { srv.Shutdown(); mw.Close() }
}

// The turns a serving of a line books are counted (line turns, and turns
// ahead until their slots): with a horizon of 1s, task 2 books its turn
// and tasks 3 to 10 wait in the line, each served by its own return as
// the line's head (throttle.AdmitRequest.HeadServes), which books its
// turn and redeems it at once: 8 line turns, none left ahead.
func TestActivityLineTurns(t *testing.T) {
	t.Parallel()
	redistest.Virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		b, m, stop := activityBed(t, rdb, "1s")
		defer stop()
		eventually(t, 5*time.Second, "9 tasks parked", func() bool { return m.Activity().Rule("api").Decisions[admission.LabelParked] == 9 })
		eventually(t, 15*time.Second, "10 tasks ran", func() bool { return len(b.runs()) == 10 })
		if got := testutil.ToFloat64(m.lineTurns.WithLabelValues("api")); got != 8 {
			t.Errorf("line turns booked: %v; want tasks 3 to 10's, 8", got)
		}
		time.Sleep(time.Second) // past the last slot, which the run may precede by the clocks' mapping
		if r := m.Activity().Rule("api"); r.TurnsAhead != 0 {
			t.Errorf("a second after the runs: %d turns ahead; want 0", r.TurnsAhead)
		}
	})
}

// BenchmarkDecided is what a decision costs the middleware's metrics:
// the Prometheus counter alone (what /metrics needs), and the counter with
// the Activity's second (what the status page adds).
func BenchmarkDecided(b *testing.B) {
	m, _ := NewMetrics(prometheus.NewRegistry())
	b.Run("counter", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				m.decisions.WithLabelValues("api", admission.LabelAdmitted).Inc()
			}
		})
	})
	b.Run("counter+activity", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				m.decided("api", admission.LabelAdmitted)
			}
		})
	})
}
