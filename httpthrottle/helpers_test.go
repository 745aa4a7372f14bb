package httpthrottle

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/redistest"
	"github.com/jobthrottle/jobthrottle/throttle"
)

const ms = time.Millisecond

// virtual runs f in a synctest bubble on a miniredis that reads the
// bubble's clock (redistest.Virtual).
func virtual(t *testing.T, f func(t *testing.T, rdb *redis.Client, m *miniredis.Miniredis)) {
	t.Helper()
	redistest.Virtual(t, f)
}

func mustNew(t testing.TB, rdb redis.UniversalClient, opts throttle.Options, rules ...throttle.Rule) *throttle.Limiter {
	t.Helper()
	l, err := throttle.New(rdb, opts, rules...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// epoch is where a synctest bubble's clock starts.
var epoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// at is the time since the bubble started.
func at() time.Duration { return time.Since(epoch) }

func formatInt(n int) string { return fmt.Sprint(n) }

func allow(t testing.TB, l *throttle.Limiter, subject string, n int) throttle.Result {
	t.Helper()
	res, err := l.AllowN(context.Background(), subject, n)
	if err != nil {
		t.Fatalf("AllowN(%q, %d): %v", subject, n, err)
	}
	return res
}
