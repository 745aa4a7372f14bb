package handler

import (
	"cmp"
	"context"
	"log/slog"
	"maps"
	"math"
	"math/big"
	"net/http"
	"sync"
	"time"

	"github.com/jobthrottle/jobthrottle/httpthrottle"
	"github.com/jobthrottle/jobthrottle/rules"
	"github.com/jobthrottle/jobthrottle/throttle"
)

// DefaultLimitWindow is the window of an LLM provider's announced limits
// when limit_window is not set: a minute, as OpenAI and Anthropic count
// their requests and tokens.
const DefaultLimitWindow = time.Minute

// learnTimeout bounds the recording of a lesson, which outlives the
// task's context.
const learnTimeout = 2 * time.Second

// maxLearnedSubjects bounds the subjects a providerLearner remembers the
// last lesson of; past it, it forgets them all and records each again.
const maxLearnedSubjects = 1024

// providerLearner binds the limits an LLM provider announces in its
// headers (httpthrottle.ParseProviderHeaders) to the limits of an http
// handler's rule that count the same thing: the provider's requests
// limit to the limit whose cost is one per task, its input-token limit
// to the limit whose cost is the input estimate, and so on (its token
// limit, input and output together, to a total_tokens limit, and to an
// input or output one where the provider names none of its own). Each is
// recorded for the fleet (throttle.Limiter.LearnLimits) at
// throttle.LearnedShare of the announced rate, with a burst of as much,
// so that Admit paces the rule at it where it is slower than configured,
// and with as much of what the provider says is left, which caps what
// the rule has available then. A limit configured at or below the
// announced one (the file has the provider's limits) is trusted: it is
// recorded at the announced rate, which does not tighten it, since the
// rule settles each call to its usage and needs no margin below a limit
// it was told (at 95 %, the configured run used 92-94 % of the provider's
// limit, issue 23); only what is left is still taken at LearnedShare. A
// lesson is sent to Redis when its limits differ from the last one this
// process sent for the subject, and, so that a budget spent by other
// clients of the same key shows as fewer admissions rather than as 429s,
// when the provider says less than half of a limit is left (only then can
// the cap bind before the provider refuses): at most once per
// window/leftEvery per subject, and, while every answer finds little
// left, twice as seldom after each such lesson, down to twice a window
// (a fleet that keeps its provider busy on its own hears the same from
// every answer: the cap does not bind it); an answer with more than half
// left starts again at window/leftEvery. At most one Redis call per
// answer, and a bounded number per process and window.
type providerLearner struct {
	lim    *throttle.Limiter
	rule   string
	names  []string         // the rule's limits' names (throttle.Rule.Name)
	kinds  []costKind       // what each of them counts
	conf   []throttle.Limit // each one's configured limit
	window time.Duration    // the provider's window
	log    *slog.Logger

	mu     sync.Mutex
	last   map[string]map[string]throttle.LearnedLimit // by subject
	leftAt map[string]leftSent                         // by subject: what is left, last sent
}

// leftEvery bounds how often a process sends what the provider says is
// left of a subject's limits, when nothing else changed: leftEvery times
// per window (every 3 s for a minute's) at most.
const leftEvery = 20

// leftSent is when a process last sent what is left of a subject's
// limits, and how long it waits before it sends it again.
type leftSent struct {
	at  time.Time
	gap time.Duration
}

// costKind is what a limit of a rule counts, as a provider's headers name
// it.
type costKind int

const (
	kindOther costKind = iota // nothing a provider announces
	kindRequests
	kindInput
	kindOutput
	kindTotal
)

// newProviderLearner returns the learner of rule rc's limits, or nil if
// none of them counts what a provider announces.
func newProviderLearner(lim *throttle.Limiter, rc rules.RuleConfig, window time.Duration, log *slog.Logger) *providerLearner {
	p := &providerLearner{lim: lim, rule: rc.Name, window: cmp.Or(window, DefaultLimitWindow), log: log,
		last: map[string]map[string]throttle.LearnedLimit{}, leftAt: map[string]leftSent{}}
	some := false
	for i, l := range rc.Limits {
		k := kindOf(rc.LimitCost(i))
		p.names, p.kinds, p.conf = append(p.names, l.Name), append(p.kinds, k), append(p.conf, l.Limit)
		some = some || k != kindOther
	}
	if !some {
		return nil
	}
	return p
}

// kindOf is what a limit whose cost is c counts.
func kindOf(c rules.CostConfig) costKind {
	switch {
	case c.Estimate == rules.EstimateInput:
		return kindInput
	case c.Estimate == rules.EstimateOutput:
		return kindOutput
	case c.Estimate == rules.EstimateTotal:
		return kindTotal
	case c.PayloadField == "" && c.Permits <= 1:
		return kindRequests
	}
	return kindOther
}

