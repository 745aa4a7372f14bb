package throttle_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// The upstream schedule on every backend: the first departure probes, an
// answer's policy paces the next one (past maxWait here: a DelayError,
// nothing booked), and the state lives under the subject's hash tag with
// a TTL of throttle.UpstreamTTL.
func TestBackendsUpstream(t *testing.T) {
	for _, b := range redistest.Backends(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			prefix := redistest.Prefix(t)
			l, err := throttle.New(b.Client, throttle.Options{Prefix: prefix},
				throttle.Rule{Name: "r", Algorithm: throttle.GCRA, Limit: throttle.Limit{Count: 3, Period: time.Hour, Burst: 1}})
			if err != nil {
				t.Fatal(err)
			}
			u := l.Upstream()
			d, err := u.Depart(ctx, "s", time.Second)
			if err != nil || !d.Probe {
				t.Fatalf("first Depart: %+v, %v; want the probe, at once", d, err)
			}
			lesson, err := u.Learn(ctx, "s", d, throttle.Answer{Quota: 2, Window: time.Hour})
			if err != nil || !lesson.Changed || lesson.Quota != 2 || lesson.Window != time.Hour {
				t.Fatalf("Learn: %+v, %v; want the policy 2 per hour, changed", lesson, err)
			}
			_, err = u.Depart(ctx, "s", time.Second)
			var de *throttle.DelayError
			// One departure per 1/(LearnedShare × 2/h): 31m35s after the
			// first at 95 %.
			share := throttle.LearnedShare
			want := time.Duration(float64(time.Hour) / (share * 2))
			if !errors.As(err, &de) || de.RetryAfter < want-time.Minute || de.RetryAfter > want {
				t.Fatalf("second Depart: %v; want a *DelayError in about %v", err, want.Round(time.Second))
			}
			k := prefix + "{s}:!upstream(r)"
			ttl, err := b.Client.PTTL(ctx, k).Result()
			if err != nil || ttl <= throttle.UpstreamTTL-time.Minute || ttl > throttle.UpstreamTTL {
				t.Fatalf("PTTL %s = %v, %v; want about %v", k, ttl, err, throttle.UpstreamTTL)
			}
		})
	}
}
