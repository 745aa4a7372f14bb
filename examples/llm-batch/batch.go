package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/jobthrottle/jobthrottle/internal/llmfake"
	"github.com/jobthrottle/jobthrottle/internal/llmusage"
	"github.com/jobthrottle/jobthrottle/rules"
)

// sentences make the prompts: each call asks for a one-line summary of
// some of them, so that prompts differ in length (150 to 400 tokens).
var sentences = []string{
	"The workers share one limit through Redis, so ten processes never send more than the provider allows.",
	"A task whose turn is far away leaves its worker slot and comes back when its turn is due.",
	"Each call is charged one request, its input tokens and its output tokens in a single decision.",
	"The input is estimated from the request's messages, the output from its max_tokens.",
	"When the answer arrives, its usage replaces the estimates, and what was not used serves the next call.",
	"A provider answers 429 when any of its limits is exceeded, and every worker then slows down.",
	"Limits differ by account tier and change over time, which is why the headers are worth reading.",
}

// enqueue enqueues cfg.Calls chat requests at once.
func enqueue(rdb *redis.Client, cfg config) error {
	client := asynq.NewClientFromRedisClient(rdb)
	for i := range cfg.Calls {
		var b strings.Builder
		b.WriteString("Summarize in one short sentence:")
		for j := range 6 + i%13 {
			b.WriteString(" " + sentences[(i+j)%len(sentences)])
		}
		payload, err := json.Marshal(map[string]any{"model": cfg.Model, "max_tokens": cfg.MaxTokens,
			"messages": []map[string]string{{"role": "user", "content": b.String()}}})
		if err != nil {
			return err
		}
		if _, err := client.Enqueue(asynq.NewTask("llm:"+string(cfg.Style), payload), asynq.Retention(time.Hour)); err != nil {
			return err
		}
	}
	return nil
}

// wait waits until every call is done, printing progress every 2
// seconds; a call archived (failed for good) ends the wait with its
// error.
func wait(ctx context.Context, rdb *redis.Client, cfg config, out io.Writer, start time.Time) error {
	in := asynq.NewInspectorFromRedisClient(rdb)
	end := time.After(cfg.Timeout)
	poll, report := time.NewTicker(100*time.Millisecond), time.NewTicker(2*time.Second)
	defer poll.Stop()
	defer report.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-end:
			return fmt.Errorf("llm-batch: the batch did not finish within %v", cfg.Timeout)
		case <-report.C:
			if q, err := in.GetQueueInfo("default"); err == nil {
				fmt.Fprintf(out, "  %4.1fs: %3d done, %3d parked, %3d waiting or running\n",
					time.Since(start).Seconds(), q.Completed, q.Scheduled+q.Retry, q.Pending+q.Active)
			}
		case <-poll.C:
			q, err := in.GetQueueInfo("default")
			if err != nil {
				continue
			}
			if q.Archived > 0 {
				return archived(in)
			}
			if q.Completed >= cfg.Calls {
				return nil
			}
		}
	}
}

// archived is the error of the first archived task.
func archived(in *asynq.Inspector) error {
	tasks, err := in.ListArchivedTasks("default", asynq.PageSize(1))
	if err != nil || len(tasks) == 0 {
		return fmt.Errorf("llm-batch: a call failed for good")
	}
	return fmt.Errorf("llm-batch: a call failed for good: %s", tasks[0].LastErr)
}

// result is what a run measured.
type result struct {
	Completed     int           // calls done
	Input, Output int           // tokens, from the answers' usage
	Span          time.Duration // enqueue to the last call done
	Fake          bool          // the provider was the fake: the rest is its view
	Answered      int           // calls the fake answered 200
	Rejected      int           // calls it answered 429
	Used          [3]float64    // share of requests, input and output tokens allowed that the calls used
	Binding       string        // the limit whose share is the highest
}

// measure reads what the answers used, and what the fake saw.
func measure(rdb *redis.Client, cfg config, rc *rules.Config, fake *llmfake.Provider, start time.Time) (*result, error) {
	tasks, err := asynq.NewInspectorFromRedisClient(rdb).ListCompletedTasks("default", asynq.PageSize(cfg.Calls))
	if err != nil {
		return nil, err
	}
	r := &result{Completed: len(tasks)}
	for _, t := range tasks {
		if u, err := llmusage.Parse(t.Result); err == nil {
			r.Input += u.Input
			r.Output += u.Output
		}
		r.Span = max(r.Span, t.CompletedAt.Sub(start))
	}
	if fake == nil {
		return r, nil
	}
	s := fake.Stats()
	r.Fake, r.Answered, r.Rejected = true, s.Answered, s.Rejected
	span := s.Last.Sub(s.First).Seconds()
	most := -1.0
	for i, l := range rc.Rules[0].Limits {
		// What the limit allowed from the first call to the last: its
		// burst, then its rate.
		allowed := float64(l.Limit.Burst) + float64(l.Limit.Count)/l.Limit.Period.Seconds()*span
		r.Used[i] = float64([3]int{s.Answered, s.Input, s.Output}[i]) / allowed
		if r.Used[i] > most {
			most, r.Binding = r.Used[i], l.Name
		}
	}
	return r, nil
}

// print writes the result.
func (r *result) print(out io.Writer) {
	fmt.Fprintf(out, "\n%d calls done in %.1fs: %d input and %d output tokens (from the answers' usage)\n",
		r.Completed, r.Span.Seconds(), r.Input, r.Output)
	if !r.Fake {
		return
	}
	fmt.Fprintf(out, "the provider answered %d calls and refused %d with 429\n", r.Answered, r.Rejected)
	fmt.Fprintf(out, "share of what each limit allowed (its burst, then its rate): requests %.0f%%, input %.0f%%, output %.0f%%; %s binds\n",
		100*r.Used[0], 100*r.Used[1], 100*r.Used[2], r.Binding)
}
