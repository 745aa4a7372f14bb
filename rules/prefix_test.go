package rules

import (
	"context"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// A Go producer that builds its limiter with throttle's defaults and a
// worker fleet whose rules file names no prefix charge one ledger: the
// same rule over the same subject is one limit, not two (issue 11.6).
func TestDefaultPrefixIsOneLedger(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()

	cfg, err := Parse("rules.yaml", []byte("rules: [{name: api, tasks: [a], subject: {fixed: x}, algorithm: gcra, limit: 2, period: 1h, burst: 2}]"))
	if err != nil {
		t.Fatal(err)
	}
	fleet, err := cfg.Limiter(rdb, "api", throttle.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rule, _ := cfg.Rule("api")
	producer, err := throttle.New(rdb, throttle.Options{}, rule.Limits...)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := producer.AllowN(ctx, "x", 2); err != nil || !res.Allowed {
		t.Fatalf("producer AllowN(2) = %+v, %v; want allowed", res, err)
	}
	if res, err := fleet.Allow(ctx, "x"); err != nil || res.Allowed {
		t.Fatalf("worker Allow after the producer took the burst = %+v, %v; want denied (one ledger)", res, err)
	}
	if cfg.Prefix != throttle.DefaultPrefix {
		t.Fatalf("rules file default prefix %q, throttle.DefaultPrefix %q; want one default", cfg.Prefix, throttle.DefaultPrefix)
	}
}
