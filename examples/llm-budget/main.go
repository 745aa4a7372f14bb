// Command llm-budget drains a batch of LLM calls against an API with a
// hidden requests limit and tokens limit, with zero 429s and the tokens
// limit nearly full. Each call's real token count is known only from the
// answer: a task reserves an estimate (its prompt plus its max_tokens, an
// upper bound) beside one request, both limits decided in one call, the
// handler reports the real count with worker.SetCosts, and the middleware
// settles the difference back into the shared ledger.
//
//	go run ./examples/llm-budget
//
// No Redis is needed: it starts an in-memory one on loopback. The limits
// are those of a 1-minute tier scaled down to 10 seconds, so the batch
// drains in about 20 seconds.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/internal/devredis"
	"github.com/jobthrottle/jobthrottle/throttle"
	"github.com/jobthrottle/jobthrottle/worker"
)

// config is one run: the API's hidden limits, the batch, the workers.
type config struct {
	Tasks       int           // LLM calls in the batch
	Requests    int           // the API's requests per Period
	Tokens      int           // the API's tokens per Period
	Period      time.Duration // both limits refill over it
	Latency     time.Duration // how long the API takes to answer, at most
	Servers     int           // asynq worker servers (processes, in real life)
	Concurrency int           // each server's worker slots
	Seed        uint64        // the batch's prompts and answers
}

// defaults: 60 requests and 20,000 tokens per 10 s, 150 calls of 100 to
// 300 prompt tokens and max_tokens 400 (answers of 50 to 400 tokens).
var defaults = config{
	Tasks: 150, Requests: 60, Tokens: 20000, Period: 10 * time.Second,
	Latency: 300 * time.Millisecond, Servers: 2, Concurrency: 3, Seed: 42,
}

// result is what a run measured.
type result struct {
	Requests      int           // calls the API answered 200
	Rejected      int           // calls it answered 429
	Tokens        int           // tokens the answered calls used
	Estimated     int           // tokens the tasks reserved before settling
	Span          time.Duration // from the first call to the last
	Burst         int           // the workers' token burst (the most taken at once)
	TokensPerSec  float64       // the API's token rate limit
	Rate          float64       // Tokens / Span per second, as a share of TokensPerSec (the opening burst can lift it past 1)
	Utilization   float64       // Tokens / (Burst + TokensPerSec × Span): the share of what the workers' limit allowed
	WithoutSettle float64       // Utilization if each call had used its estimate: what pacing by estimates alone reaches
}

func main() {
	log.SetFlags(0)
	cfg := defaults
	fmt.Printf("llm-budget: %d LLM calls against an API allowing %d requests and %d tokens per %v (hidden: it answers 429 when over).\n",
		cfg.Tasks, cfg.Requests, cfg.Tokens, cfg.Period)
	fmt.Printf("Each task reserves its prompt + max_tokens, and settles to the tokens the answer reports.\n\n")
	res, err := run(context.Background(), cfg, os.Stdout)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("\nrequests %d, tokens %d (estimated %d), 429s %d, in %.1fs\n", res.Requests, res.Tokens, res.Estimated, res.Rejected, res.Span.Seconds())
	fmt.Printf("tokens per second: %.0f, %.1f%% of the limit's %.0f\n", res.Rate*res.TokensPerSec, 100*res.Rate, res.TokensPerSec)
	fmt.Printf("token limit used: %.1f%% of what it allowed in %.1fs (a burst of %d, then %.0f/s); paced by the estimates alone: %.1f%%\n",
		100*res.Utilization, res.Span.Seconds(), res.Burst, res.TokensPerSec, 100*res.WithoutSettle)
	if res.Rejected > 0 || res.Requests != cfg.Tasks {
		os.Exit(1)
	}
}

