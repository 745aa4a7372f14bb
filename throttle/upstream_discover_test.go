package throttle

import (
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// noBurst is a resource that announces nothing and accepts a request no
// sooner than interval after the last one it accepted (a GCRA with a
// burst of 1), on the test's clock.
type noBurst struct {
	interval time.Duration
	tat      time.Time
}

func (r *noBurst) answer() Answer {
	now := time.Now()
	if now.Before(r.tat) {
		return Answer{TooMany: true}
	}
	r.tat = now.Add(r.interval)
	return Answer{}
}

// A resource that announces nothing is discovered from the gaps between
// the requests it accepted and refused: every answer is learned while
// Learned.Discovering, and the rate found under a 100/s rule is 89-100 %
// of its 20/s within a few 429s, in under a second. Halving the rate on
// 429s and recovering at 10 % a second took 2.4-3.3 s (BENCHMARKS.md).
func TestUpstreamDiscoversLimitFromGaps(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)}).Upstream()
		api := &noBurst{interval: 50 * time.Millisecond}
		start := time.Now()
		refused := 0
		var l Lesson
		for i := 0; ; i++ {
			d, _ := depart(t, u, "s", 0)
			if i > 0 && !d.Learned.Discovering {
				t.Fatalf("departure %d: not discovering (%+v), and the limit not found", i, d.Learned)
			}
			a := api.answer()
			if a.TooMany {
				refused++
			}
			if l = learn(t, u, "s", d, a); !l.Discovering {
				break
			}
			if i > 100 {
				t.Fatalf("still discovering after %d requests: %+v", i, l)
			}
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("found after %v; want under a second", took)
		}
		if refused > 8 {
			t.Errorf("%d 429s while discovering; want at most 8", refused)
		}
		if l.Rate < 0.89*20 || l.Rate > 20 {
			t.Errorf("the rate found is %v/s; want 89-100 %% of the resource's 20/s", l.Rate)
		}
		// Found: held there, and the answers no longer learned.
		time.Sleep(10 * time.Second)
		d, _ := depart(t, u, "s", 0)
		if d.Learned.Discovering || d.Learned.Rate > 20 || d.Learned.Rate < l.Rate {
			t.Errorf("10 s later: %+v; want the rate found, grown by 0.02 %% a second at most, and no discovery", d.Learned)
		}
	})
}

// A resource whose 429s the gaps cannot explain (a window of 15 a second:
// accepted 10 ms apart, refused 10 ms after an accepted one) ends the
// discovery, and its 429 is answered as any other: the rate halved from
// the rule's.
func TestUpstreamDiscoveryEndsWhenBoundsDisagree(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u := mustNew(t, rdb, Options{}, Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(100).WithBurst(1)}).Upstream()
		for i := range 15 {
			d, _ := depart(t, u, "s", 0)
			if l := learn(t, u, "s", d, Answer{}); !l.Discovering || l.Rate != 0 {
				t.Fatalf("accepted answer %d: %+v; want discovering, no rate", i, l)
			}
		}
		d, _ := depart(t, u, "s", 0)
		l := learn(t, u, "s", d, Answer{TooMany: true})
		if l.Discovering || l.Discovery || !l.Lowered || !near(l.From, 100) || !near(l.Rate, 50) {
			t.Errorf("a 429 10 ms after an accepted request, accepted ones 10 ms apart: %+v; want the discovery over and the rate halved from 100/s", l)
		}
	})
}

// A resource that accepts everything the rules send ends the discovery
// after 20 answers: the rules bind, and answers are no longer learned.
func TestUpstreamDiscoveryEndsWhenRulesBind(t *testing.T) {
	virtual(t, func(t *testing.T, rdb *redis.Client, _ *miniredis.Miniredis) {
		u := mustNew(t, rdb, Options{}, tenPerSecond).Upstream()
		var l Lesson
		for range 20 {
			d, _ := depart(t, u, "s", 0)
			l = learn(t, u, "s", d, Answer{})
		}
		if l.Discovering || l.Rate != 0 {
			t.Errorf("after 20 answers with no 429: %+v; want no discovery and no rate learned", l)
		}
		if d, _ := depart(t, u, "s", 0); d.Learned.Discovering {
			t.Errorf("the next departure: %+v; want no discovery", d.Learned)
		}
	})
}
