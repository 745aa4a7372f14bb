package main

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/throttle"
)

// pipelined is a prototype for the Allow throughput part only: does
// auto-pipelining beat redis_rate? Both libraries make one EVALSHA per
// Allow, and on this machine the client's CPU is mostly go-redis's write
// and read syscalls per command, and the server's per-command network
// handling a large part of its own. Here concurrent Allow calls on one
// client are collected and sent together as one go-redis pipeline (many
// EVALSHAs in one write, their replies read together), without delaying a
// call that is not concurrent: a sender that is idle sends at once; while
// every sender is in flight, calls queue, and a sender that returns sends
// everything queued as its next batch.
//
// The decision is the library's own: the same GCRA driver script text,
// keys and arguments as a one-rule jobthrottle/gcra limiter's Allow
// (throttle/limiter.go: request). The library does not batch (yet); this
// measures what it would gain before anyone changes throttle/.
type pipelined struct {
	rdb    redis.UniversalClient
	script *redis.Script
	args   []any // every call's ARGV; go-redis copies them into each command, so they are shared
	queue  chan *pipeReq
	stop   chan struct{}
}

// pipeReq is one queued Allow: its Redis key and where its answer goes
// (buffered, so that a sender never blocks on a caller that gave up).
type pipeReq struct {
	key  string
	done chan pipeResult
}

type pipeResult struct {
	ok  bool
	err error
}

var pipeReqs = sync.Pool{New: func() any { return &pipeReq{done: make(chan pipeResult, 1)} }}

const (
	// pipelineSenders is K, the goroutines that send batches, sharing one
	// queue (go-redis's pool has 10 × GOMAXPROCS connections). Measured in
	// the throughput part (50 callers, 10 000 keys, 2 cores shared with
	// redis-server; 2026-11-21, two runs of 5 interleaved rounds), median
	// Allow/s: K=1 98 900 and 95 000, K=2 120 000 and 119 400, K=4 123 600
	// and 125 200 (above K=2 in 8 of the 10 rounds), K=8 122 300 (second
	// run only). One sender leaves the callers idle for a whole round trip
	// while its batch (about 25 calls) is out; more senders overlap batches
	// (about 9 calls each at K=4), and past 4 the extra round trips cost
	// more than the overlap gains.
	pipelineSenders = 4
	// pipelineMaxBatch caps one pipeline's EVALSHAs.
	pipelineMaxBatch = 256
	// pipelinePrefix and pipelineRule make the keys
	// <prefix>{<encoded subject>}:<rule>, as the library does
	// (throttle/keys.go); the rule name is safe ASCII, so it needs no
	// escaping.
	pipelinePrefix = "jt:gcra-pipelined:"
	pipelineRule   = "r"
)

// pipelineScriptFiles are the library's GCRA script for a limiter of one
// algorithm. This must match throttle/scripts.go: buildScript("prelude.lua",
// "gcra.lua", "use_gcra.lua", "driver.lua"), each file followed by "\n".
var pipelineScriptFiles = []string{"prelude.lua", "gcra.lua", "use_gcra.lua", "driver.lua"}

// gcraScriptText reads the library's GCRA script from ../throttle/lua (the
// bench runs from bench/; main.go insists on it).
func gcraScriptText() (string, error) {
	var b strings.Builder
	for _, f := range pipelineScriptFiles {
		src, err := os.ReadFile("../throttle/lua/" + f)
		if err != nil {
			return "", err
		}
		b.Write(src)
		b.WriteByte('\n')
	}
	return b.String(), nil
}

