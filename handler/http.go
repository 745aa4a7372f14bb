package handler

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"

	"github.com/jobthrottle/jobthrottle/admission"
	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/internal/jsonpayload"
	"github.com/jobthrottle/jobthrottle/internal/llmusage"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// DefaultRetryAfter is how long a task is deferred when the upstream
// answers 429 or 503 without a Retry-After header (and no pause is
// running).
const DefaultRetryAfter = 5 * time.Second

// pausedTimeout bounds the look-up of a pause after a 429, which
// outlives the request's context.
const pausedTimeout = 2 * time.Second

// ExcerptLimit is how much of a rejected response's body goes into the
// task's error: 512 bytes.
const ExcerptLimit = 512

// httpHandler runs one http handler.
type httpHandler struct {
	spec    Spec
	url     *urlTemplate
	headers http.Header
	client  *http.Client
	log     *slog.Logger
	// rule, subject and lim are set when a rule limits the task type
	// (lim is nil otherwise):
	// a 429 or 503 pauses lim for the task's subject.
	rule    string
	subject rules.SubjectConfig
	lim     *throttle.Limiter
	costs   rules.RuleConfig // the rule's costs, which an LLM answer's usage settles (HTTPSpec.LLM)
	learner *providerLearner // binds the limits an LLM provider announces to the rule's; nil if none

	setCost  func(context.Context, int) error            // Options.SetCost
	setCosts func(context.Context, throttle.Costs) error // Options.SetCosts
}

// subjectKey carries a request's subject to the transport.
type subjectKey struct{}