// limits are the rule's limits that the headers h bind, by name.
func (p *providerLearner) limits(h http.Header, now time.Time) map[string]throttle.LearnedLimit {
	pl, ok := httpthrottle.ParseProviderHeaders(h, now)
	if !ok {
		return nil
	}
	out := map[string]throttle.LearnedLimit{}
	for i, k := range p.kinds {
		var l httpthrottle.ProviderLimit
		switch k {
		case kindRequests:
			l = pl.Requests
		case kindInput:
			l = pl.InputTokens
		case kindOutput:
			l = pl.OutputTokens
		}
		if l.Limit <= 0 && k != kindRequests && k != kindOther {
			l = pl.Tokens // OpenAI's: input and output together
		}
		if l.Limit <= 0 {
			continue
		}
		share := func(n int) int { return int(math.Floor(float64(n) * throttle.LearnedShare)) }
		c := max(share(l.Limit), 1)
		if p.trusts(i, l.Limit) {
			c = l.Limit
		}
		out[p.names[i]] = throttle.LearnedLimit{Limit: throttle.Limit{Count: c, Period: p.window, Burst: c},
			Remaining: max(share(l.Remaining), 0), HasRemaining: l.HasRemaining}
	}
	return out
}

// trusts reports whether limit i of the rule is configured at or below
// announced per window (its rate and its burst): the file has the
// provider's limit, which needs no margin.
func (p *providerLearner) trusts(i, announced int) bool {
	c := p.conf[i]
	if c.Count <= 0 || c.Period <= 0 {
		return false
	}
	// count / period <= announced / window, exactly
	rate := new(big.Int).Mul(big.NewInt(int64(c.Count)), big.NewInt(int64(p.window)))
	return rate.Cmp(new(big.Int).Mul(big.NewInt(int64(announced)), big.NewInt(int64(c.Period)))) <= 0 && c.Burst <= announced
}

// sameLimits reports whether a and b learned the same limits, whatever
// they say is left.
func sameLimits(a, b map[string]throttle.LearnedLimit) bool {
	return maps.EqualFunc(a, b, func(x, y throttle.LearnedLimit) bool { return x.Limit == y.Limit })
}

// lowLeft reports whether the provider says less than half of one of
// the limits learned is left.
func lowLeft(learned map[string]throttle.LearnedLimit) bool {
	for _, l := range learned {
		if l.HasRemaining && l.Remaining < l.Limit.Count/2 {
			return true
		}
	}
	return false
}

// due reports whether a lesson learned of subject now is to be sent,
// and if so records it as sent (see providerLearner). p.mu is held.
func (p *providerLearner) due(subject string, learned map[string]throttle.LearnedLimit, now time.Time) bool {
	base := p.window / leftEvery
	left, low := p.leftAt[subject], lowLeft(learned)
	switch {
	case !sameLimits(p.last[subject], learned):
		left.gap = max(left.gap, base)
	case !low:
		if left.gap > base {
			left.gap = base
			p.leftAt[subject] = left
		}
		return false
	case now.Sub(left.at) < left.gap:
		return false
	default:
		left.gap = min(2*max(left.gap, base), p.window/2)
	}
	if len(p.last) >= maxLearnedSubjects {
		clear(p.last)
		clear(p.leftAt)
	}
	left.at = now
	p.last[subject], p.leftAt[subject] = learned, left
	return true
}

// learn records for subject what the answer's headers h say of the
// provider's limits, if that differs from the last lesson this process
// recorded for it, or if little is left of a limit and this process has
// not said so for a while (see providerLearner). A failure is logged:
// the rule's own limits still hold.
func (p *providerLearner) learn(ctx context.Context, subject string, h http.Header) {
	now := time.Now()
	learned := p.limits(h, now)
	if len(learned) == 0 {
		return
	}
	p.mu.Lock()
	if !p.due(subject, learned, now) {
		p.mu.Unlock()
		return
	}
	p.mu.Unlock()
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), learnTimeout)
	defer cancel()
	if err := p.lim.LearnLimits(lctx, subject, learned); err != nil {
		p.mu.Lock()
		delete(p.last, subject) // try again with the next answer
		p.mu.Unlock()
		p.log.Warn("handler: cannot record the limits the provider announced; the rule's own limits hold", "rule", p.rule, "subject", subject, "error", err)
		return
	}
	p.log.Debug("handler: the provider's announced limits bind the rule", "rule", p.rule, "subject", subject, "limits", learned)
}
