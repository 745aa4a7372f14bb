package main

import (
	"context"
	"io"
	"testing"
	"time"
)

// TestDrain runs the example's batch (a shorter one: 100 calls at twice the
// token rate, about 9s) and checks what the fake API saw: every call
// answered, no 429, and tokens at 90% of the limit's rate or more. The
// 429s are the hard bound (the workers' burst is 3s of the rate, the API's
// a whole period, so arrivals late by seconds still fit). The rate counts
// the opening burst too; so the test also wants 85% of all the limit
// allowed over the run, burst included (the example prints about 95%;
// tasks that start late on a loaded machine lower it, never the other
// way), well above what pacing by the estimates alone could reach.
func TestDrain(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 10s")
	}
	cfg := defaults
	cfg.Tasks, cfg.Tokens, cfg.Requests = 100, 40000, 120
	res, err := run(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("requests %d, tokens %d (estimated %d), 429s %d, in %v; %.1f%% of the token rate; token limit used: %.1f%% of what it allowed; by estimates alone %.1f%%",
		res.Requests, res.Tokens, res.Estimated, res.Rejected, res.Span.Round(time.Millisecond), 100*res.Rate, 100*res.Utilization, 100*res.WithoutSettle)
	if res.Rejected != 0 {
		t.Errorf("the API answered %d calls with 429; want none", res.Rejected)
	}
	if res.Requests != cfg.Tasks {
		t.Errorf("the API answered %d calls, want %d", res.Requests, cfg.Tasks)
	}
	if res.Rate < 0.9 {
		t.Errorf("tokens at %.1f%% of the limit's rate, want at least 90%%", 100*res.Rate)
	}
	if res.Utilization < 0.85 || res.Utilization < res.WithoutSettle+0.1 {
		t.Errorf("token limit used: %.1f%% of what it allowed, want at least 85%% (and well above the %.1f%% of the estimates alone)", 100*res.Utilization, 100*res.WithoutSettle)
	}
}
