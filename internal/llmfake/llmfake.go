// Package llmfake is a fake LLM provider for the examples, the tests and
// the bench: an OpenAI-compatible chat completions endpoint or an
// Anthropic messages endpoint that enforces requests, input-token,
// output-token and total-token limits per period, answers 429 past any of
// them, reports each call's usage (which its caller cannot know in
// advance) and sends that provider's rate-limit headers.
//
// Each limit is a bucket holding one period's worth, refilled
// continuously at the limit's rate, the way both providers describe their
// limits. A call is charged one request, its real input tokens and its
// real output tokens when it arrives (the fake decides the answer's
// length at once); a call that any bucket cannot pay is answered 429 and
// charged nothing.
//
// Imports: the standard library only.
package llmfake

import (
	"encoding/json"
	"hash/fnv"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// A Style is the provider a Provider imitates: its request path and
// authentication header, its usage shape and its rate-limit headers.
type Style string

// The styles a Provider imitates.
const (
	// OpenAI is an OpenAI-compatible chat completions API: POST
	// …/chat/completions with Authorization: Bearer; usage.prompt_tokens
	// and completion_tokens; x-ratelimit-{limit,remaining,reset}-
	// {requests,tokens} headers (resets as durations such as 6m0s), and
	// retry-after and retry-after-ms on a 429.
	OpenAI Style = "openai"
	// Anthropic is the Anthropic messages API: POST …/messages with
	// x-api-key; usage.input_tokens and output_tokens;
	// anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-
	// {limit,remaining,reset} headers (resets as RFC 3339 times), and
	// retry-after on a 429.
	Anthropic Style = "anthropic"
)

// Limits are what a Provider enforces per Period; a zero count is not
// enforced.
type Limits struct {
	Requests int // calls
	Input    int // input (prompt) tokens
	Output   int // output (completion) tokens
	Tokens   int // input + output tokens
	Period   time.Duration
	// Hold is how much of its rate each bucket holds: it holds Hold ×
	// rate, which it may spend at once. If zero, a whole Period's worth.
	// The headers still announce the limit per Period.
	Hold time.Duration
}

// the limits, in the order of Provider.buckets
const (
	kRequests = iota
	kInput
	kOutput
	kTokens
	kinds
)

// Provider is the fake API, an http.Handler. Its zero value is not
// usable: call New.
type Provider struct {
	style   Style
	latency time.Duration

	mu      sync.Mutex
	buckets [kinds]bucket
	stats   Stats
}

// Stats is what a Provider has answered so far.
type Stats struct {
	Answered int // calls answered 200
	Rejected int // calls answered 429
	// RejectedBy counts the 429s by the first limit that refused:
	// requests, input, output, tokens.
	RejectedBy [4]int
	Input      int       // input tokens of the calls answered
	Output     int       // output tokens of the calls answered
	First      time.Time // the first call's arrival (answered or not)
	Last       time.Time // the last call's arrival
}

// New returns a fake API in style enforcing lim, each call answered after
// latency (0: at once).
func New(style Style, lim Limits, latency time.Duration) *Provider {
	p := &Provider{style: style, latency: latency}
	now := time.Now()
	for k, n := range []int{lim.Requests, lim.Input, lim.Output, lim.Tokens} {
		if n > 0 && lim.Period > 0 {
			perSec := float64(n) / lim.Period.Seconds()
			held := float64(n)
			if lim.Hold > 0 {
				held = perSec * lim.Hold.Seconds()
			}
			p.buckets[k] = bucket{level: held, held: held, limit: n, perSec: perSec, at: now}
		}
	}
	return p
}

// Stats returns what the API has answered so far.
func (p *Provider) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// request is the part of a chat completions or messages request the fake
// reads.
type request struct {
	Model               string          `json:"model"`
	Messages            json.RawMessage `json:"messages"`
	System              json.RawMessage `json:"system"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
}

// ServeHTTP answers one call: 404 on another path, 401 without a key,
// 400 for a request without messages or max_tokens, 429 past a limit,
// else a completion whose usage is the call's real counts.
func (p *Provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if status, msg := p.check(r); status != 0 {
		http.Error(w, msg, status)
		return
	}
	body, req, err := decode(r)
	if err != nil {
		http.Error(w, "llmfake: "+err.Error(), http.StatusBadRequest)
		return
	}
	in, out := usage(body, req)
	now := time.Now()
	p.mu.Lock()
	refused := p.charge(now, in, out)
	p.headers(w.Header(), now)
	if refused >= 0 {
		p.stats.Rejected++
		p.stats.RejectedBy[refused]++
		wait := p.buckets[refused].wait(now, p.cost(refused, in, out))
		p.mu.Unlock()
		p.tooMany(w, wait)
		return
	}
	p.stats.Answered++
	p.stats.Input += in
	p.stats.Output += out
	p.mu.Unlock()
	if p.latency > 0 {
		time.Sleep(p.latency/2 + time.Duration(hash(body)%uint64(p.latency/2+1)))
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(p.answer(req.Model, in, out))
}

// check refuses a call to another path or without a key: its status and
// message, or 0.
func (p *Provider) check(r *http.Request) (int, string) {
	path, key := "/chat/completions", strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	if p.style == Anthropic {
		path, key = "/messages", r.Header.Get("X-Api-Key")
	}
	switch {
	case r.Method != http.MethodPost || !strings.HasSuffix(r.URL.Path, path):
		return http.StatusNotFound, "llmfake: POST …" + path + " only"
	case key == "":
		return http.StatusUnauthorized, "llmfake: no API key"
	}
	return 0, ""
}

// decode reads a request body.
func decode(r *http.Request) ([]byte, request, error) {
	var req request
	body, err := readAll(r)
	if err != nil {
		return nil, req, err
	}
	if err := json.Unmarshal(body, &req); err != nil || len(req.Messages) == 0 {
		return nil, req, errInvalid("the body is not a JSON object with messages")
	}
	if req.MaxTokens == nil {
		req.MaxTokens = req.MaxCompletionTokens
	}
	if req.MaxTokens == nil || *req.MaxTokens < 1 {
		return nil, req, errInvalid("max_tokens must be set, at least 1")
	}
	return body, req, nil
}

type errInvalid string

func (e errInvalid) Error() string { return string(e) }

// usage is a call's real input and output tokens, which its caller
// cannot know: the input is its messages' (and system prompt's) bytes
// over 4, times 0.85 to 1.05; the output 30 % to 100 % of max_tokens.
// Both follow from the body, so a run is repeatable.
func usage(body []byte, req request) (in, out int) {
	h := hash(body)
	fin := 0.85 + 0.2*float64(h%1000)/1000
	fout := 0.3 + 0.7*float64((h/1000)%1000)/1000
	in = max(1, int(math.Round(float64(len(req.Messages)+len(req.System))/4*fin)))
	out = max(1, int(math.Round(float64(*req.MaxTokens)*fout)))
	return in, out
}

func hash(b []byte) uint64 {
	f := fnv.New64a()
	_, _ = f.Write(b)
	return f.Sum64()
}

// cost is what a call of in and out tokens takes from limit k.
func (p *Provider) cost(k, in, out int) float64 {
	return float64([kinds]int{1, in, out, in + out}[k])
}

// charge takes a call's costs from every limit if all of them hold them,
// and returns -1, else the first limit that does not (nothing taken).
func (p *Provider) charge(now time.Time, in, out int) int {
	if p.stats.First.IsZero() {
		p.stats.First = now
	}
	p.stats.Last = now
	for k := range p.buckets {
		if !p.buckets[k].has(now, p.cost(k, in, out)) {
			return k
		}
	}
	for k := range p.buckets {
		p.buckets[k].take(p.cost(k, in, out))
	}
	return -1
}

// tooMany answers 429, with the wait until the refusing limit holds the
// call's cost.
func (p *Provider) tooMany(w http.ResponseWriter, wait time.Duration) {
	w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(wait.Seconds()))))
	kind := "rate_limit_error"
	if p.style == OpenAI {
		w.Header().Set("Retry-After-Ms", strconv.FormatInt(max(wait.Milliseconds(), 1), 10))
		kind = "rate_limit_exceeded"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusTooManyRequests)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"type": kind, "message": "llmfake: rate limit reached"}})
}

// answer is a completion's body in the provider's shape.
func (p *Provider) answer(model string, in, out int) map[string]any {
	if p.style == Anthropic {
		return map[string]any{"type": "message", "role": "assistant", "model": model,
			"content":     []map[string]string{{"type": "text", "text": "ok"}},
			"stop_reason": "end_turn",
			"usage":       map[string]int{"input_tokens": in, "output_tokens": out}}
	}
	return map[string]any{"object": "chat.completion", "model": model,
		"choices": []map[string]any{{"index": 0, "message": map[string]string{"role": "assistant", "content": "ok"}, "finish_reason": "stop"}},
		"usage":   map[string]int{"prompt_tokens": in, "completion_tokens": out, "total_tokens": in + out}}
}

// headers writes the rate-limit headers of the provider's style, after
// the call was charged (or refused).
func (p *Provider) headers(h http.Header, now time.Time) {
	if p.style == Anthropic {
		names := [kinds]string{"requests", "input-tokens", "output-tokens", ""}
		tightest := -1
		for k, name := range names {
			b := &p.buckets[k]
			if name == "" || b.limit == 0 {
				continue
			}
			b.write(h, "anthropic-ratelimit-"+name, now, func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339) })
			if k != kRequests && (tightest < 0 || b.share() < p.buckets[tightest].share()) {
				tightest = k
			}
		}
		if tightest >= 0 { // anthropic-ratelimit-tokens-*: the most restrictive token limit
			p.buckets[tightest].write(h, "anthropic-ratelimit-tokens", now, func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339) })
		}
		return
	}
	for k, name := range map[int]string{kRequests: "requests", kTokens: "tokens"} {
		if p.buckets[k].limit > 0 {
			p.buckets[k].write(h, "x-ratelimit-*-"+name, now, func(d time.Duration) string { return d.Round(time.Millisecond).String() })
		}
	}
}

// bucket is one limit: level of at most held, refilled at perSec;
// limit (per period, as announced) 0 is none.
type bucket struct {
	level  float64
	held   float64
	limit  int
	perSec float64
	at     time.Time
}

func (b *bucket) refill(now time.Time) {
	if b.limit == 0 {
		return
	}
	b.level = min(b.held, b.level+now.Sub(b.at).Seconds()*b.perSec)
	b.at = now
}

// has reports whether the bucket holds n at now (always, for none).
func (b *bucket) has(now time.Time, n float64) bool {
	b.refill(now)
	return b.limit == 0 || b.level >= n
}

func (b *bucket) take(n float64) {
	if b.limit > 0 {
		b.level -= n
	}
}

// wait is how long until the bucket holds n.
func (b *bucket) wait(now time.Time, n float64) time.Duration {
	b.refill(now)
	return time.Duration(max(n-b.level, 0) / b.perSec * float64(time.Second))
}

// share is the part of the limit left.
func (b *bucket) share() float64 { return b.level / b.held }

// write writes the bucket's limit, remaining and reset (the time until it
// is full again, as format writes it) under prefix, whose "*" (if any)
// is replaced by limit, remaining and reset, else suffixed with them.
func (b *bucket) write(h http.Header, prefix string, now time.Time, format func(time.Duration) string) {
	b.refill(now)
	name := func(field string) string {
		if strings.Contains(prefix, "*") {
			return strings.Replace(prefix, "*", field, 1)
		}
		return prefix + "-" + field
	}
	full := time.Duration((b.held - b.level) / b.perSec * float64(time.Second))
	h.Set(name("limit"), strconv.Itoa(b.limit))
	h.Set(name("remaining"), strconv.Itoa(max(int(b.level), 0)))
	h.Set(name("reset"), format(full))
}

// readAll reads a request body of at most 1 MiB.
func readAll(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r.Body, 1<<20+1))
	if err == nil && len(b) > 1<<20 {
		err = errInvalid("the body is over 1 MiB")
	}
	return b, err
}