func newHTTPHandler(s Spec, opts Options, log *slog.Logger) (*httpHandler, error) {
	u := s.HTTP.url
	if u == nil { // a Spec built in code rather than parsed
		var err error
		if u, err = parseURLTemplate(s.HTTP.URL); err != nil {
			return nil, fmt.Errorf("url %q: %w", s.HTTP.URL, err)
		}
	}
	h := &httpHandler{spec: s, url: u, headers: http.Header{}, log: log, setCost: opts.SetCost, setCosts: opts.SetCosts}
	for _, hd := range s.HTTP.Headers {
		v, err := expandEnv(hd.Value, opts.Getenv)
		if err != nil {
			return nil, fmt.Errorf("header %s: %w", hd.Name, err)
		}
		h.headers.Add(hd.Name, v)
	}
	base := opts.Base
	if base == nil {
		base = http.DefaultTransport.(*http.Transport).Clone()
	}
	rt := base
	if opts.Rules != nil {
		if rc, ok := opts.Rules.RuleFor(s.Task); ok {
			lim, err := opts.Rules.Limiter(opts.Redis, rc.Name, throttle.Options{Logger: log})
			if err != nil {
				return nil, err
			}
			tr, err := httpthrottle.New(lim, httpthrottle.Options{
				NoWait: true, // the middleware admitted the task
				// on a turn spaced at the upstream's learned rate
				// (throttle's Admit reads it): no departure while
				// nothing is learned.
				Paced: true,
				// A limit learned from the upstream may be slower than the
				// rule: wait for it in the slot no longer than the rule
				// lets a task wait (its default, if unset), else defer the
				// task.
				MaxLearnedWait: cmp.Or(rc.MaxWait, admission.DefaultMaxWait),
				Base:           base,
				Subject: func(req *http.Request) string {
					s, _ := req.Context().Value(subjectKey{}).(string)
					return s
				},
				OnPause: func(subject string, d time.Duration, err error) {
					if err != nil {
						log.Error("handler: the upstream asked to slow down, but the pause could not be recorded in Redis", "rule", rc.Name, "subject", subject, "pause", d, "error", err)
						return
					}
					log.Warn("handler: the upstream asked to slow down; every worker pauses", "rule", rc.Name, "subject", subject, "pause", d)
				},
			})
			if err != nil {
				return nil, err
			}
			opts.Metrics.learnsFrom(s.Task, rc.Name, tr.LearnedRate)
			h.rule, h.subject, h.lim, h.costs, rt = rc.Name, rc.Subject, lim, rc, tr
			if s.HTTP.LLM {
				h.learner = newProviderLearner(lim, rc, s.HTTP.LimitWindow, log)
			}
		}
	}
	h.client = &http.Client{
		Transport: rt,
		// A redirect could take the worker's headers to another host.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	return h, nil
}

// ProcessTask sends the task's request. A deferral for a task with no
// retry left would archive it, so such a task waits in its slot for the
// upstream's time instead, if its deadline allows, and tries again.
func (h *httpHandler) ProcessTask(ctx context.Context, task *asynq.Task) error {
	for {
		err := h.send(ctx, task)
		var te *admission.ThrottledError
		if !errors.As(err, &te) || !noRetryLeft(ctx) {
			return err
		}
		if dl, ok := ctx.Deadline(); ok && te.RetryAt.After(dl) {
			return err
		}
		t := time.NewTimer(time.Until(te.RetryAt))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

func (h *httpHandler) send(ctx context.Context, task *asynq.Task) error {
	target, err := h.url.expand(task)
	if err != nil {
		return payloadError(task, err)
	}
	subject := ""
	if h.lim != nil {
		if subject, err = h.subject.Of(task.Payload()); err != nil {
			return payloadError(task, err)
		}
		ctx = context.WithValue(ctx, subjectKey{}, subject)
		if w, ok := admission.WaitedFrom(ctx); ok && !w.At.IsZero() {
			// The turn may be the request's departure too (Admit books
			// it so at a learned upstream rate): sent on time, it needs
			// no departure of its own.
			ctx = httpthrottle.WithTurn(ctx, httpthrottle.Turn{At: w.At, Decided: time.Now().Add(-w.Duration)})
		}
		// A pause another worker recorded since the task's turn was
		// decided holds the request back in the transport (Options.Paced),
		// which reads it only for a request that leaves without a
		// departure: a read here would make every request late for its
		// departure by one round trip.
	}
	rctx, cancel := context.WithTimeout(ctx, h.spec.HTTP.Timeout)
	defer cancel()
	req, err := h.request(rctx, task, target)
	if err != nil {
		return payloadError(task, err)
	}
	what := h.spec.HTTP.Method + " " + h.url.origin
	resp, err := h.client.Do(req)
	var de *throttle.DelayError
	if errors.As(err, &de) {
		// The upstream's learned limit, or a pause, has no slot for this
		// request soon enough: nothing was sent; come back at its slot.
		return &admission.ThrottledError{Rule: h.rule, Subject: subject, RetryAt: time.Now().Add(de.RetryAfter), Err: de}
	}
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL may carry payload data; the origin says enough
		}
		if rctx.Err() != nil && ctx.Err() == nil {
			return &attemptError{outcome: OutcomeTimeout,
				err: fmt.Errorf("handler: %s: no answer within the timeout of %v; %s", what, h.spec.HTTP.Timeout, retryNote(ctx))}
		}
		return fmt.Errorf("handler: %s: %v; %s", what, err, retryNote(ctx))
	}
	defer resp.Body.Close()
	return h.answer(ctx, task, subject, what, resp)
}

// answer reads resp, the upstream's answer to the task's request (what:
// its method and origin), into the task's result or error.
func (h *httpHandler) answer(ctx context.Context, task *asynq.Task, subject, what string, resp *http.Response) error {
	read := max(h.spec.ResultLimit, ExcerptLimit)
	if h.spec.HTTP.LLM {
		read = max(read, llmAnswerLimit) // the usage is read from the whole answer
	}
	out, readErr := io.ReadAll(io.LimitReader(resp.Body, int64(read)+1))
	_, _ = io.CopyN(io.Discard, resp.Body, 64<<10) // let the connection be reused
	code := resp.StatusCode
	if h.learner != nil {
		h.learner.learn(ctx, subject, resp.Header)
	}
	switch {
	case code >= 200 && code < 300:
		if readErr != nil {
			return &attemptError{outcome: OutcomeError, status: code,
				err: fmt.Errorf("handler: %s: reading the answer: %v; %s", what, readErr, retryNote(ctx))}
		}
		if h.spec.HTTP.LLM && h.lim != nil { // a rule charged the call: settle it
			h.settleUsage(ctx, task, out)
		}
		return writeResult(task, out, h.spec.ResultLimit)
	case code == http.StatusTooManyRequests || code == http.StatusServiceUnavailable:
		return h.throttled(ctx, task, subject, resp, out)
	case code >= 500:
		return &attemptError{outcome: OutcomeHTTP5xx, status: code,
			err: fmt.Errorf("handler: %s answered %s: %s; %s", what, resp.Status, excerpt(out), retryNote(ctx))}
	default: // 3xx (not followed) and 4xx
		return &attemptError{outcome: OutcomeHTTP4xx, status: code,
			err: fmt.Errorf("handler: %s answered %s: %s; archived without retry: %w", what, resp.Status, excerpt(out), asynq.SkipRetry)}
	}
}

// request is the task's request to target: its payload as the body
// (but for GET), the file's headers, and its ID in the idempotency
// header.
func (h *httpHandler) request(ctx context.Context, task *asynq.Task, target string) (*http.Request, error) {
	var body io.Reader
	if h.spec.HTTP.Method != http.MethodGet {
		body = bytes.NewReader(task.Payload())
	}
	req, err := http.NewRequestWithContext(ctx, h.spec.HTTP.Method, target, body)
	if err != nil {
		return nil, err
	}
	req.Header = h.headers.Clone()
	if name, id := h.spec.HTTP.IdempotencyHeader, taskID(task); name != "" && id != "" {
		req.Header.Set(name, id)
	}
	if body != nil && req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	return req, nil
}

// throttled defers a task whose upstream asked to slow down, until the
// pause the transport recorded ends (or Retry-After, without a rule).
func (h *httpHandler) throttled(ctx context.Context, task *asynq.Task, subject string, resp *http.Response, body []byte) error {
	now := time.Now()
	wait := time.Duration(0)
	if h.lim != nil {
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pausedTimeout)
		if left, err := h.lim.PauseFor(pctx, subject, 0); err == nil {
			wait = left
		}
		cancel()
	}
	if wait <= 0 {
		date := now
		if d, err := http.ParseTime(resp.Header.Get("Date")); err == nil {
			date = d
		}
		// retry-after-ms (OpenAI's) if given, else Retry-After.
		if pl, ok := httpthrottle.ParseProviderHeaders(resp.Header, date); ok && pl.HasRetryAfter && pl.RetryAfter > 0 {
			wait = pl.RetryAfter
		}
	}
	if wait <= 0 {
		wait = DefaultRetryAfter
	}
	retryAt := now.Add(wait)
	h.log.Info("handler: deferred until the upstream's time", "task_id", taskID(task), "status", resp.StatusCode, "retry_at", retryAt.UTC().Format(time.RFC3339Nano))
	return &admission.ThrottledError{
		Rule: h.rule, Subject: subject, RetryAt: retryAt,
		Err: fmt.Errorf("handler: %s %s answered %s: %s", h.spec.HTTP.Method, h.url.origin, resp.Status, excerpt(body)),
	}
}

