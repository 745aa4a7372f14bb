package main

import (
	"context"
	"os/exec"
	"testing"
)

// TestSharesSmoke runs a small case of the shares part: a key at 25/s
// shared by tenant, each tenant at 10/s (burst 1), 30 tasks of the hot
// tenant, then 10 of each of two small ones a second later, on three
// asynq servers. Every task must run once, no tenant past its limit and
// the key never past its own in any second on the Redis clock, and a few
// limiter calls per task.
func TestSharesSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("a few seconds of real time")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server is not installed: asynq and the wake-ups need a real server")
	}
	addr := testRedisAddr(t)
	cfg := defaultSharesConfig()
	cfg.KeyRate, cfg.ShareRate = 25, 10
	r, err := runSharesCase(context.Background(), addr, sharesCase{Hot: 30, Small: 2, PerSmall: 10, ShareLimit: true}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d/%d in %.2fs (ideal %.2fs, fair %.2fs): %.3f calls, %.3f parks per task; most in 1 s: key %d, tenant %d (%s); hot %.1f/s before, %.1f/s with, %.1f/s after; small first ≤ %.2fs, last ≤ %.2fs",
		r.Done, r.N, r.TookS, r.IdealS, r.FairS, r.CallsPerTask, r.ParksPerTask, r.MaxKeyTurns1s, r.MaxTenantTurns1s, r.MaxTenant,
		r.HotRateBefore, r.HotRateWith, r.HotRateAfter, r.SmallFirstMax, r.SmallLastMax)
	if !r.Finished || r.Done != r.N || r.DuplicateStarts != 0 {
		t.Fatalf("%d of %d tasks ran (%d twice) before the cap of %.0fs", r.Done, r.N, r.DuplicateStarts, r.CapS)
	}
	if r.OtherErrors != 0 {
		t.Errorf("%d handler errors other than parks, first: %s", r.OtherErrors, r.FirstError)
	}
	if r.MaxKeyTurns1s > r.KeyBound1s || r.MaxTenantTurns1s > r.TenantBound1s {
		t.Errorf("most turns in one second on the Redis clock: key %d (bound %d), tenant %s %d (bound %d)", r.MaxKeyTurns1s, r.KeyBound1s, r.MaxTenant, r.MaxTenantTurns1s, r.TenantBound1s)
	}
	if r.LimiterCalls < int64(r.N) || r.CallsPerTask > 4 {
		t.Errorf("%.3f limiter calls per task, want from 1 to 4", r.CallsPerTask)
	}
	if len(r.SmallTenants) != 2 || r.SmallFirstMax > 3 {
		t.Errorf("small tenants %+v: want two, each starting within 3s", r.SmallTenants)
	}
}
