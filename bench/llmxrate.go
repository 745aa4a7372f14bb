package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/hibiken/asynq"
	"golang.org/x/time/rate"

	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/internal/llmusage"
)

// xrateWorker is the best a user has today without a shared limit: in
// each worker process, an x/time/rate limiter per provider limit at its
// share of it (1/Servers of the rate and of the window's worth of burst),
// each call waiting for its estimates (the input's bytes / 4, max_tokens)
// before it is sent; nothing is settled, nothing learned, and a 429 is
// retried a second later.
type xrateWorker struct {
	url                     string
	client                  *http.Client
	requests, input, output *rate.Limiter // nil: no such limit
}

func newXRateWorker(cfg llmProviderConfig, style llmfake.Style, base string) *xrateWorker {
	share := func(n int) *rate.Limiter {
		if n == 0 {
			return nil
		}
		per := float64(n) / float64(cfg.Servers)
		return rate.NewLimiter(rate.Limit(per/cfg.Period.Seconds()), int(per))
	}
	w := &xrateWorker{client: &http.Client{Timeout: 10 * time.Second}, requests: share(cfg.Requests)}
	if style == llmfake.OpenAI {
		w.url = base + "/v1/chat/completions"
		w.input = share(cfg.Tokens)
		w.output = w.input // one limit of both
	} else {
		w.url = base + "/v1/messages"
		w.input, w.output = share(cfg.Input), share(cfg.Output)
	}
	return w
}

// ProcessTask waits for the call's estimates, then sends it.
func (w *xrateWorker) ProcessTask(ctx context.Context, t *asynq.Task) error {
	in, err := llmusage.EstimateInput(t.Payload())
	if err != nil {
		return err
	}
	out, err := llmusage.MaxTokens(t.Payload())
	if err != nil {
		return err
	}
	if err := w.requests.Wait(ctx); err != nil {
		return err
	}
	if w.input == w.output {
		err = w.input.WaitN(ctx, in+out)
	} else if err = w.input.WaitN(ctx, in); err == nil {
		err = w.output.WaitN(ctx, out)
	}
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.url, bytes.NewReader(t.Payload()))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer k")
	req.Header.Set("X-Api-Key", "k")
	resp, err := w.client.Do(req)
	if err != nil {
		return err
	}
	defer discard(resp)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("bench: the provider answered %s", resp.Status)
	}
	return nil
}
