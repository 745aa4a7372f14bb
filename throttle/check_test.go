package throttle

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// CheckN answers without Redis (the client below has no server) with the
// error the request would get at once, for the limiter's own rules and for
// rules over other subjects.
func TestCheckN(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = rdb.Close() })
	one := mustNew(t, rdb, Options{},
		Rule{Name: "api", Algorithm: GCRA, Limit: PerSecond(20).WithBurst(5)},
		Rule{Name: "day", Algorithm: FixedWindow, Limit: Limit{Count: 3, Period: 24 * time.Hour}})
	parts := mustNew(t, rdb, Options{},
		Rule{Name: "tenant", Algorithm: GCRA, Limit: PerSecond(20)},
		Rule{Name: "all", Algorithm: TokenBucket, Limit: PerSecond(100).WithBurst(2), Subject: "all"})
	cases := []struct {
		name    string
		lim     *Limiter
		subject string
		n       int
		want    error
	}{
		{"fits", one, "acme", 3, nil},
		{"zero reads", one, "acme", 0, nil},
		{"over the window's count", one, "acme", 4, ErrExceedsCapacity},
		{"empty subject", one, "", 1, ErrInvalidSubject},
		{"long subject", one, strings.Repeat("x", maxSubjectLen+1), 1, ErrInvalidSubject},
		{"fits every part", parts, "acme", 2, nil},
		{"over another subject's burst", parts, "acme", 3, ErrExceedsCapacity},
	}
	for _, c := range cases {
		if err := c.lim.CheckN(c.subject, c.n); !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Errorf("%s: CheckN(%q, %d) = %v, want %v", c.name, c.subject, c.n, err, c.want)
		}
	}
	if err := one.CheckN("acme", -1); err == nil {
		t.Error("CheckN(-1) = nil, want an error")
	}
}

// Capacity is the largest request each algorithm can admit.
func TestRuleCapacity(t *testing.T) {
	l := Limit{Count: 10, Period: time.Second, Burst: 3}
	for algo, want := range map[Algorithm]int{GCRA: 3, TokenBucket: 3, FixedWindow: 10, SlidingLog: 10, SlidingWindow: 10, Concurrency: MaxPermits} {
		if got := (Rule{Name: "r", Algorithm: algo, Limit: l}).Capacity(); got != want {
			t.Errorf("%s: Capacity = %d, want %d", algo, got, want)
		}
	}
}
