package main

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"
)

// fakeAPI is an LLM API with a requests limit and a tokens limit it does
// not publish in its answers: two token buckets, each holding a whole
// period's worth and refilled at the limit's rate (the way such tiers are
// commonly described). A call is charged one request and the tokens it
// really uses (prompt + answer) when it arrives, and answered 429 if
// either bucket cannot pay.
type fakeAPI struct {
	cfg config

	mu       sync.Mutex
	reqs     bucket
	toks     bucket
	rng      *rand.Rand
	requests int
	tokens   int
	rejected int
	first    time.Time
	last     time.Time
}

// bucket is a token bucket on the local clock.
type bucket struct {
	level, capacity, perSec float64
	at                      time.Time
}

// take takes n if the bucket holds them at now.
func (b *bucket) take(now time.Time, n float64) bool {
	b.level = min(b.capacity, b.level+now.Sub(b.at).Seconds()*b.perSec)
	b.at = now
	if b.level < n {
		return false
	}
	b.level -= n
	return true
}

func newFakeAPI(cfg config) *fakeAPI {
	now := time.Now()
	full := func(n int) bucket {
		return bucket{level: float64(n), capacity: float64(n), perSec: float64(n) / cfg.Period.Seconds(), at: now}
	}
	return &fakeAPI{cfg: cfg, reqs: full(cfg.Requests), toks: full(cfg.Tokens), rng: rand.New(rand.NewPCG(cfg.Seed, 2))}
}

func (a *fakeAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var p prompt
	if err := json.NewDecoder(r.Body).Decode(&p); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	used := p.PromptTokens + min(p.Answer, p.MaxTokens)
	now := time.Now()
	a.mu.Lock()
	if a.first.IsZero() {
		a.first = now
	}
	a.last = now
	reqOK := a.reqs.take(now, 1)
	ok := reqOK && a.toks.take(now, float64(used))
	if reqOK && !ok {
		a.reqs.level++ // refused: the request is not counted either
	}
	if !ok {
		a.rejected++
		a.mu.Unlock()
		http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
		return
	}
	a.requests++
	a.tokens += used
	latency := time.Duration(a.rng.Int64N(int64(a.cfg.Latency))) + a.cfg.Latency/10
	a.mu.Unlock()
	time.Sleep(latency) // generating the answer
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{
		"id":    p.ID,
		"usage": map[string]int{"prompt_tokens": p.PromptTokens, "completion_tokens": used - p.PromptTokens, "total_tokens": used},
	})
}

// snapshot is what the API has seen so far.
type snapshot struct {
	requests, tokens, rejected int
	first, last                time.Time
}

func (a *fakeAPI) snapshot() snapshot {
	a.mu.Lock()
	defer a.mu.Unlock()
	return snapshot{a.requests, a.tokens, a.rejected, a.first, a.last}
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }
