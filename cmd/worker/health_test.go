package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/rules"
)

// /readyz answers 503 within readyTimeout (under a second) when Redis
// takes connections and never replies, however long go-redis itself
// would wait (its read timeout, 3s by default).
func TestReadyzRedisHangs(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// A Redis that reads every command and never replies.
		rdb := redis.NewClient(&redis.Options{
			Addr: "127.0.0.1:0",
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				client, server := net.Pipe()
				go func() { _, _ = io.Copy(io.Discard, server) }()
				return client, nil
			},
		})
		defer rdb.Close()
		cfg, err := rules.Parse("rules.yaml", []byte("rules:\n  - {name: r, tasks: [x], subject: {fixed: s}, algorithm: gcra, limit: 1, period: 1s}\n"))
		if err != nil {
			t.Fatal(err)
		}
		ready, err := readiness(rdb, cfg)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		rec := httptest.NewRecorder()
		healthMux(prometheus.NewRegistry(), ready, nil).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		if took := time.Since(start); took != readyTimeout || took >= time.Second {
			t.Errorf("/readyz answered after %v; want readyTimeout, %v, under a second", took, readyTimeout)
		}
		if body := rec.Body.String(); rec.Code != http.StatusServiceUnavailable || !strings.Contains(body, "not ready: Redis does not answer within 500ms") {
			t.Errorf("/readyz: %d %q; want 503 saying Redis does not answer", rec.Code, body)
		}
	})
}