// newPipelined loads the script and starts senders senders for a GCRA
// limit of r per second with burst burst.
func newPipelined(rdb redis.UniversalClient, r, burst, senders int) (*pipelined, error) {
	src, err := gcraScriptText()
	if err != nil {
		return nil, err
	}
	p := &pipelined{
		rdb:    rdb,
		script: redis.NewScript(src),
		// As throttle.Limiter.request builds them for Allow and one rule:
		// op, n, max wait (-1: no bound), then the rule's algorithm,
		// count, period µs, extra (burst) and refund ticket.
		args:  []any{"allow", 1, int64(-1), "gcra", r, int64(1_000_000), int64(burst), ""},
		queue: make(chan *pipeReq, 4*pipelineMaxBatch),
		stop:  make(chan struct{}),
	}
	if err := p.script.Load(context.Background(), rdb).Err(); err != nil {
		return nil, err
	}
	for range senders {
		go p.send()
	}
	return p, nil
}

// Close stops the senders once their batches are done. Calls made after
// it wait for their ctx.
func (p *pipelined) Close() { close(p.stop) }

// Allow queues one decision for subject and waits for its answer.
func (p *pipelined) Allow(ctx context.Context, subject string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	// The throughput part's subjects are not all safe bytes ("tp-…:123":
	// ':' is written %3A), so they are encoded as the library does, which
	// also costs what it costs the library.
	enc, err := throttle.EncodeSubject(subject)
	if err != nil {
		return false, err
	}
	r := pipeReqs.Get().(*pipeReq)
	r.key = pipelinePrefix + "{" + enc + "}:" + pipelineRule
	select {
	case p.queue <- r:
	case <-ctx.Done():
		pipeReqs.Put(r)
		return false, ctx.Err()
	}
	select {
	case res := <-r.done:
		pipeReqs.Put(r)
		return res.ok, res.err
	case <-ctx.Done():
		// r stays with the sender, whose answer lands in its buffer; it
		// is not reused.
		return false, ctx.Err()
	}
}

var errNoWait = errors.New("bench: this prototype has no Wait")

// Wait is not part of the prototype; the throughput part only allows.
func (p *pipelined) Wait(context.Context, string) error { return errNoWait }

// send takes everything queued (at least one call, up to
// pipelineMaxBatch) and runs it as one pipeline, until Close.
func (p *pipelined) send() {
	batch := make([]*pipeReq, 0, pipelineMaxBatch)
	for {
		select {
		case r := <-p.queue:
			batch = append(batch[:0], r)
		case <-p.stop:
			return
		}
	fill:
		for len(batch) < pipelineMaxBatch {
			select {
			case r := <-p.queue:
				batch = append(batch, r)
			default:
				break fill
			}
		}
		p.run(batch)
	}
}

// run decides a batch and answers each caller. Commands that met NOSCRIPT
// (Redis lost the script: nothing ran) are retried once after SCRIPT LOAD;
// the others are not, since they were charged.
func (p *pipelined) run(batch []*pipeReq) {
	ctx := context.Background()
	cmds := p.exec(ctx, batch)
	var retry []*pipeReq
	var at []int
	for i, c := range cmds {
		if err := c.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			retry, at = append(retry, batch[i]), append(at, i)
		}
	}
	if len(retry) > 0 {
		p.script.Load(ctx, p.rdb) // a failure shows in the retry's errors
		for j, c := range p.exec(ctx, retry) {
			cmds[at[j]] = c
		}
	}
	for i, r := range batch {
		r.done <- allowed(cmds[i])
	}
}

// exec sends one EVALSHA per call in one pipeline. go-redis sets every
// command's error if the pipeline fails as a whole.
func (p *pipelined) exec(ctx context.Context, batch []*pipeReq) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(batch))
	sha := p.script.Hash()
	_, _ = p.rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, r := range batch {
			cmds[i] = pipe.EvalSha(ctx, sha, []string{r.key}, p.args...)
		}
		return nil
	})
	return cmds
}

// allowed reads the driver's reply {ok, decider, remaining, delay µs,
// reset µs, Redis now, ticket...}: ok = 1 is allowed.
func allowed(c *redis.Cmd) pipeResult {
	reply, err := c.Slice()
	if err != nil {
		return pipeResult{err: err}
	}
	if len(reply) == 0 {
		return pipeResult{err: errors.New("bench: empty driver reply")}
	}
	ok, _ := reply[0].(int64)
	return pipeResult{ok: ok == 1}
}