// excerpt is the start of a response body, for errors: at most
// ExcerptLimit bytes of valid UTF-8 on one line.
func excerpt(b []byte) string {
	if len(b) > ExcerptLimit {
		b = b[:ExcerptLimit]
		for len(b) > 0 && !utf8.Valid(b) {
			b = b[:len(b)-1]
		}
	}
	s := strings.Join(strings.Fields(strings.ToValidUTF8(string(b), "?")), " ")
	if s == "" {
		return "(empty body)"
	}
	return fmt.Sprintf("%q", s)
}

// expand fills the template's placeholders from task's payload: path
// values escaped as one path segment ("." and ".." refused), query values
// as query values. The scheme and host are the template's.
func (t *urlTemplate) expand(task *asynq.Task) (string, error) {
	var b strings.Builder
	b.WriteString(t.origin)
	for _, p := range t.parts {
		if p.field == "" {
			b.WriteString(p.literal)
			continue
		}
		v, err := jsonpayload.Field(task.Payload(), p.field)
		if err != nil {
			return "", fmt.Errorf("url: %v", err)
		}
		if p.query {
			b.WriteString(url.QueryEscape(v))
			continue
		}
		if v == "." || v == ".." {
			return "", fmt.Errorf("url: payload field %q is %q, which is not a path segment", p.field, v)
		}
		b.WriteString(url.PathEscape(v))
	}
	s := b.String()
	// Defence in depth: the origin cannot change.
	if u, err := url.Parse(s); err != nil || u.Scheme+"://"+u.Host != t.origin {
		return "", fmt.Errorf("url: the payload values do not make a URL under %s", t.origin)
	}
	return s, nil
}

// llmAnswerLimit is how much of an LLM answer an http handler with llm:
// true reads to find its usage: 4 MiB.
const llmAnswerLimit = 4 << 20

// settleUsage reports what the LLM call answered by out used, so that the
// middleware settles the task's turn to it when the handler returns: each
// limit of the rule whose cost is an estimate is given the answer's count
// of its kind (Options.SetCosts), the others keep their cost; a rule of
// one Cost that is an estimate is given its count (Options.SetCost). An
// answer without a usage is logged, and the estimates stay charged.
func (h *httpHandler) settleUsage(ctx context.Context, task *asynq.Task, out []byte) {
	u, err := h.spec.HTTP.Usage.parse(out)
	if err == nil {
		err = h.reportUsage(ctx, task.Payload(), u)
	}
	if err != nil {
		h.log.Warn("handler: cannot settle the call to its usage; its estimates stay charged", "task_id", taskID(task), "rule", h.rule, "error", err)
	}
}

// reportUsage reports usage u of a task whose payload is payload under
// the handler's rule; nothing for a rule without an estimate.
func (h *httpHandler) reportUsage(ctx context.Context, payload []byte, u llmusage.Usage) error {
	rc := h.costs
	if rc.LimitCosts == nil {
		if n, ok := rc.Cost.Used(u); ok && h.setCost != nil {
			return h.setCost(ctx, n)
		}
		return nil
	}
	if h.setCosts == nil {
		return nil
	}
	costs := make(throttle.Costs, len(rc.Limits))
	for i := range rc.Limits {
		c := rc.LimitCost(i)
		n, ok := c.Used(u)
		if !ok {
			var err error
			if n, err = c.Of(payload); err != nil {
				return err
			}
		}
		costs[i] = n
	}
	return h.setCosts(ctx, costs)
}