// run drains one batch and reports what the API saw; progress lines go to
// out every Period.
func run(ctx context.Context, cfg config, out io.Writer) (result, error) {
	dev, err := devredis.Start("127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	defer dev.Close()

	api := newFakeAPI(cfg)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	hs := &http.Server{Handler: api}
	go hs.Serve(ln)
	defer hs.Close()
	url := "http://" + ln.Addr().String() + "/v1/chat"

	// The workers know the published limits. Tokens: a GCRA at the API's
	// rate whose burst is 3 seconds of it, inside the API's own (a whole
	// period), so arrivals that jitter never bunch past it; and
	// larger than the estimates of the calls in flight at once, so that a
	// settle can give back what a call did not use even with the calls
	// behind it already booked (throttle.Reservation.Settle). Requests:
	// the same rate shape, a second of burst.
	tokensPerSec := float64(cfg.Tokens) / cfg.Period.Seconds()
	burst := int(3 * tokensPerSec)
	tokenRule := throttle.Rule{Name: "tpm", Algorithm: throttle.GCRA,
		Limit: throttle.Limit{Count: cfg.Tokens, Period: cfg.Period}.WithBurst(burst)}
	requestRule := throttle.Rule{Name: "rpm", Algorithm: throttle.GCRA,
		Limit: throttle.Limit{Count: cfg.Requests, Period: cfg.Period}.WithBurst(max(1, cfg.Requests*int(time.Second)/int(cfg.Period)))}

	var mu sync.Mutex
	estimated, done := 0, 0
	finished := make(chan struct{})
	var srvs []*asynq.Server
	for range cfg.Servers {
		rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
		defer rdb.Close()
		// One policy of two limits of different costs: a request (1 per
		// call) and tokens (an estimate, settled by the handler), decided
		// in one call (worker.TaskRule.Costs, in the order of the rules).
		lim, err := throttle.New(rdb, throttle.Options{Prefix: "llm:"}, requestRule, tokenRule)
		if err != nil {
			return result{}, err
		}
		//
		// The tasks wait for their turns in their worker slots (MaxWait,
		// WaitSlots): a batch this short (seconds) is drained fastest
		// that way, each task taking its turn when a slot frees, on a
		// ledger the calls before it have settled. A long backlog may
		// park instead (the default Settings): turns are then booked only
		// within the horizon, so what a settle gives back moves the
		// tokens' schedule back and the tasks served after it use it
		// (worker/README.md, costs known only afterwards).
		mw, err := worker.NewMiddleware([]worker.TaskRule{{
			Name: "llm", Tasks: []string{"llm:*"}, Limiter: lim, Subject: worker.Fixed("llm-api"),
			Costs: costs, Settings: admission.Settings{MaxWait: time.Minute, WaitSlots: cfg.Concurrency},
		}}, worker.Options{Logger: quietLogger(), Asynq: rdb})
		if err != nil {
			return result{}, err
		}
		defer mw.Drain()

		mux := asynq.NewServeMux()
		mux.Use(mw.Wrap)
		client := &http.Client{Timeout: 10 * time.Second}
		mux.HandleFunc("llm:chat", func(ctx context.Context, t *asynq.Task) error {
			used, err := call(ctx, client, url, t.Payload())
			if err != nil {
				return err
			}
			// The real cost, known only now: settled when this returns.
			if err := worker.SetCosts(ctx, throttle.Costs{1, used}); err != nil {
				return err
			}
			est, _ := estimate(t)
			mu.Lock()
			defer mu.Unlock()
			estimated += est
			if done++; done == cfg.Tasks {
				close(finished)
			}
			return nil
		})
		srv := asynq.NewServerFromRedisClient(rdb, worker.Configure(asynq.Config{
			Concurrency: cfg.Concurrency,
			LogLevel:    asynq.ErrorLevel,
		}))
		if err := srv.Start(mux); err != nil {
			return result{}, err
		}
		srvs = append(srvs, srv)
	}
	defer func() {
		for _, srv := range srvs {
			srv.Shutdown()
		}
	}()

	rdb := redis.NewClient(&redis.Options{Addr: dev.Addr()})
	defer rdb.Close()
	client := asynq.NewClientFromRedisClient(rdb)
	defer client.Close()
	rng := rand.New(rand.NewPCG(cfg.Seed, 1))
	for i := range cfg.Tasks {
		p := prompt{ID: i, PromptTokens: 100 + rng.IntN(201), MaxTokens: 400, Answer: 50 + rng.IntN(351)}
		payload, _ := json.Marshal(p)
		if _, err := client.Enqueue(asynq.NewTask("llm:chat", payload), asynq.Retention(time.Hour)); err != nil {
			return result{}, err
		}
	}

	tick := time.NewTicker(cfg.Period)
	defer tick.Stop()
	timeout := time.After(time.Duration(3*cfg.Tasks) * time.Second)
wait:
	for {
		select {
		case <-finished:
			break wait
		case <-tick.C:
			s := api.snapshot()
			fmt.Fprintf(out, "  %5.1fs: %3d requests, %6d tokens, %d 429s\n", time.Since(s.first).Seconds(), s.requests, s.tokens, s.rejected)
		case <-timeout:
			return result{}, errors.New("llm-budget: the batch did not drain in time")
		case <-ctx.Done():
			return result{}, ctx.Err()
		}
	}
	s := api.snapshot()
	mu.Lock()
	defer mu.Unlock()
	r := result{Requests: s.requests, Rejected: s.rejected, Tokens: s.tokens, Estimated: estimated,
		Span: s.last.Sub(s.first), Burst: burst, TokensPerSec: tokensPerSec}
	if r.Span > 0 {
		r.Rate = float64(r.Tokens) / r.Span.Seconds() / tokensPerSec
		r.Utilization = float64(r.Tokens) / (float64(burst) + tokensPerSec*r.Span.Seconds())
		r.WithoutSettle = r.Utilization * float64(r.Tokens) / float64(r.Estimated)
	}
	return r, nil
}

// prompt is a task's payload. Answer is how many tokens the fake API will
// answer with: the task cannot know it (a real API decides); only the
// answer's usage says.
type prompt struct {
	ID           int `json:"id"`
	PromptTokens int `json:"prompt_tokens"`
	MaxTokens    int `json:"max_tokens"`
	Answer       int `json:"answer"`
}

// costs is the rule's Costs: one request, and the tokens' estimate.
func costs(t *asynq.Task) (throttle.Costs, error) {
	est, err := estimate(t)
	return throttle.Costs{1, est}, err
}

// estimate is the tokens a call reserves: the prompt plus max_tokens, an
// upper bound of what the call can use.
func estimate(t *asynq.Task) (int, error) {
	var p prompt
	if err := json.Unmarshal(t.Payload(), &p); err != nil {
		return 0, err
	}
	return p.PromptTokens + p.MaxTokens, nil
}

// call sends one prompt and returns the tokens the answer used.
func call(ctx context.Context, client *http.Client, url string, payload []byte) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytesReader(payload))
	if err != nil {
		return 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("llm-budget: the API answered %s", resp.Status)
	}
	var body struct {
		Usage struct {
			TotalTokens int `json:"total_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return 0, err
	}
	return body.Usage.TotalTokens, nil
}

// quietLogger hides the middleware's debug and info lines.
func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
